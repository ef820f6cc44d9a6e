"""SIGTERM mid-training: a real learner process checkpoints the step it stopped at, exits 0, and a
restarted process resumes from exactly that step."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from diloco_core.storage import FilesystemStore
from diloco_testbed.process import stop_all
from diloco_testbed.waiting import wait_for
from diloco_worker.checkpoint import list_checkpoints, load_latest
from diloco_worker.metrics import read_metrics

from tests.worker.helpers import Synchronizer, iter_logs, learner_process, metric_step

pytestmark = [pytest.mark.integration, pytest.mark.slow]
FLAGS = ["--inner-steps", "8", "--fragments", "2", "--overlap", "1", "--max-steps", "100000"]


def test_sigterm_checkpoints_the_last_step_exits_0_and_a_restart_resumes_there(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=8, fragments=2)
    sync.start()
    ckpt_dir = tmp_path / "ck"
    metrics = tmp_path / "a.jsonl"
    # --checkpoint-every 0: the only checkpoint is the one SIGTERM writes
    a = learner_process(
        tmp_path, "a", sync.url, [*FLAGS, "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "0"]
    )
    try:
        a.start()
        wait_for(lambda: metric_step(metrics) >= 12 or None, timeout=240, what="a at step 12",
                 describe=a.failure_report)  # fmt: skip
        assert list_checkpoints(FilesystemStore(ckpt_dir)) == []
        assert a.pid is not None
        os.kill(a.pid, signal.SIGTERM)
        wait_for(lambda: not a.running() or None, timeout=120, what="a exits after SIGTERM")
        assert a.returncode() == 0, a.failure_report()

        records = read_metrics(metrics)
        last_step = records[-1]["step"]  # --log-every 1: the last record is the step it stopped at
        ckpt = load_latest(FilesystemStore(ckpt_dir))
        assert ckpt is not None
        assert ckpt.step == last_step
        assert ckpt.meta["loop"]["tokens"] == records[-1]["tokens"]
        assert any(f"step={last_step} stopping on request" in ln for ln in iter_logs(a))
        assert any(f"step={last_step} checkpoint written" in ln for ln in iter_logs(a))
        assert {x["learner_id"]: x["state"] for x in sync.status()["learners"]} == {"a": "left"}

        first_pid = records[-1]["pid"]
        a.start()
        wait_for(lambda: any(r["pid"] != first_pid for r in read_metrics(metrics)) or None, timeout=240,
                 what="a's new process logs a step", describe=a.failure_report)  # fmt: skip
        resumed = [ln for ln in iter_logs(a) if "resumed from checkpoint" in ln]
        assert len(resumed) == 1
        assert f"step={last_step} resumed from checkpoint" in resumed[0]
        after = [r for r in read_metrics(metrics) if r["pid"] != first_pid]
        assert after[0]["step"] == last_step + 1
        # its start-up record says what blocked time it resumed with: the checkpoint's
        assert after[0]["resumed_blocked_s"] == ckpt.meta["loop"]["blocked_s"]
        assert after[0]["tokens"] == records[-1]["tokens"] + 8 * 32  # one step of --batch-size 8 x 32
        a.stop(timeout=90)
        assert a.returncode() == 0, a.failure_report()
    finally:
        stop_all([a])
        sync.stop()
