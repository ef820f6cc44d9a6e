"""A learner at the end of its training: what it reports, and whether it stays up.

Under a StatefulSet (restartPolicy Always) a learner that exits when done is restarted: it resumes
from its last checkpoint at the final step, registers and leaves again. What it reports then must be
its real final progress, and with ``--when-done wait`` (what the operator sets) it does not exit at
all until it is stopped.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from diloco_testbed.ports import free_port
from diloco_testbed.process import stop_all
from diloco_testbed.waiting import wait_for
from diloco_worker.health import Health

from tests.worker.helpers import Synchronizer, iter_logs, learner_process

FLAGS = ["--inner-steps", "4", "--fragments", "2", "--overlap", "1", "--max-steps", "12"]


@pytest.mark.parametrize(("when_done", "stopped", "waits"), [
    ("exit", False, False),
    ("exit", True, False),
    ("wait", False, True),
    ("wait", True, False),  # asked to stop (SIGTERM) before the end: leave as usual
])  # fmt: skip
def test_only_a_learner_that_finished_in_wait_mode_stays_up(
    when_done: str, stopped: bool, waits: bool
) -> None:
    from diloco_worker.cli import waits_when_done

    assert waits_when_done(when_done, stopped=stopped) is waits  # type: ignore[arg-type]


def test_a_finished_learner_is_alive_and_ready() -> None:
    health = Health(stale_after_s=10, clock=lambda: 0.0)
    health.beat("finished")
    assert (health.answer("/healthz").status, health.answer("/readyz").status) == (200, 200)


@pytest.mark.integration
@pytest.mark.slow
def test_a_learner_started_again_after_the_end_reports_its_final_progress(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=4, fragments=2)
    sync.start()
    flags = [*FLAGS, "--checkpoint-dir", str(tmp_path / "ck")]
    first = learner_process(tmp_path, "a", sync.url, flags)
    again = learner_process(tmp_path, "a", sync.url, flags)
    try:
        first.start()
        wait_for(
            lambda: not first.running(),
            timeout=300,
            what="a trains to the end",
            describe=first.failure_report,
        )
        assert first.returncode() == 0, first.failure_report()
        (done,) = sync.status()["learners"]
        assert (done["state"], done["step"]) == ("left", 12)
        assert done["tokens"] > 0

        again.start()  # what a StatefulSet does with a learner that exited
        wait_for(
            lambda: not again.running(), timeout=300, what="a exits again", describe=again.failure_report
        )
        assert any("resumed from checkpoint" in ln for ln in iter_logs(again))
        (after,) = sync.status()["learners"]
        assert (after["state"], after["step"], after["tokens"]) == ("left", 12, done["tokens"])
        assert sync.status()["tokens"] == done["tokens"]

        sync.stop()  # and a restarted synchronizer still knows how far the learner got
        sync.start()
        (restored,) = sync.status()["learners"]
        assert (restored["state"], restored["step"], restored["tokens"]) == ("left", 12, done["tokens"])
    finally:
        stop_all([first, again])
        sync.stop()


@pytest.mark.integration
@pytest.mark.slow
def test_in_wait_mode_a_finished_learner_stays_up_ready_until_sigterm(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=4, fragments=2)
    sync.start()
    port = free_port()
    a = learner_process(tmp_path, "a", sync.url, [*FLAGS, "--when-done", "wait", "--health-port", str(port),
                                                  "--health-host", "127.0.0.1"])  # fmt: skip
    try:
        a.start()
        wait_for(lambda: any("waiting to be stopped" in ln for ln in iter_logs(a)), timeout=300,
                 what="a finishes training", describe=a.failure_report)  # fmt: skip
        assert a.running(), a.failure_report()
        (done,) = sync.status()["learners"]
        assert (done["state"], done["step"]) == ("left", 12)  # it left the quorum all the same
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert (ready.status_code, ready.json()["phase"]) == (200, "finished")
        assert a.pid is not None
        os.kill(a.pid, signal.SIGTERM)
        wait_for(lambda: not a.running(), timeout=60, what="a exits after SIGTERM")
        assert a.returncode() == 0, a.failure_report()
    finally:
        stop_all([a])
        sync.stop()
