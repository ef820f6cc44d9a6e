from __future__ import annotations

import json
import logging
import random
import threading
import time

import numpy as np
from diloco_core import bounds
from diloco_core.auth import learner_token
from diloco_core.fragments import build_plan
from diloco_core.protocol import Heartbeat
from diloco_testbed.waiting import wait_for
from diloco_worker.comms import CommSettings, Communicator, heartbeat_failure_level
from diloco_worker.fragment_state import Outgoing
from diloco_worker.pacing import TokenBucket, backoff_delay
from diloco_worker.sync_client import SyncBadAnswer, SyncClient, SyncUnavailable

from tests.worker.scripted_server import Answer, serving


def test_backoff_grows_exponentially_with_jitter_and_a_cap() -> None:
    rng = random.Random(0)
    for attempt in range(12):
        d = backoff_delay(attempt, rng, base=0.1, cap=5.0)
        full = min(5.0, 0.1 * 2**attempt)
        assert full / 2 <= d <= full
    delays = {round(backoff_delay(3, rng), 6) for _ in range(20)}
    assert len(delays) > 10  # jittered, so learners do not retry in lock-step


def test_token_bucket_spaces_sends_by_size() -> None:
    now = [100.0]
    bucket = TokenBucket(1000.0, clock=lambda: now[0])
    assert bucket.delay_for(500) == 0.5
    assert bucket.delay_for(500) == 1.0  # queued behind the first
    now[0] += 5.0
    assert bucket.delay_for(100) == 0.1
    assert TokenBucket(0).delay_for(10**9) == 0.0


def _contribution(p: int, seq: int) -> Outgoing:
    return Outgoing(p, 0, 4 * seq, 100 * seq, seq, {"w": np.zeros(2, dtype=np.float32)})


def test_every_outer_gradient_is_queued_in_order() -> None:
    plan = build_plan([("w", (2,)), ("v", (2,))], 2, 4, 1)
    # the threads are not started: this checks the queues on their own, no network involved
    comm = Communicator(
        SyncClient("http://127.0.0.1:9", "a", "t"), plan, CommSettings(), versions={0: 0, 1: 0}
    )
    comm.submit(_contribution(0, 1))
    comm.submit(_contribution(1, 1))
    comm.submit(_contribution(0, 2))  # only the progress after the first: both must be sent
    assert sorted(comm.sender.slots) == [0, 1]
    assert [c.seq for c in comm.sender.slots[0]] == [1, 2]
    assert not comm.flush(0.05)  # nothing can be sent while nobody is listening


def test_the_heartbeat_reports_only_what_the_synchronizer_accepts() -> None:
    """A diverged model (NaN loss) or a stalled clock does not make the heartbeat unsendable: the
    loss is left out and durations are bounded, so the learner stays alive on the synchronizer."""
    plan = build_plan([("w", (2,)), ("v", (2,))], 2, 4, 1)
    comm = Communicator(SyncClient("http://127.0.0.1:9", "a", "t"), plan, CommSettings(), versions={0: 0})
    comm.progress.eval_loss = float("nan")
    comm.progress.step_time_s = float("inf")
    comm.progress.blocked_s = 1e300
    comm.progress.fragment_steps = {0: -1, 1: 3}
    hb = comm.heartbeat()
    assert hb.eval_loss is None
    assert hb.step_time_s == 0.0
    assert hb.blocked_s == bounds.MAX_SECONDS
    assert hb.fragment_steps == {0: 0, 1: 3}
    assert Heartbeat.model_validate_json(hb.model_dump_json()) == hb
    comm.progress.eval_loss = 2.5
    assert comm.heartbeat().eval_loss == 2.5


def test_a_heartbeat_refused_for_the_clock_is_a_warning_and_other_failures_are_debug() -> None:
    skew = SyncUnavailable("HTTP 401 clock_skew: the proof is dated 400 s from the synchronizer's clock")
    assert [heartbeat_failure_level(skew, n) for n in (1, 2, 19, 20, 21, 40)] == [
        logging.WARNING, logging.DEBUG, logging.DEBUG, logging.WARNING, logging.DEBUG, logging.WARNING
    ]  # fmt: skip
    down = SyncUnavailable("cannot reach http://sync:8000: connection refused")
    assert heartbeat_failure_level(down, 1) == logging.DEBUG
    page = SyncBadAnswer("POST /v1/learners/a/heartbeat: HTTP 200 (text/html) is not a HeartbeatResponse")
    assert [heartbeat_failure_level(page, n) for n in (1, 2, 20)] == [
        logging.WARNING,
        logging.DEBUG,
        logging.WARNING,
    ]


def test_the_heartbeat_thread_lives_on_after_an_answer_that_is_not_the_synchronizers() -> None:
    """The first heartbeat is answered with a page, not the synchronizer's JSON: the heartbeat thread
    retries, and its next heartbeats are answered."""
    beats: list[str] = []
    valid = json.dumps({"versions": {"0": 0}, "alive_learners": 1}).encode()

    def answer(method: str, path: str) -> Answer:
        if path.endswith("/heartbeat"):
            beats.append(path)
            return (
                (200, "text/html", b"<html>ok</html>")
                if len(beats) == 1
                else (200, "application/json", valid)
            )
        time.sleep(0.1)  # a long-poll with nothing new
        return 304, "text/plain", b""

    plan = build_plan([("w", (2,)), ("v", (2,))], 1, 4, 1)
    with serving(answer) as url:
        client = SyncClient(url, "a", learner_token("s", "a"))
        comm = Communicator(client, plan, CommSettings(heartbeat_interval_s=0.05), versions={0: 0})
        comm.start()
        try:
            wait_for(lambda: len(beats) >= 3, timeout=30, what="heartbeats after the bad answer")
            assert any(t.name == "diloco-heartbeat" and t.is_alive() for t in threading.enumerate())
        finally:
            comm.stop()
            client.close()
