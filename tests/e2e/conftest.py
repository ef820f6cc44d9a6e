"""Fixtures of the end-to-end tests: the cluster with its images (see cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from diloco_testbed.kube import Cluster
from diloco_testbed.node import RealNode
from diloco_testbed.storage import (
    SECRET,
    STORAGE_NAMESPACE,
    S3Credentials,
    create_secret_and_bucket,
    deploy_seaweedfs,
)
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import helm_install_operator, helm_uninstall


@pytest.fixture(scope="package")
def e2e(kube: Cluster, real_node: RealNode | None) -> Iterator[E2ECluster]:
    cluster = E2ECluster.connect(kube, real_node)
    try:
        yield cluster
    finally:
        cluster.delete_namespaces()


@pytest.fixture(scope="package")
def api(e2e: E2ECluster) -> Iterator[k8s.ApiClient]:
    with e2e.kube.api_client() as client:
        yield client


@pytest.fixture(scope="package")
def s3_credentials(e2e: E2ECluster, api: k8s.ApiClient) -> S3Credentials:
    """SeaweedFS as a pod: Service ``seaweedfs`` in namespace ``storage``, where examples/ expect it."""
    e2e.new_namespace("storage", name=STORAGE_NAMESPACE)
    return deploy_seaweedfs(api, e2e.images["seaweedfs"])


@pytest.fixture(scope="package")
def jobs_namespace(e2e: E2ECluster) -> str:
    """The namespace of the tests' DiLoCoJobs, the one the operator watches."""
    return e2e.new_namespace("jobs")


@pytest.fixture(scope="package")
def storage_secret(
    e2e: E2ECluster, api: k8s.ApiClient, s3_credentials: S3Credentials, jobs_namespace: str
) -> str:
    """The Secret ``diloco-s3`` the examples name, in ``jobs_namespace``, and the bucket ``diloco``."""
    create_secret_and_bucket(api, jobs_namespace, s3_credentials, e2e.images["sync"])
    return SECRET


@pytest.fixture(scope="package")
def operator(e2e: E2ECluster, jobs_namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The chart installed with the test images, watching ``jobs_namespace``; yields its namespace."""
    ns = helm_install_operator(e2e, tmp_path_factory.mktemp("helm"), [jobs_namespace])
    try:
        yield ns
    finally:
        helm_uninstall(e2e, ns)
