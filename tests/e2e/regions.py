"""A second region for the end-to-end tests: another cluster on this machine, joined to the first
by a wide-area link.

Region A is the tests' cluster (``e2e``: the test control plane and its real node). ``second_region``
starts region B: a control plane of its own (no kwok), a real node of its own (another node instance:
its own containerd, kubelet folder, cgroup root, network namespace and pod subnet), the operator from
the chart and SeaweedFS as pods, exactly as region A has them; and a ``Wan`` between the two nodes'
namespaces, the only path between the regions. Leaving the context removes all of it: the link, the
node (its containers, mounts, cgroups and namespace, with the iptables chains in it), the control
plane's processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from diloco_testbed.kube import ControlPlane
from diloco_testbed.node import RealNode
from diloco_testbed.storage import (
    STORAGE_NAMESPACE,
    S3Credentials,
    create_secret_and_bucket,
    deploy_seaweedfs,
)
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import helm_install_operator
from tests.support.wan import Wan


@dataclass
class Region:
    """A region as the tests use it: its cluster with the images, an API client, the namespace of
    its jobs (watched by its operator, holding the storage Secret ``diloco-s3``)."""

    e2e: E2ECluster
    api: k8s.ApiClient
    jobs_namespace: str


@contextlib.contextmanager
def second_region(first: RealNode, workdir: Path, tmp: Path, *, rate: str) -> Iterator[tuple[Region, Wan]]:
    """Region B, and the link from ``first`` (region A's node) to its node, limited to ``rate``."""
    with contextlib.ExitStack() as stack:
        plane = ControlPlane(workdir / "kube", with_kwok=False)
        stack.callback(plane.close)
        plane.start()
        assert plane.pki is not None
        api = stack.enter_context(plane.api_client())
        node = RealNode(workdir / "node", apiserver_port=plane.ports["apiserver"], ca_cert=plane.pki.ca_cert,
                        token=plane.token, api=api, images=first.images, taint=False)  # fmt: skip
        stack.callback(node.close)
        node.start()
        assert first.inst is not None
        assert node.inst is not None
        wan = Wan(first.inst, node.inst)
        stack.callback(wan.close)
        wan.open()
        wan.limit(rate)
        e2e = E2ECluster.connect(plane, node)
        jobs = e2e.new_namespace("jobs")
        tmp.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=2) as pool:  # both wait for pods: side by side
            operator = pool.submit(helm_install_operator, e2e, tmp, [jobs])
            storage = pool.submit(_storage, e2e, api, jobs)
            operator.result()
            storage.result()
        yield Region(e2e, api, jobs), wan


def _storage(e2e: E2ECluster, api: k8s.ApiClient, jobs: str) -> S3Credentials:
    """The region's own S3 server (its learners' checkpoints stay in the region) and bucket."""
    e2e.new_namespace("storage", name=STORAGE_NAMESPACE)
    creds = deploy_seaweedfs(api, e2e.images["seaweedfs"])
    create_secret_and_bucket(api, jobs, creds, e2e.images["sync"])
    return creds
