"""What a real learner process writes: log lines that name the learner, step, fragment and version
they concern, and a JSONL metrics file with the fields the runner and the report read."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from diloco_testbed.process import stop_all
from diloco_testbed.waiting import wait_for
from diloco_worker.metrics import read_metrics
from diloco_worker.startup import PHASES

from tests.support.tensorboard_files import read_scalars
from tests.worker.helpers import Synchronizer, iter_logs, learner_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 32
FLAGS = [
    "--inner-steps",
    "4",
    "--fragments",
    "2",
    "--overlap",
    "1",
    "--max-steps",
    str(STEPS),
    "--eval-every",
    "8",
]
FIELDS = {
    "time",
    "learner",
    "pid",
    "step",
    "loss",
    "tokens",
    "tokens_per_s",
    "step_time_s",
    "blocked_s",
    "eval_loss",
}
# every line of the worker's log carries its learner in the prefix
PREFIX = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR) \[learner=lg\] diloco_worker[.\w]*: ")
ABOUT_A_FRAGMENT = {
    "queued": re.compile(
        r"learner=lg step=\d+ fragment=\d version=-?\d+ outer gradient queued \(\d+ steps\)"
    ),
    "sent": re.compile(
        r"step=\d+ fragment=\d version=-?\d+ sent \d+ bytes \(\d+ inner steps\) in \d+\.\d+s: "
    ),
    "applied": re.compile(r"learner=lg step=\d+ fragment=\d version=\d+ applied"),
}


def test_log_lines_and_metrics_records_carry_what_they_are_about(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=4, fragments=2)
    sync.start()
    learner = learner_process(tmp_path, "lg", sync.url, FLAGS)
    try:
        learner.start()
        wait_for(lambda: not learner.running() or None, timeout=300, what="the learner finishes")
        assert learner.returncode() == 0, learner.failure_report()
    finally:
        stop_all([learner])
        sync.stop()

    lines = [ln for ln in iter_logs(learner) if not ln.startswith("===")]
    worker_lines = [ln for ln in lines if " diloco_worker" in ln]
    assert worker_lines
    assert all(PREFIX.match(ln) for ln in worker_lines), [ln for ln in worker_lines if not PREFIX.match(ln)][
        :3
    ]
    for what, pattern in ABOUT_A_FRAGMENT.items():
        kind = {"queued": "outer gradient queued", "sent": " bytes (", "applied": " applied"}[what]
        about = [ln for ln in worker_lines if kind in ln]
        assert about, f"no {what} line"
        assert all(pattern.search(ln) for ln in about), [ln for ln in about if not pattern.search(ln)][:3]
    assert any(re.search(rf"step={STEPS} loss=\d+\.\d+ tokens/s=\d+", ln) for ln in worker_lines)

    records = read_metrics(tmp_path / "lg.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # --log-every 1
    for r in records:
        assert r.keys() >= FIELDS, sorted(r.keys())
        assert r["learner"] == "lg"
        assert math.isfinite(r["loss"])
        assert r["tokens"] == r["step"] * 8 * 32
        assert r["tokens_per_s"] > 0
        assert r["blocked_s"] >= 0
    # bytes sent and the fragments' versions join the records once the first boundary reported them
    last = records[-1]
    assert last["bytes_sent"] > 0
    assert set(last["versions"]) == {"0", "1"}
    assert last["eval_loss"] is not None
    blocked = [r["blocked_s"] for r in records]
    assert blocked == sorted(blocked)  # cumulative
    assert blocked[-1] > 0
    # the first step's record (and only it) carries the process's start-up, phase by phase
    first = records[0]
    assert set(first["startup_phases"]) == set(PHASES)
    assert set(first["startup_cpu_phases"]) == set(PHASES)
    assert first["startup_s"] == pytest.approx(sum(first["startup_phases"].values()), abs=1e-3)
    assert first["startup_cpu_s"] > 0
    assert first["startup_s"] > 0
    assert first["launched_at"] < first["first_step_at"] <= first["time"]
    assert first["resumed_blocked_s"] == 0.0  # a fresh start: nothing blocked before
    assert not any("startup_s" in r for r in records[1:])
    assert sum("start-up took" in ln for ln in worker_lines) == 1


def test_learner_and_synchronizer_write_tensorboard_runs_side_by_side(tmp_path: Path) -> None:
    board = tmp_path / "tensorboard"
    sync = Synchronizer(tmp_path, inner_steps=4, fragments=2, extra=["--tensorboard", str(board)])
    sync.start()
    learner = learner_process(
        tmp_path, "lt", sync.url, [*FLAGS, "--tensorboard", str(board), "--log-every", "4"]
    )
    try:
        learner.start()
        wait_for(lambda: not learner.running() or None, timeout=300, what="the learner finishes")
        assert learner.returncode() == 0, learner.failure_report()
    finally:
        stop_all([learner])
        sync.stop()  # an orderly stop flushes the synchronizer's run
    assert sorted(p.name for p in board.iterdir()) == ["lt", "synchronizer-0"]
    learner_run = read_scalars(board / "lt")
    assert [step for step, _ in learner_run["loss"]] == [1, *range(4, STEPS + 1, 4)]  # the first step always
    for tag in ("lr", "grad_norm", "tokens_per_s", "eta_s", "bytes_sent", "global_version", "eval_loss"):
        assert tag in learner_run, (tag, sorted(learner_run))
    assert learner_run["eta_s"][-1] == (STEPS, 0.0)  # nothing left at the last step
    rounds = read_scalars(board / "synchronizer-0")
    merged = rounds["fragment_0/merged_steps"]
    assert [version for version, _ in merged] == list(range(1, len(merged) + 1))
    assert all(steps > 0 for _, steps in merged)
    assert {"fragment_1/participants", "fragment_1/merged_tokens", "fragment_1/update_norm"} <= rounds.keys()
