"""kwok: the stage configuration and the fake nodes it keeps Ready.

kwok up to v0.7.0 uses its default pod stages only when the configuration lists no pod stage,
so adding the chaos stage means listing the defaults (pod/fast: ready, complete, delete) too.
Node stages are not listed, so kwok keeps its default node stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .prereq import BUILD_HINT, unavailable

NODE_ANNOTATION = "kwok.x-k8s.io/node"
NODE_SELECTOR = f"{NODE_ANNOTATION}=fake"
FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
POD_STAGES = (
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
    "pod/chaos/pod-container-running-failed.yaml",
)


@dataclass(frozen=True)
class FakeNode:
    name: str
    region: str
    zone: str
    cpu: str = "32"
    memory: str = "256Gi"
    gpus: str = "8"
    pods: str = "110"


DEFAULT_NODES = (
    FakeNode("kwok-a-0", "region-a", "region-a-1"),
    FakeNode("kwok-a-1", "region-a", "region-a-2"),
    FakeNode("kwok-b-0", "region-b", "region-b-1"),
    FakeNode("kwok-b-1", "region-b", "region-b-2"),
)


def write_config(stages_dir: Path, target: Path) -> Path:
    """Concatenate the stock stage files shipped with the kwok build into one kwok config."""
    docs = []
    for rel in POD_STAGES:
        path = stages_dir / rel
        if not path.is_file():
            unavailable(f"kwok stage file {path} is missing: {BUILD_HINT}")
        docs.append(path.read_text().strip())
    target.write_text("\n---\n".join(docs) + "\n")
    return target


def node_manifest(node: FakeNode) -> dict[str, Any]:
    resources = {"cpu": node.cpu, "memory": node.memory, "pods": node.pods, "nvidia.com/gpu": node.gpus}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "annotations": {NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "topology.kubernetes.io/region": node.region,
                "topology.kubernetes.io/zone": node.zone,
            },
        },
        "spec": {},
        "status": {
            "allocatable": resources,
            "capacity": resources,
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "fake"},
            "phase": "Running",
        },
    }
