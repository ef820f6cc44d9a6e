"""Rounds in a real synchronizer: a silent learner never blocks a round; a plan given at start-up."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from diloco_core.protocol import ROUND_DEADLINE_HEADER, ROUND_OPEN_HEADER
from diloco_testbed.waiting import wait_for

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


def test_a_round_asks_the_learners_that_have_not_joined_it_and_takes_their_partial_progress(
    sync_factory: SyncFactory,
) -> None:
    sync = sync_factory(args=["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "1"])
    a, b = (Learner(sync.url, name, PLAN) for name in "ab")
    for learner in (a, b):
        assert learner.register().status_code == 200
    for p in (0, 1):
        assert a.init(p, initial_params(PLAN, p)).status_code == 200
    # long steps: a grace window of half a step (50 s) that b's answer falls into; no step taken yet,
    # since a report of 100 s per step is held to the pace the heartbeats show once steps advance
    for learner in (a, b):
        assert learner.heartbeat(0, step_time_s=100.0).status_code == 200
    announce = {"newer_than": 0, "wait": 0.2, "announce_rounds": "true"}
    assert b.client.get("/v1/fragments/0", params=announce).status_code == 304  # no round open yet
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(b.client.get, "/v1/fragments/0", params={**announce, "wait": 20}, timeout=60)
        assert a.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, 1), 0, 0), steps=4).status_code == 202
        answer = asked.result()
    assert answer.status_code == 204
    assert answer.headers[ROUND_OPEN_HEADER] == "0"
    assert 0.0 < float(answer.headers[ROUND_DEADLINE_HEADER]) <= 50.0
    assert a.client.get("/v1/fragments/0", params=announce).status_code == 304  # a is in the round
    plain = b.client.get("/v1/fragments/0", params={"newer_than": 0, "wait": 0.2})
    assert plain.status_code == 304  # a long-poll that does not ask to hear of rounds is unchanged
    assert b.client.get("/v1/fragments/1", params=announce).status_code == 304  # only fragment 0's round
    partial = b.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, 2), 0, 0), steps=1)
    assert partial.status_code == 202
    got = a.fetch(0, newer_than=0, wait=30)
    assert got is not None
    assert got[0] == 1
    merged = status(sync.url)["recent_rounds"][0]  # type: ignore[index]
    assert merged["participants"] == ["a", "b"]
    assert merged["weights"][1] < merged["weights"][0]  # one step of b against four of a
    assert merged["quorum_wait_s"] == 0.0  # the round opened at its first contribution
