"""Shared fixtures: a real Kubernetes control plane and a real S3 server.

- `kube` (session): etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok with
  kwok nodes, on free loopback ports (binaries from scripts/build-test-binaries.sh, found through
  $DILOCO_TEST_BIN_DIR or ~/.cache/diloco/bin/current); or, with DILOCO_TEST_KUBECONFIG=PATH, an
  existing cluster (e.g. kind). While it is up, os.environ["KUBECONFIG"] points at its
  kubeconfig, so kopf and child processes find it; the previous value is restored afterwards.
- `namespace` (function): a fresh namespace in that cluster, deleted after the test.
- `s3` (session): SeaweedFS with an access/secret key; `s3_server_factory` (function): a callable
  that starts a dedicated server which the test may `.stop()` and `.start()` again.
- `real_node` (session): a real node (containerd, kubelet, kube-proxy, CoreDNS; diloco_testbed.node)
  joined to the control plane of `kube`, with the images of scripts/build-test-images.sh (named by
  $DILOCO_TEST_IMAGES) imported; None with DILOCO_TEST_KUBECONFIG, whose cluster has nodes of its own.

A missing binary or a server that cannot start FAILS the test with what to install or run;
outside CI, DILOCO_TEST_SKIP_MISSING=1 turns that into a skip with the same message.
Server logs go to a temporary folder printed at start-up (see `pytest -s` or the failure report);
it is removed after a run where every test passed unless DILOCO_TEST_KEEP_LOGS=1.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # `tests.support` must import however pytest was started
    sys.path.insert(0, str(_ROOT))

from diloco_testbed.kube import Cluster, ControlPlane, connect_cluster  # noqa: E402
from diloco_testbed.node import RealNode, load_image_set  # noqa: E402
from diloco_testbed.s3_server import S3Server  # noqa: E402


@pytest.fixture(scope="session")
def test_logs_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """One folder for the logs and data of every server of this session.

    Removed at the end when every test passed, kept (and named) otherwise or when
    DILOCO_TEST_KEEP_LOGS=1.
    """
    path = Path(tempfile.mkdtemp(prefix="diloco-test-"))
    print(f"\n[tests] server logs in {path}")
    yield path
    if request.session.testsfailed or os.environ.get("DILOCO_TEST_KEEP_LOGS") == "1":
        print(f"\n[tests] server logs kept in {path}")
    else:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def kube(test_logs_dir: Path) -> Iterator[Cluster]:
    cluster = connect_cluster(test_logs_dir / "kube")
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = cluster.kubeconfig
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        cluster.close()


@pytest.fixture(scope="session")
def real_node(kube: Cluster, test_logs_dir: Path) -> Iterator[RealNode | None]:
    if not isinstance(kube, ControlPlane):
        yield None
        return
    assert kube.pki is not None
    with kube.api_client() as api:
        node = RealNode(
            test_logs_dir / "node", apiserver_port=kube.ports["apiserver"], ca_cert=kube.pki.ca_cert,
            token=kube.token, api=api, images=load_image_set(os.environ.get("DILOCO_TEST_IMAGES")),
        )  # fmt: skip
        node.start()
        try:
            yield node
        finally:
            node.close()


@pytest.fixture
def namespace(kube: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = kube.create_namespace(f"t-{base}" if base else "t")
    try:
        yield name
    finally:
        kube.delete_namespace(name)


@pytest.fixture(scope="session")
def s3(test_logs_dir: Path) -> Iterator[S3Server]:
    server = S3Server(test_logs_dir / "s3")
    server.start()
    try:
        yield server
    finally:
        server.discard()


@pytest.fixture
def s3_server_factory(test_logs_dir: Path) -> Iterator[Callable[[], S3Server]]:
    """`s3_server_factory()` starts a dedicated S3 server; all are killed after the test."""
    servers: list[S3Server] = []

    def start() -> S3Server:
        server = S3Server(Path(tempfile.mkdtemp(prefix="s3-", dir=test_logs_dir)))
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.discard()


GPU_SKIP_REASON = "needs a CUDA GPU; PyTorch sees none on this machine (tests marked gpu are skipped)"
KWOK_SKIP_REASON = (
    "waits for pods on the test control plane's kwok nodes (which run no process and take any image); "
    "an existing cluster (DILOCO_TEST_KUBECONFIG) has none"
)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``kwok`` are skipped on an existing cluster."""
    if item.get_closest_marker("kwok") is not None and os.environ.get("DILOCO_TEST_KUBECONFIG"):
        pytest.skip(KWOK_SKIP_REASON)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped, all with one message, where PyTorch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: most of the suite does not need PyTorch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip)
