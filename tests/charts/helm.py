"""Running the real helm binary on the chart, and reading what it renders."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from diloco_testbed.prereq import require_binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "diloco"
KUBE_VERSION = "1.34.0"
Manifest = dict[str, Any]


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def manifests(self) -> list[Manifest]:
        return [d for d in yaml.safe_load_all(self.stdout) if d]


def helm(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> HelmResult:
    binary = require_binary("helm")
    done = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    return HelmResult(done.returncode, done.stdout, done.stderr)


def values_args(tmp_path: Path, values: dict[str, Any] | None) -> list[str]:
    if not values:
        return []
    path = tmp_path / f"values-{len(list(tmp_path.glob('values-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["--values", str(path)]


def render(
    tmp_path: Path,
    values: dict[str, Any] | None = None,
    *,
    namespace: str = "diloco-system",
    release: str = "diloco",
    extra: tuple[str, ...] = (),
) -> list[Manifest]:
    """`helm template` with CRDs included; fails the test with helm's message if it fails."""
    result = helm(
        "template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION,
        "--include-crds", *values_args(tmp_path, values), *extra,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.manifests


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def one(manifests: list[Manifest], kind: str) -> Manifest:
    found = of_kind(manifests, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def flat_rules(rules: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    """PolicyRules as a set of (apiGroup, resource, resourceName, verb): equal sets grant equal rights."""
    out: set[tuple[str, str, str, str]] = set()
    for rule in rules:
        names = rule.get("resourceNames") or ["*"]
        for group in rule.get("apiGroups", [""]):
            for resource in rule.get("resources", []):
                for name in names:
                    out |= {(group, resource, name, verb) for verb in rule["verbs"]}
        for url in rule.get("nonResourceURLs", []):
            out |= {("<url>", url, "*", verb) for verb in rule["verbs"]}
    return out
