"""A heartbeat carried by a contribution or a long-poll (``X-DiLoCo-Heartbeat``), against a real
synchronizer process and the worker's own client: recorded as a heartbeat request is, marked in the
answer, refused when malformed, and never marked for a learner the synchronizer does not know."""

from __future__ import annotations

import httpx
import pytest
from diloco_core.auth import learner_token
from diloco_core.protocol import HEARTBEAT_HEADER, HEARTBEAT_RECORDED_HEADER, Heartbeat, RegisterRequest
from diloco_core.request_proof import ProofAuth
from diloco_worker.carried_beats import CarriedBeats
from diloco_worker.sync_client import SyncClient

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import (
    SECRET,
    encode_grad,
    encode_params,
    initial_params,
    outer_grad,
    tiny_plan,
)

pytestmark = pytest.mark.integration
ARGS = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "2"]


def _status_of(client: SyncClient, learner_id: str) -> tuple[int, int]:
    (learner,) = [x for x in client.status().learners if x.learner_id == learner_id]
    return learner.step, learner.tokens


def test_contributions_and_long_polls_carry_the_heartbeat(sync_factory: SyncFactory) -> None:
    plan = tiny_plan()
    sync = sync_factory(args=ARGS)
    client = SyncClient(sync.url, "w0", learner_token(SECRET, "w0"))
    client.register(
        RegisterRequest(
            learner_id="w0", plan=plan.to_dict(), plan_hash=plan.hash(), tokens_per_step=8, step=0
        )
    )
    for p in (0, 1):
        client.init_fragment(p, encode_params(initial_params(plan, p), p))
    now = [1000.0]  # the client's clock, moved by the test
    client.beats = CarriedBeats(clock=lambda: now[0])
    reported = [Heartbeat(step=3, tokens=24, step_time_s=0.1)]
    client.beats.carry(lambda: reported[-1], every_s=60.0)

    client.contribute(0, encode_grad(outer_grad(plan, 0, 1), 0, 0), base_version=0, steps=4, tokens=24, seq=1)
    assert client.beats.due_in(60.0) > 50  # its heartbeat was recorded: none owed for an interval
    assert _status_of(client, "w0") == (3, 24)

    now[0] += 31  # half an interval later: the next contribution carries one
    reported.append(Heartbeat(step=4, tokens=32, step_time_s=0.1))
    client.contribute(1, encode_grad(outer_grad(plan, 1, 2), 1, 0), base_version=0, steps=4, tokens=24, seq=1)
    assert _status_of(client, "w0") == (4, 32)

    long_poll = httpx.get(
        f"{sync.url}/v1/fragments/0",
        params={"newer_than": 0, "wait": 0.5},
        auth=ProofAuth(learner_token(SECRET, "w0")),
        headers={
            "X-DiLoCo-Learner": "w0",
            HEARTBEAT_HEADER: Heartbeat(step=6, tokens=48, step_time_s=0.1).model_dump_json(),
        },
    )
    assert long_poll.status_code == 304
    assert long_poll.headers[HEARTBEAT_RECORDED_HEADER] == "1"  # a long-poll may carry one too
    assert _status_of(client, "w0") == (6, 48)

    reported.append(Heartbeat(step=5, tokens=40, step_time_s=0.1))  # one was carried 0 s ago: none now
    client.contribute(
        0, encode_grad(outer_grad(plan, 0, 3), 0, 0), base_version=0, steps=4, tokens=24, seq=2, since=4
    )
    assert _status_of(client, "w0") == (6, 48)
    client.close()


def test_a_malformed_carried_heartbeat_is_refused_and_an_unknown_learner_gets_no_mark(
    sync_factory: SyncFactory,
) -> None:
    plan = tiny_plan()
    sync = sync_factory(args=ARGS)
    w0 = SyncClient(sync.url, "w0", learner_token(SECRET, "w0"))
    w0.register(
        RegisterRequest(
            learner_id="w0", plan=plan.to_dict(), plan_hash=plan.hash(), tokens_per_step=8, step=0
        )
    )
    w0.init_fragment(0, encode_params(initial_params(plan, 0), 0))
    w0.close()
    for learner, header, expected in (
        ("w0", '{"step": -1, "tokens": 0, "step_time_s": 0}', 400),  # out of bounds
        ("w0", "not json", 400),
        ("w0", "x" * 9000, 400),  # longer than any heartbeat
    ):
        r = httpx.get(
            f"{sync.url}/v1/fragments/0",
            auth=ProofAuth(learner_token(SECRET, learner)),
            headers={"X-DiLoCo-Learner": learner, HEARTBEAT_HEADER: header},
        )
        assert (r.status_code, r.json()["code"]) == (expected, "bad_request"), r.text
        assert HEARTBEAT_HEADER in r.json()["reason"]
    ghost = httpx.get(
        f"{sync.url}/v1/fragments/0",
        auth=ProofAuth(learner_token(SECRET, "ghost")),
        headers={
            "X-DiLoCo-Learner": "ghost",
            HEARTBEAT_HEADER: Heartbeat(step=1, tokens=8, step_time_s=0.1).model_dump_json(),
        },
    )
    assert HEARTBEAT_RECORDED_HEADER not in ghost.headers  # its own heartbeat request hears 404 and registers
    assert "server" not in ghost.headers  # an answer's head names no software (and costs no bytes for it)
