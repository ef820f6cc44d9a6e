"""A learner's records: what goes to tracking, and the same records in the file and in TensorBoard."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_core.config import TrackingSettings
from diloco_core.tracking import open_tracking
from diloco_worker.metrics import MetricsLog, read_metrics, tracked_scalars

from tests.support.tensorboard_files import read_scalars


def test_tracked_scalars_take_the_numbers_and_derive_version_and_blocked_share() -> None:
    previous = {"time": 100.0, "blocked_s": 1.0}
    record = {
        "time": 110.0, "step": 20, "loss": 3.5, "eval_loss": None, "lr": 1e-3, "tokens": 4096, "blocked_s": 1.5,
        "versions": {"0": 7, "1": 6}, "learner": "a", "pid": 12, "bytes_sent": 900, "resumed": True,
    }  # fmt: skip
    out = tracked_scalars(record, previous)
    assert out == {
        "loss": 3.5, "lr": 1e-3, "tokens": 4096.0, "bytes_sent": 900.0, "global_version": 6.0,
        "blocked_pct": pytest.approx(5.0),  # 0.5 s blocked in 10 s
    }  # fmt: skip
    assert "blocked_pct" not in tracked_scalars(record, None)  # the first record has no window


def test_records_go_to_the_file_and_to_tensorboard_alike(tmp_path: Path) -> None:
    tracking = open_tracking(TrackingSettings(tensorboard=str(tmp_path / "tb")), run="a", group="job")
    log = MetricsLog(tmp_path / "a.jsonl", tracking=tracking, learner="a")
    log.set(bytes_sent=10)
    for step in (1, 2, 3):
        log.write(step=step, loss=4.0 - step, blocked_s=0.0)
    log.close()
    assert [r["loss"] for r in read_metrics(tmp_path / "a.jsonl")] == [3.0, 2.0, 1.0]
    scalars = read_scalars(tmp_path / "tb" / "a")
    assert scalars["loss"] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert scalars["bytes_sent"] == [(1, 10.0), (2, 10.0), (3, 10.0)]


def test_tracking_alone_needs_no_metrics_file(tmp_path: Path) -> None:
    tracking = open_tracking(TrackingSettings(tensorboard=str(tmp_path)), run="b", group="job")
    log = MetricsLog(None, tracking=tracking)
    log.write(step=1, loss=2.0)
    log.close()
    assert read_scalars(tmp_path / "b") == {"loss": [(1, 2.0)]}
