"""What the end-to-end tests run on: a cluster with real nodes and the project's images on them.

On the test control plane that is its real node (``real_node``) with the images of
scripts/build-test-images.sh; on an existing cluster (DILOCO_TEST_KUBECONFIG, kind say) its own
nodes, with the images named by DILOCO_TEST_WORKER_IMAGE, DILOCO_TEST_SYNC_IMAGE and
DILOCO_TEST_SEAWEEDFS_IMAGE (scripts/test-kind.sh loads and names them).
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field

from diloco_testbed.kube import Cluster
from diloco_testbed.node import RealNode
from diloco_testbed.prereq import unavailable
from kubernetes import client as k8s

IMAGE_VARIABLES = {
    "worker": "DILOCO_TEST_WORKER_IMAGE",
    "sync": "DILOCO_TEST_SYNC_IMAGE",
    "seaweedfs": "DILOCO_TEST_SEAWEEDFS_IMAGE",
}


@dataclass
class E2ECluster:
    kube: Cluster
    node: RealNode | None
    images: dict[str, str]
    namespaces: list[str] = field(default_factory=list)

    @classmethod
    def connect(cls, kube: Cluster, node: RealNode | None) -> E2ECluster:
        if node is not None:
            return cls(kube, node, {name: image.image for name, image in node.images.items()})
        missing = [var for var in IMAGE_VARIABLES.values() if not os.environ.get(var)]
        if missing:
            unavailable(f"an existing cluster needs the images named: set {', '.join(missing)} "
                        "(scripts/test-kind.sh builds, loads and names them)")  # fmt: skip
        return cls(kube, None, {name: os.environ[var] for name, var in IMAGE_VARIABLES.items()})

    def annotations(self) -> dict[str, str]:
        return self.node.namespace_annotations() if self.node is not None else {}

    def new_namespace(self, prefix: str, name: str | None = None) -> str:
        """A namespace whose pods run on the real node (any node of an existing cluster)."""
        name = name or f"e2e-{prefix}-{secrets.token_hex(3)}"
        with self.kube.api_client() as api:
            k8s.CoreV1Api(api).create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(
                name=name, labels={"diloco-test": "true"}, annotations=self.annotations())))  # fmt: skip
        self.namespaces.append(name)
        return name

    def delete_namespaces(self) -> None:
        for name in self.namespaces:
            self.kube.delete_namespace(name)
        self.namespaces.clear()


def now() -> float:
    return time.monotonic()
