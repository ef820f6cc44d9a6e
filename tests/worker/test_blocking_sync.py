"""``--blocking-sync`` (synchronous DiLoCo) with real learner processes and a real synchronizer:
with the quorum at every learner, a dead learner stalls the others until it is back."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from diloco_testbed.process import ManagedProcess, stop_all
from diloco_testbed.waiting import wait_for

from tests.worker.helpers import Synchronizer, learner_process, metric_step

pytestmark = [pytest.mark.integration, pytest.mark.slow]
H, P = 4, 2
QUIET_S = 6.0  # a tiny-model step takes a few ms to a few hundred ms: this long without one is a stall


def _flags(tmp: Path, name: str) -> list[str]:
    return [
        "--inner-steps", str(H), "--fragments", str(P), "--overlap", "0", "--blocking-sync",
        "--max-steps", "100000", "--lr", "3e-3", "--warmup-steps", "5",
        "--checkpoint-dir", str(tmp / f"ck-{name}"), "--checkpoint-every", "3",
    ]  # fmt: skip


def _status_of(sync: Synchronizer, name: str) -> dict[str, float]:
    by_id = {x["learner_id"]: x for x in sync.status()["learners"]}
    return by_id.get(name, {"step": 0, "blocked_s": 0.0})


def _stalled_step(sync: Synchronizer, name: str, proc: ManagedProcess, timeout: float = 120) -> int:
    """The step at which ``name`` stops advancing (its reported step unchanged for ``QUIET_S``)."""
    seen: dict[str, float] = {"step": -1, "since": time.monotonic()}

    def probe() -> int | None:
        assert proc.running(), proc.failure_report()
        step = int(_status_of(sync, name)["step"])
        now = time.monotonic()
        if step != seen["step"]:
            seen.update(step=step, since=now)
            return None
        return step if now - seen["since"] >= QUIET_S else None

    return wait_for(probe, timeout=timeout, what=f"{name} stalls", interval=0.5, describe=proc.failure_report)


def test_a_dead_learner_stalls_the_other_until_it_is_back(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=P, overlap=0, quorum=2)
    sync.start()
    a = learner_process(tmp_path, "a", sync.url, [*_flags(tmp_path, "a"), "--num-learners", "2"])
    b = learner_process(
        tmp_path, "b", sync.url, [*_flags(tmp_path, "b"), "--learner-index", "1", "--num-learners", "2"]
    )
    try:
        a.start()
        b.start()
        # both train through several rounds in lockstep
        wait_for(
            lambda: min(sync.versions().values(), default=-1) >= 3,
            timeout=240,
            what="three rounds of every fragment",
            describe=lambda: a.failure_report() + b.failure_report(),
        )
        blocked_before = _status_of(sync, "a")["blocked_s"]
        assert b.pid is not None
        os.kill(b.pid, signal.SIGKILL)
        wait_for(lambda: not b.running(), timeout=30, what="b exits after SIGKILL")
        b_killed_at = metric_step(tmp_path / "b.jsonl")

        # a runs into the next round that needs b, and waits there
        stalled = _stalled_step(sync, "a", a)
        assert stalled <= b_killed_at + H  # at most one round past b
        versions_down = sync.versions()
        time.sleep(QUIET_S)
        assert int(_status_of(sync, "a")["step"]) == stalled
        assert sync.versions() == versions_down  # no round can close without b
        assert metric_step(tmp_path / "a.jsonl") <= stalled
        # the wait is blocked time, reported while it lasts
        assert _status_of(sync, "a")["blocked_s"] >= blocked_before + QUIET_S

        b.start()  # resumes from its checkpoint and takes its place in the round cycle
        wait_for(
            lambda: int(_status_of(sync, "a")["step"]) >= stalled + 2 * H,
            timeout=240,
            what="a advances again once b is back",
            describe=lambda: a.failure_report() + b.failure_report(),
        )
        wait_for(
            lambda: all(v >= versions_down[p] + 2 for p, v in sync.versions().items()),
            timeout=120,
            what="rounds close again",
        )
        for proc in (a, b):
            proc.stop(timeout=90)
            assert proc.returncode() == 0, proc.failure_report()
        assert any("resumed from checkpoint" in ln for ln in b.log_path.read_text().splitlines())
    finally:
        stop_all([a, b])
        sync.stop()


def test_a_learner_stops_waiting_once_the_others_finished_and_left(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=P, overlap=0, quorum=2)
    sync.start()
    a = learner_process(tmp_path, "a", sync.url, [*_flags(tmp_path, "a"), "--num-learners", "2"])
    b = learner_process(
        tmp_path, "b", sync.url, [*_flags(tmp_path, "b"), "--learner-index", "1", "--num-learners", "2"]
    )
    # a has twice b's steps: after b leaves, no round can reach the quorum of 2 again
    a.argv[a.argv.index("--max-steps") + 1] = "24"
    b.argv[b.argv.index("--max-steps") + 1] = "12"
    try:
        a.start()
        b.start()
        for proc in (b, a):
            wait_for(lambda p=proc: not p.running(), timeout=240, what=f"{proc.name} finishes",
                     describe=proc.failure_report)  # fmt: skip
            assert proc.returncode() == 0, proc.failure_report()
        by_id = {x["learner_id"]: x for x in sync.status()["learners"]}
        assert (by_id["a"]["step"], by_id["b"]["step"]) == (24, 12)
        assert any("too few learners left" in ln for ln in a.log_path.read_text().splitlines())
    finally:
        stop_all([a, b])
        sync.stop()
