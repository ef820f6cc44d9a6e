"""The learner's step-boundary decisions. A learner against a synchronizer whose pending budget is
full, with real processes: its further parts are answered ``pending_full`` and retried, it holds the
fragment back while one waits (the progress of its due steps goes into a later, larger part, queued
before a new version replaces it), and once a round frees room every part is taken in order: none is
refused for good. Every rank of a unit holds back and answers the same fragments, whatever their
numbers."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from diloco_testbed.process import stop_all
from diloco_testbed.waiting import wait_for

from tests.worker.helpers import Synchronizer, learner_process, run_on_two_ranks

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


_UNIT_DECISIONS = """
import sys, types, torch
from diloco_worker.distributed import join_unit
from diloco_worker.session import DiLoCoSession

rank = int(sys.argv[1])
unit = join_unit({"WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": sys.argv[2]}, torch.device("cpu"))
leader = rank == 0
queued, submitted, marked = [], [], []


class Counters(list):
    def unsent(self, p):
        return True


counters = Counters(types.SimpleNamespace(base_version=0, steps=3, sent_at=0) for _ in range(1024))
comm = types.SimpleNamespace(
    pending=lambda p: p == 63,
    requests=lambda: {64: 0, 1000: 0},
    submit=lambda c: submitted.append(c),
    answered=lambda p: None,
)
fs = types.SimpleNamespace(
    due=lambda: [1, 63],
    counters=counters,
    take_contribution=lambda p, codec, ef: types.SimpleNamespace(fragment=p, base_version=0, steps=3),
    mark_sent=marked.append,
)
session = types.SimpleNamespace(
    fs=fs, _held_back=set(), comm=comm if leader else None, blocking=None, unit=unit,
    settings=types.SimpleNamespace(learner_id="a"), terms=types.SimpleNamespace(codec="int4", error_feedback=True),
    _queue=lambda p, step: queued.append(p),
)
due = DiLoCoSession._send_due(session, 100)
print("DUE", due, sorted(session._held_back), queued)
DiLoCoSession._send_requested(session, 100)
print("REQUESTED", [c.fragment for c in submitted] if leader else marked)
unit.close()
"""


def test_every_rank_of_a_unit_holds_back_and_answers_the_same_fragments_past_63() -> None:
    """Rank 0 alone knows which fragments still wait to be sent and which rounds asked for this
    learner; the others hold back and count the same ones, fragment 63 and beyond included."""
    outputs = run_on_two_ranks(_UNIT_DECISIONS)
    for out in outputs:
        assert "DUE [1] [63] [1]" in out, outputs
        assert "REQUESTED [64, 1000]" in out, outputs
