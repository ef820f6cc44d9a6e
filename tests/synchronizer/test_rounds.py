"""Rounds in a real synchronizer: a silent learner never blocks a round; a plan given at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.waiting import wait_for
from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import Learner, encode_grad, initial_params, outer_grad, status, tiny_plan

pytestmark = pytest.mark.integration
PLAN = tiny_plan()


def test_a_silent_learner_does_not_block_the_round(sync_factory: SyncFactory) -> None:
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "2",
            "--heartbeat-timeout-s", "2"]  # fmt: skip
    sync = sync_factory(args=args)
    a, b, c = (Learner(sync.url, name, PLAN) for name in "abc")
    for learner in (a, b, c):
        assert learner.register().status_code == 200
    for p in (0, 1):
        assert a.init(p, initial_params(PLAN, p)).status_code == 200
    for learner in (a, b):
        assert learner.heartbeat(4).status_code == 200
        assert (
            learner.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, ord(learner.id)), 0, 0)).status_code
            == 202
        )
    got = a.fetch(0, newer_than=0, wait=30)  # c never contributes: the round goes on without it
    assert got is not None
    assert got[0] == 1
    assert status(sync.url)["recent_rounds"][0]["participants"] == ["a", "b"]  # type: ignore[index]
    wait_for(
        lambda: {lr["learner_id"]: lr["state"] for lr in status(sync.url)["learners"]}["c"] == "dead",  # type: ignore[union-attr, index]
        timeout=30,
        what="the silent learner to be reported dead",
    )


def test_plan_given_at_start_up(sync_factory: SyncFactory, tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(PLAN.to_dict()))
    sync = sync_factory(
        args=["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--plan", str(plan_file)]
    )
    ok = Learner(sync.url, "a", PLAN).register()
    assert ok.status_code == 200
    assert ok.json()["plan_hash"] == PLAN.hash()
    other = Learner(sync.url, "b", tiny_plan(fragments=2, inner_steps=5)).register()
    assert other.status_code == 409
    assert other.json()["code"] == "plan_mismatch"
