"""`diloco bench checkpoint` runs the learner's own checkpoint code and reports both ways of saving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from diloco_bench import checkpoint
from diloco_core.storage import FilesystemStore
from diloco_worker.checkpoint import load_latest


def test_it_times_the_whole_save_and_the_snapshot_of_a_learner_with_residuals_and_held_versions(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "checkpoint.json"
    argv = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--repeats", "2",
            "--json", str(out)]  # fmt: skip
    assert checkpoint.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["repeats"] == 2
    assert r["whole_save_s"] > 0
    assert r["snapshot_s"] > 0
    assert r["snapshot_to_written_s"] >= r["snapshot_s"]
    assert r["checkpoint_bytes"] > 5 * 4 * r["params"]  # params, two moments, anchors, residuals, held
    assert "before / now" in capsys.readouterr().out


def test_the_state_it_checkpoints_is_a_learners_with_every_role(tmp_path: Path) -> None:
    a = checkpoint.build_parser().parse_args(
        ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16"]
    )
    checkpoint.measure(a, checkpoint.open_device("test", "cpu", 1), tmp_path)  # type: ignore[arg-type]
    ckpt = load_latest(FilesystemStore(tmp_path))
    assert ckpt is not None
    roles = {key.split("/")[0] for key in ckpt.tensors}
    assert {"param", "optim", "anchor", "residual", "held"} <= roles
