"""Learner-facing metrics and unknown learners, against a real synchronizer process.

The worker's own HTTP client (``diloco_worker.sync_client``) is used where the test is about what a
learner does with an answer: its heartbeat loop registers again on 401 and 404.
"""

from __future__ import annotations

import re

import httpx
import pytest
from diloco_core.auth import learner_token
from diloco_core.protocol import Heartbeat, RegisterRequest
from diloco_worker.sync_client import SyncClient, SyncRejected

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import (
    SECRET,
    Learner,
    SyncProcess,
    encode_grad,
    encode_params,
    initial_params,
    outer_grad,
    tiny_plan,
)

pytestmark = pytest.mark.integration
ARGS = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "2", "--max-staleness", "4"]


def _sample(metrics: str, series: str) -> float | None:
    """The value of one exported series (name with its labels, as Prometheus prints it)."""
    match = re.search(rf"^{re.escape(series)} (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else None


@pytest.fixture(scope="module")
def shared_sync(module_sync_factory: SyncFactory) -> SyncProcess:
    """A synchronizer of ``ARGS`` shared by two tests: one whose requests, an unknown learner's, are
    refused before they touch any state, and one that needs it otherwise fresh."""
    return module_sync_factory(args=ARGS)


def test_heartbeat_of_an_unknown_learner_answers_404_not_registered(shared_sync: SyncProcess) -> None:
    sync = shared_sync
    ghost = Learner(sync.url, "ghost", tiny_plan())
    r = ghost.heartbeat(3)
    assert r.status_code == 404, r.text
    assert r.json() == {
        "code": "not_registered",
        "reason": "learner ghost is not registered: register again",
        "retryable": False,
        "current_version": None,
    }
    assert ghost.client.post("/v1/learners/ghost/leave").status_code == 204  # leaving is idempotent
    r = ghost.contribute(0, 0, b"\x00" * 64)
    assert (r.status_code, r.json()["code"]) == (404, "not_registered")
    doc = httpx.get(f"{sync.url}/openapi.json").json()
    assert "404" in doc["paths"]["/v1/learners/{learner_id}/heartbeat"]["post"]["responses"]


def test_worker_client_sees_404_and_registers_again_after_the_registry_is_lost(
    sync_factory: SyncFactory,
) -> None:
    plan = tiny_plan()
    first = sync_factory(args=ARGS)
    client = SyncClient(first.url, "w0", learner_token(SECRET, "w0"))
    req = RegisterRequest(
        learner_id="w0", plan=plan.to_dict(), plan_hash=plan.hash(), tokens_per_step=8, step=0
    )
    try:
        client.register(req)
        assert client.heartbeat(Heartbeat(step=1, tokens=8, step_time_s=0.1)).alive_learners == 1
        first.stop()
        # a new synchronizer on the same address with empty storage: it has never heard of w0
        second = sync_factory(args=ARGS, port=first.port)
        with pytest.raises(SyncRejected) as refused:
            client.heartbeat(Heartbeat(step=2, tokens=16, step_time_s=0.1))
        assert (refused.value.status, refused.value.code) == (404, "not_registered")
        client.register(req.model_copy(update={"step": 2}))  # what the worker's heartbeat loop does
        assert client.heartbeat(Heartbeat(step=3, tokens=24, step_time_s=0.1)).alive_learners == 1
        assert second.process.running()
    finally:
        client.close()


def test_learner_loss_tokens_and_contribution_staleness_are_exported(shared_sync: SyncProcess) -> None:
    sync = shared_sync
    plan = tiny_plan()
    a, b = Learner(sync.url, "a", plan), Learner(sync.url, "b", plan)
    for learner in (a, b):
        assert learner.register().status_code == 200
    assert a.init(0, initial_params(plan, 0)).status_code == 200

    assert a.heartbeat(10, eval_loss=3.25).status_code == 200  # tokens 80
    assert a.heartbeat(15).status_code == 200  # tokens 120, no loss: the last one stays
    assert b.heartbeat(4, eval_loss=4.0).status_code == 200  # tokens 32

    # round 1 merges two contributions based on version 0 into version 1 (staleness 0, 0)
    for i, learner in enumerate((a, b)):
        assert learner.contribute(0, 0, encode_grad(outer_grad(plan, 0, seed=i), 0, 0)).status_code == 202
    assert a.fetch(0, newer_than=0, wait=30) is not None
    # round 2 at version 1: a is current, b still sends a gradient based on version 0 (staleness 1):
    # its progress after the 4 steps merged in round 1
    assert a.contribute(0, 1, encode_grad(outer_grad(plan, 0, seed=2), 0, 1)).status_code == 202
    assert b.contribute(0, 0, encode_grad(outer_grad(plan, 0, seed=3), 0, 0), since=4).status_code == 202
    got = a.fetch(0, newer_than=1, wait=30)
    assert got is not None
    assert got[0] == 2

    metrics = httpx.get(f"{sync.url}/metrics").text
    assert _sample(metrics, 'diloco_sync_learner_tokens_total{learner="a"}') == 120.0
    assert _sample(metrics, 'diloco_sync_learner_tokens_total{learner="b"}') == 32.0
    assert _sample(metrics, 'diloco_sync_learner_loss{learner="a"}') == 3.25
    assert _sample(metrics, 'diloco_sync_learner_loss{learner="b"}') == 4.0
    assert _sample(metrics, 'diloco_sync_contribution_staleness_count{fragment="0"}') == 4.0
    assert _sample(metrics, 'diloco_sync_contribution_staleness_sum{fragment="0"}') == 1.0
    assert _sample(metrics, 'diloco_sync_contribution_staleness_bucket{fragment="0",le="0.0"}') == 3.0

    assert a.client.post("/v1/learners/a/leave").status_code == 204
    after = httpx.get(f"{sync.url}/metrics").text
    assert _sample(after, 'diloco_sync_learner_loss{learner="a"}') is None  # a left: no stale loss
    assert _sample(after, 'diloco_sync_learner_loss{learner="b"}') == 4.0


def test_bytes_at_the_socket_are_counted_on_both_sides(sync_factory: SyncFactory) -> None:
    """The learner's client counts its connections' bytes from the kernel; the synchronizer counts
    every connection's the same way and exports both: what one side sent, the other received."""
    plan = tiny_plan()
    sync = sync_factory(args=ARGS)
    client = SyncClient(sync.url, "w0", learner_token(SECRET, "w0"))
    req = RegisterRequest(
        learner_id="w0", plan=plan.to_dict(), plan_hash=plan.hash(), tokens_per_step=8, step=0
    )
    client.register(req)
    client.init_fragment(0, encode_params(initial_params(plan, 0), 0))
    sent, received = client.wire.totals()
    assert sent > 1000  # the initial parameters, and the heads
    client.heartbeat(Heartbeat(step=1, tokens=8, step_time_s=0.1, wire_sent=sent, wire_received=received))
    sent, received = client.wire.totals()
    client.close()  # every connection of the learner closed: the server's counts are final for them
    metrics = httpx.get(f"{sync.url}/metrics").text
    assert _sample(metrics, 'diloco_sync_learner_wire_bytes{direction="sent",learner="w0"}') is not None
    server_received = _sample(metrics, 'diloco_sync_wire_bytes{direction="received"}')
    server_sent = _sample(metrics, 'diloco_sync_wire_bytes{direction="sent"}')
    assert server_received is not None
    assert server_sent is not None
    assert server_received >= sent  # and the scrape's own request head (and the start-up probes)
    assert server_sent >= received
