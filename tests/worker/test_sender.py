"""A shard's sender thread against a real local HTTP server: a failure it did not foresee is logged
and the contribution retried; the thread lives on and drops nothing."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

import numpy as np
import pytest
from diloco_core.auth import learner_token
from diloco_worker.fragment_state import Outgoing
from diloco_worker.sender import Sender
from diloco_worker.sync_client import ShardClients, SyncClient

from tests.worker.scripted_server import Answer, serving

ACCEPTED = (
    202,
    "application/json",
    json.dumps({"status": "accepted", "fragment": 0, "base_version": 0, "version": 0, "pending": 1}).encode(),
)


def _sender(
    url: str, stop: threading.Event, fragments: int = 1, known_version: Callable[[int], int] = lambda p: 0
) -> tuple[Sender, SyncClient]:
    client = SyncClient(url, "a", learner_token("s", "a"))
    sender = Sender(
        ShardClients.single(client, fragments),
        "int4",
        0.0,
        stop,
        known_version=known_version,
        resync=lambda p: None,
        step=lambda: 7,
    )
    return sender, client


def _contributions_answered(first: Answer) -> tuple[list[str], Callable[[str, str], Answer]]:
    """The paths of the contributions the server was sent, and its answer: ``first`` to the first
    contribution, accepted after."""
    seen: list[str] = []

    def answer(method: str, path: str) -> Answer:
        if "/contributions" not in path:
            return 404, "text/plain", b"not here"
        seen.append(path)
        return first if len(seen) == 1 else ACCEPTED

    return seen, answer


class _EncodesOnSecondTry:
    """An outer gradient whose first encoding fails (as the copy of a device's values could)."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, *, fragment: int, base_version: int, quantizer: str) -> bytes:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("the copy to the host failed")
        return b"payload"


def _send(url: str, c: Outgoing) -> tuple[Sender, bool, bool]:
    """Send ``c`` from a sender thread: the sender, whether everything was sent, whether its thread
    still runs."""
    stop = threading.Event()
    sender, client = _sender(url, stop)
    thread = threading.Thread(target=sender.send_loop, args=(0,), daemon=True)
    thread.start()
    try:
        sender.submit(c)
        flushed = sender.flush(30)
        alive = thread.is_alive()
    finally:
        stop.set()
        sender.wake()
        thread.join(10)
        client.close()
    return sender, flushed, alive


def test_a_contribution_answered_with_a_page_instead_of_its_result_is_sent_again() -> None:
    """Something in front of the synchronizer answers ``202 <html>ok</html>``: the sender takes it for
    a failed send, sends the contribution again, and the synchronizer's answer ends it."""
    seen, answer = _contributions_answered((202, "text/html", b"<html>ok</html>"))
    with serving(answer) as url:
        c = Outgoing(0, 0, 4, 100, 1, {"w": np.zeros(2, dtype=np.float32)})
        sender, flushed, alive = _send(url, c)
    assert flushed
    assert alive
    assert len(seen) == 2
    assert (sender.sent, sender.rejected) == (1, 0)
    assert not sender.pending(0)


def test_a_send_that_fails_unexpectedly_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    seen, answer = _contributions_answered(ACCEPTED)
    delta = _EncodesOnSecondTry()
    with caplog.at_level(logging.ERROR, logger="diloco_worker.comms"), serving(answer) as url:
        sender, flushed, alive = _send(url, Outgoing(0, 0, 4, 100, 1, delta))
    assert flushed
    assert alive
    assert delta.calls == 2
    assert len(seen) == 1
    assert sender.sent == 1
    failed = [r for r in caplog.records if "send failed unexpectedly" in r.getMessage()]
    assert len(failed) == 1
    assert "fragment=0" in failed[0].getMessage()
    assert failed[0].exc_info is not None  # with its traceback


class _EncodesWhenReleased:
    """An outer gradient whose encoding waits for the test (the send stays in flight meanwhile)."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def encode(self, *, fragment: int, base_version: int, quantizer: str) -> bytes:
        self.started.set()
        self.release.wait(30)
        return b"payload"


def test_the_parts_not_durably_taken_are_those_waiting_in_flight_or_only_buffered() -> None:
    """Fragment 0's first part is answered as only buffered, its second is being sent and its third
    waits; fragment 1's part is durable. A newer version of fragment 0 supersedes its buffered part."""

    def answer(method: str, path: str) -> Answer:
        if "/fragments/1/" in path:
            return ACCEPTED
        body = {"status": "accepted", "fragment": 0, "base_version": 0, "version": 0, "pending": 1}
        return 202, "application/json", json.dumps({**body, "durable": False}).encode()

    known = {0: 0, 1: 0}
    stop = threading.Event()
    with serving(answer) as url:
        sender, client = _sender(url, stop, fragments=2, known_version=lambda p: known[p])
        slow = _EncodesWhenReleased()
        thread = threading.Thread(target=sender.send_loop, args=(0,), daemon=True)
        thread.start()
        try:
            zeros = {"w": np.zeros(2, dtype=np.float32)}
            buffered, durable = Outgoing(0, 0, 4, 100, 1, zeros), Outgoing(1, 0, 4, 100, 1, zeros)
            sender.submit(buffered)
            sender.submit(durable)
            assert sender.flush(30)
            assert sender.buffered(0) == [1]
            inflight, waiting = (
                Outgoing(0, 0, 4, 100, 2, slow, since=4),
                Outgoing(0, 0, 4, 100, 3, zeros, since=8),
            )
            sender.submit(inflight)
            sender.submit(waiting)
            assert slow.started.wait(30)
            assert sender.unacknowledged() == [buffered, inflight, waiting]
            known[0] = 1
            assert sender.unacknowledged() == [inflight, waiting]
        finally:
            slow.release.set()
            stop.set()
            sender.wake()
            thread.join(10)
            client.close()
