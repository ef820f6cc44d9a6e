"""The test binaries built by scripts/build-test-binaries.sh report the pinned versions."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from diloco_testbed.prereq import require_binary

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-test-binaries.sh"


def pinned(variable: str) -> str:
    """The default version the build script pins, e.g. K8S_VERSION -> v1.34.3."""
    match = re.search(rf'^{variable}="\$\{{{variable}:-(v[0-9.]+)\}}"', SCRIPT.read_text(), re.MULTILINE)
    assert match, f"{variable} not pinned in {SCRIPT}"
    return match.group(1)


def version_output(binary: str, *args: str) -> str:
    path = require_binary(binary)
    result = subprocess.run([str(path), *args], capture_output=True, text=True, timeout=60, check=True)
    return result.stdout + result.stderr


@pytest.mark.parametrize(
    "binary", ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy"]
)
def test_kubernetes_binaries_report_pinned_version(binary: str) -> None:
    assert version_output(binary, "--version").strip() == f"Kubernetes {pinned('K8S_VERSION')}"


def test_kubectl_version() -> None:
    assert f"Client Version: {pinned('K8S_VERSION')}" in version_output("kubectl", "version", "--client")


def test_coredns_version() -> None:
    assert f"CoreDNS-{pinned('COREDNS_VERSION').lstrip('v')}" in version_output("coredns", "-version")


def test_pause_program_is_built() -> None:
    assert "pause" in version_output("pause", "-v")


def test_etcd_version() -> None:
    assert f"etcd Version: {pinned('ETCD_VERSION').lstrip('v')}" in version_output("etcd", "--version")


def test_kwok_version() -> None:
    assert version_output("kwok", "--version").startswith(f"kwok version {pinned('KWOK_VERSION')} ")


def test_helm_version_and_default_kube_version(tmp_path: Path) -> None:
    assert version_output("helm", "version", "--short").startswith(pinned("HELM_VERSION"))
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: probe\ndata:\n"
        "  kube: {{ .Capabilities.KubeVersion.Version | quote }}\n"
    )
    rendered = version_output("helm", "template", str(chart))
    minor = pinned("K8S_VERSION").split(".")[1]
    assert re.search(rf'kube: "v1\.{minor}\.\d+"', rendered), rendered
