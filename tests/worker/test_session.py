"""A learner against a synchronizer whose pending budget is full, with real processes: its further
parts are answered ``pending_full`` and retried, it holds the fragment back while one waits (the
progress of its due steps goes into a later, larger part, queued before a new version replaces it),
and once a round frees room every part is taken in order: none is refused for good."""

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
    refused until learner b arrives; meanwhile a keeps training and holds the fragment back; every
    part is then taken (b trains longer, so a's last parts find rounds to join)."""
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
    parts = _after_holding_back(logs)
    # a part was held back, and the progress it had then went, whole, into a later part: that part
    # counts the steps trained since the hold-back and more (a fixed schedule falls due H steps
    # after the last send, so a version taken since may leave fewer than H steps to hold back)
    assert parts
    for held_at, queued_at, steps in parts:
        assert queued_at > held_at, parts
        assert steps > queued_at - held_at, parts
    # the first wait (a alone, refused for room for seconds) holds back more than one part's steps
    assert parts[0][2] > H, parts
    rounds = [json.loads(f.read_text()) for f in sorted((tmp_path / "sync-store").rglob("rounds/0/*.json"))]
    assert sum("a" in r["participants"] for r in rounds) >= 2


_LINE = re.compile(
    r"learner=a step=(?P<step>\d+) fragment=0 (?:version=\d+ )?(?P<what>outer gradient held back|outer gradient "
    r"queued \((?P<steps>\d+) steps\)|applied)"
)


def _after_holding_back(logs: str) -> list[tuple[int, int, int]]:
    """Each time learner a held fragment 0 back: the step it did, the step of the first part it queued
    after, and that part's steps. Fails when a new version replaced progress held back before it was
    queued."""
    parts: list[tuple[int, int, int]] = []
    held_at: int | None = None
    for m in _LINE.finditer(logs):
        if m["what"] == "outer gradient held back":
            held_at = int(m["step"])
        elif m["what"] == "applied":
            assert held_at is None, f"a version replaced progress held back: {m[0]}"
        elif held_at is not None:
            parts.append((held_at, int(m["step"]), int(m["steps"])))
            held_at = None
    return parts
