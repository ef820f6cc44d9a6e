"""A 202 says whether the contribution is durable or only buffered in memory, and a learner resends
a buffered one until it is durable: kill -9 of the synchronizer during a real S3 outage (SeaweedFS)
loses nothing the learner does not send again."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from diloco_core.auth import learner_token
from diloco_testbed.s3_server import S3Server
from diloco_testbed.waiting import wait_for
from diloco_worker.comms import CommSettings, Communicator
from diloco_worker.fragment_state import Outgoing
from diloco_worker.sync_client import SyncClient

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import (
    SECRET,
    Learner,
    SyncProcess,
    encode_grad,
    initial_params,
    outer_grad,
    status,
    tiny_plan,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PLAN = tiny_plan()
ARGS = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "2"]  # nothing merges alone


def started(sync_factory: SyncFactory, s3: S3Server) -> tuple[SyncProcess, Learner]:
    sync = sync_factory(f"s3://{s3.new_bucket()}/jobs/buffered", ARGS, s3.env())
    a = Learner(sync.url, "a", PLAN)
    assert a.register().status_code == 200
    for p in (0, 1):
        assert a.init(p, initial_params(PLAN, p)).status_code == 200
    return sync, a


def restart_through_the_outage(sync: SyncProcess, s3: S3Server) -> None:
    """kill -9 while storage is down; the new process waits for storage, which then comes back."""
    sync.kill9()
    sync.start(wait_loaded=False)
    s3.start()
    wait_for(sync._loaded, timeout=60, what="the restarted synchronizer to load its state")


def test_the_answer_says_durable_or_buffered_and_a_resend_after_a_restart_is_taken_anew(
    sync_factory: SyncFactory, s3_server_factory: Callable[[], S3Server]
) -> None:
    s3 = s3_server_factory()
    sync, a = started(sync_factory, s3)
    blob = encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0)
    stored = a.contribute(0, 0, blob, seq=1)
    assert stored.status_code == 202
    assert (stored.json()["status"], stored.json()["durable"]) == ("accepted", True)
    assert a.contribute(0, 0, blob, seq=1).json()["durable"] is True  # duplicate of a stored one

    s3.stop()
    grad = encode_grad(outer_grad(PLAN, 1, seed=2), 1, 0)
    buffered = a.contribute(1, 0, grad, seq=1)
    assert buffered.status_code == 202, buffered.text
    assert (buffered.json()["status"], buffered.json()["durable"]) == ("accepted", False)
    again = a.contribute(1, 0, grad, seq=1)
    assert (again.json()["status"], again.json()["durable"]) == ("duplicate", False)

    restart_through_the_outage(sync, s3)
    assert status(sync.url)["fragments"][1]["pending"] == 0  # type: ignore[index]  # the buffered one was lost
    assert status(sync.url)["fragments"][0]["pending"] == 1  # type: ignore[index]  # the stored one was not
    resent = a.contribute(1, 0, grad, seq=1)
    assert (resent.json()["status"], resent.json()["durable"]) == ("accepted", True)
    assert status(sync.url)["fragments"][1]["pending"] == 1  # type: ignore[index]


def test_the_learner_resends_a_buffered_contribution_until_it_is_durable(
    sync_factory: SyncFactory, s3_server_factory: Callable[[], S3Server]
) -> None:
    s3 = s3_server_factory()
    sync, _ = started(sync_factory, s3)
    client = SyncClient(sync.url, "a", learner_token(SECRET, "a"))
    comm = Communicator(client, PLAN, CommSettings(codec="fp32", poll_wait_s=1.0), versions={0: 0, 1: 0})
    comm.start()
    try:
        s3.stop()
        tensors = outer_grad(PLAN, 0, seed=3)
        comm.submit(Outgoing(0, 0, 4, 32, 1, {n: np.asarray(v) for n, v in tensors.items()}))
        wait_for(lambda: comm.buffered(0) == [1], timeout=30, what="the answer: buffered")
        restart_through_the_outage(sync, s3)
        # a resend that is due leaves the buffered list for the queue, where it waits while the
        # restarted synchronizer answers 503: only an empty queue too means it was answered durable
        wait_for(
            lambda: comm.buffered(0) == [] and not comm.pending(0),
            timeout=60,
            what="the resend answered durable",
        )
        assert status(sync.url)["fragments"][0]["pending"] == 1  # type: ignore[index]
        assert comm.rejected == 0
    finally:
        comm.stop()
        client.close()


def test_a_later_part_waits_for_the_buffered_ones_a_restart_lost_and_every_step_is_merged(
    sync_factory: SyncFactory, s3_server_factory: Callable[[], S3Server]
) -> None:
    """Parts 1 and 2 (steps 1-8) only buffered, kill -9, then part 3 (steps 9-12) reaches the restarted
    synchronizer first: it is refused ``out_of_order`` (not merged over the gap), the learner sends
    the buffered parts, then part 3, and all 12 steps are merged, none reported merged that was not."""
    s3 = s3_server_factory()
    sync, _ = started(sync_factory, s3)
    b = Learner(sync.url, "b", PLAN)
    assert b.register().status_code == 200
    client = SyncClient(sync.url, "a", learner_token(SECRET, "a"))
    comm = Communicator(client, PLAN, CommSettings(codec="fp32", poll_wait_s=1.0), versions={0: 0, 1: 0})
    comm.start()

    def part(seq: int) -> Outgoing:
        tensors = outer_grad(PLAN, 0, seed=seq)
        return Outgoing(0, 0, 4, 32, seq, {n: np.asarray(v) for n, v in tensors.items()}, since=4 * (seq - 1))

    def steps_of_a_merged() -> int:
        rounds = status(sync.url)["recent_rounds"]
        weights = [
            w for r in rounds for who, w in zip(r["participants"], r["weights"], strict=True) if who == "a"
        ]  # type: ignore[index]
        return round(sum(weights) / 64)  # tokens² / steps with 8 tokens per step: 64 per step

    try:
        s3.stop()
        comm.submit(part(1))
        comm.submit(part(2))
        wait_for(lambda: comm.buffered(0) == [1, 2], timeout=30, what="the answers: buffered")
        restart_through_the_outage(sync, s3)
        assert b.heartbeat(4).status_code == 200
        assert b.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, seed=9), 0, 0), seq=1).status_code == 202
        comm.submit(part(3))
        wait_for(
            lambda: comm.buffered(0) == [] and not comm.pending(0), timeout=60, what="every part durable"
        )
        assert comm.rejected == 0  # none refused for good: no resynchronisation, no progress thrown away
        if status(sync.url)["fragments"][0]["pending"]:  # type: ignore[index]  # the rest waits for b
            version = status(sync.url)["fragments"][0]["version"]  # type: ignore[index]
            blob = encode_grad(outer_grad(PLAN, 0, seed=10), 0, version)
            assert b.contribute(0, version, blob, seq=2).status_code == 202
        wait_for(lambda: steps_of_a_merged() == 12, timeout=30, what="all 12 of a's steps merged")
    finally:
        comm.stop()
        client.close()
