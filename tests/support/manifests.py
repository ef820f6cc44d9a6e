"""DiLoCoJob manifests for tests of the commands that take one (``-f job.yaml``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# what a manifest must hold that a local run does not use
CLUSTER_PARTS: dict[str, Any] = {
    "images": {"worker": "w:1", "synchronizer": "s:1"},
    "storage": {"bucket": "unused-locally"},
}


def job_manifest(name: str, **spec: Any) -> dict[str, Any]:
    """A ``DiLoCoJob`` named ``name`` whose spec is ``spec`` (over images and storage placeholders)."""
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": name},
        "spec": CLUSTER_PARTS | spec,
    }


def write_manifest(folder: Path, doc: dict[str, Any]) -> Path:
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path
