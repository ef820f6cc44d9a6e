"""Fixtures of the end-to-end tests: the cluster with its images (see cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cluster import E2ECluster
from tests.support.kube import Cluster
from tests.support.node import RealNode


@pytest.fixture(scope="session")
def e2e(kube: Cluster, real_node: RealNode | None) -> Iterator[E2ECluster]:
    cluster = E2ECluster.connect(kube, real_node)
    try:
        yield cluster
    finally:
        cluster.delete_namespaces()
