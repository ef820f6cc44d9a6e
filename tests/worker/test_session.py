"""A learner against a synchronizer whose pending budget is full, with real processes: its further
parts are answered ``pending_full`` and retried, it never queues a second part of a fragment while
one waits (the progress goes into a later, larger part), and once a round frees room every part is
taken in order: none is refused for good."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from diloco_testbed.process import stop_all
from diloco_testbed.waiting import wait_for

from tests.worker.helpers import Synchronizer, learner_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]
H = 4
PLAN = ["--inner-steps", str(H), "--fragments", "1", "--overlap", "1"]


def test_a_learner_waits_for_room_with_one_part_and_loses_none(tmp_path: Path) -> None:
    """Quorum two and a budget of nothing: learner a's first part waits alone for a round, its next is
    refused until learner b arrives; meanwhile a keeps training and queues nothing more; every part
    is then taken (b trains longer, so a's last parts find rounds to join)."""
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=1, quorum=2, extra=["--pending-memory-bytes", "0"])
    sync.start()
    a = learner_process(tmp_path, "a", sync.url, [*PLAN, "--max-steps", "64", "--speed-factor", "40"])
    b = learner_process(tmp_path, "b", sync.url, [*PLAN, "--max-steps", "100", "--speed-factor", "40"])
    log_a = tmp_path / "a.log"
    try:
        a.start()
        wait_for(
            lambda: "pending_full" in log_a.read_text() if log_a.exists() else False,
            timeout=120,
            what="learner a's further part refused for room",
            describe=a.failure_report,
        )
        refused_at = time.monotonic()
        while time.monotonic() - refused_at < 3 and a.running():  # a trains on, past a due step
            time.sleep(0.2)
        b.start()
        deadline = time.monotonic() + 300
        while a.running() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert a.returncode() == 0, a.failure_report()
        assert b.running(), b.failure_report()
    finally:
        stop_all([sync.proc, a, b])
    logs = log_a.read_text()
    assert "contribution refused" not in logs
    assert "pending contributions flushed: True" in logs
    waited = _waits(logs)
    # while its part waited for room, a trained past due steps and queued nothing behind it
    assert waited
    assert max(last - queued_at for queued_at, last in waited) >= H
    rounds = [json.loads(f.read_text()) for f in sorted((tmp_path / "sync-store").rglob("rounds/0/*.json"))]
    assert sum("a" in r["participants"] for r in rounds) >= 2


_LINE = re.compile(
    r"step=(\d+) fragment=0 version=\d+ (?P<what>outer gradient queued|send failed, will retry: HTTP 503 "
    r"pending_full|sent \d+ bytes)"
)


def _waits(logs: str) -> list[tuple[int, int]]:
    """Each stretch learner a's part waited for room: (the step it was queued at, the newest step
    seen while it waited). Fails when a part is queued while another waits."""
    waits: list[tuple[int, int]] = []
    queued_at, waiting = 0, False
    for m in _LINE.finditer(logs):
        step, what = int(m[1]), m["what"]
        if what == "outer gradient queued":
            assert not waiting, f"a part queued at step {step} while the one of step {queued_at} waited"
            queued_at = step
        elif what.startswith("send failed"):
            if not waiting:
                waits.append((queued_at, step))
            waiting = True
            waits[-1] = (queued_at, step)
        else:
            waiting = False
    return waits
