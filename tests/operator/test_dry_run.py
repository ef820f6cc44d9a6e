"""``diloco operator --dry-run -f job.yaml``: the children the operator would apply, as YAML, with no cluster."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.builders.children import build_children
from diloco_operator.builders.names import JobRef
from diloco_operator.cli import main
from diloco_operator.dry_run import PLACEHOLDER_UID
from diloco_operator.schema.spec import parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def jobs(example: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d]


def expected(doc: dict[str, Any]) -> list[dict[str, Any]]:
    meta = doc["metadata"]
    job = JobRef(meta["name"], meta.get("namespace", "default"), PLACEHOLDER_UID)
    return build_children(job, parse_spec(doc["spec"]))


def dry_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_prints_what_the_operator_would_apply(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(capsys, "-f", str(EXAMPLES / "single-region.yaml"))
    assert code == 0
    (doc,) = jobs("single-region.yaml")
    children = expected(doc)
    assert list(yaml.safe_load_all(out)) == children
    kinds = [c["kind"] for c in children]
    assert kinds[0] == "ConfigMap"
    assert {"Deployment", "StatefulSet", "PodDisruptionBudget", "Service"} <= set(kinds)
    # the Secret's value is generated when the job is created: named, never printed
    assert out.startswith("# DiLoCoJob default/gpt-small; also Secret gpt-small-secret")
    assert "; also Secrets gpt-small-a100-token, " in out.splitlines()[0]  # each unit's token: named only
    assert "Secret" not in kinds


def test_every_job_of_a_file_and_standard_input(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (EXAMPLES / "multi-region.yaml").read_text()
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code, out, _ = dry_run(capsys, "-f", "-")
    assert code == 0
    region_a, region_b = jobs("multi-region.yaml")
    assert list(yaml.safe_load_all(out)) == expected(region_a) + expected(region_b)
    # region B uses region A's synchronizer: no synchronizer and no job secret of its own, only its
    # unit's token (made from region A's job secret)
    assert "# DiLoCoJob default/llm-b; also Secrets llm-b-b-0-token (each unit's learner token" in out
    assert not any(c["kind"] == "Deployment" for c in expected(region_b))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
            "document 1 is a ConfigMap, not a diloco.dev/v1alpha1 DiLoCoJob",
        ),
        ("apiVersion: diloco.dev/v1alpha1\nkind: DiLoCoJob\nmetadata: {name: j}\nspec: {}\n", "spec.images"),
        (
            "apiVersion: diloco.dev/v1alpha1\nkind: DiLoCoJob\nmetadata: {name: j}\nspec:\n"
            "  images: {worker: w, synchronizer: s}\n  storage: {bucket: bkt}\n  learnerUnits: [{name: a}]\n"
            "  diloco: {quorum: 2}\n",
            "spec.diloco.quorum (2) exceeds the number of learner units (1)",
        ),
        ("a: [", "while parsing"),
    ],
)
def test_a_spec_that_can_never_work_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(content)
    code, out, err = dry_run(capsys, "-f", str(path))
    assert (code, out) == (2, "")
    assert message in err


def test_needs_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert dry_run(capsys)[0] == 2
    code, _, err = dry_run(capsys, "-f", str(tmp_path / "missing.yaml"))
    assert code == 2
    assert "missing.yaml" in err


def test_needs_no_cluster(tmp_path: Path) -> None:
    """As a command, with a kubeconfig that points nowhere and no in-cluster service account."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "DILOCO_"))}
    env["KUBECONFIG"] = str(tmp_path / "no-such-kubeconfig")
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "operator", "--dry-run", "-f", str(EXAMPLES / "single-region.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert list(yaml.safe_load_all(proc.stdout)) == expected(jobs("single-region.yaml")[0])


def test_a_jobs_queue_label_queues_its_units(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (doc, *_) = jobs("single-region.yaml")
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    code, out, _ = dry_run(capsys, "-f", str(path))
    assert code == 0
    units = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "StatefulSet"]
    assert units
    assert all(u["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team" for u in units)
    doc["metadata"]["labels"] = {}
    doc["spec"]["learnerUnits"][0]["topology"] = {"required": "kubernetes.io/hostname"}
    path.write_text(yaml.safe_dump(doc))
    code, _, err = dry_run(capsys, "-f", str(path))
    assert code != 0
    assert "set spec.queueName" in err
