"""The per-shard clients: which client a fragment's calls go through; what a request's head carries;
what an answer that is not the synchronizer's becomes."""

from __future__ import annotations

import socket
import threading

import pytest
from diloco_core.auth import learner_token
from diloco_core.protocol import Heartbeat, ShardInfo
from diloco_worker.carried_beats import CarriedBeats
from diloco_worker.routing import build_routes
from diloco_worker.sync_client import ShardClients, SyncBadAnswer, SyncClient, SyncRejected, SyncUnavailable

from tests.worker.scripted_server import Answer, serving


def test_each_fragment_uses_its_owners_client_and_the_given_one_serves_the_home_shard() -> None:
    home = SyncClient("http://sync-svc:8470", "a", "t")
    shards = [ShardInfo(index=i, url=f"http://sync-{i}:8470", fragments=[i, i + 2]) for i in range(2)]
    clients = ShardClients.connect(build_routes(home.base_url, shards, [1, 3], 4), home)
    try:
        assert clients.home() is home
        assert clients.shard(1) is home
        assert [clients.owner(p).base_url for p in range(4)] == [
            "http://sync-0:8470", "http://sync-svc:8470", "http://sync-0:8470", "http://sync-svc:8470",
        ]  # fmt: skip
        assert clients.shard(0).learner_id == "a"
    finally:
        clients.close()


def test_one_synchronizer_serves_every_fragment() -> None:
    client = SyncClient("http://sync:8470", "a", "t")
    single = ShardClients.single(client, 3)
    assert single.indices == [0]
    assert all(single.owner(p) is client for p in range(3))
    client.close()


def test_a_request_head_carries_only_what_the_synchronizer_reads() -> None:
    """Every request's head is on the learner's link (a long-poll every few seconds per fragment):
    none of the HTTP client's default headers that say nothing to the synchronizer."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    heads: list[bytes] = []

    def answer_once() -> None:
        conn, _ = server.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        heads.append(data)
        conn.sendall(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 0\r\n\r\n")
        conn.close()

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    client = SyncClient(f"http://127.0.0.1:{server.getsockname()[1]}", "w0", learner_token("s", "w0"))
    assert client.fetch(0, newer_than=3, wait_s=1.0) is None
    thread.join(5)
    client.close()
    server.close()
    lines = heads[0].decode().split("\r\n")
    names = {line.split(":", 1)[0].lower() for line in lines[1:] if line}
    assert names == {"host", "user-agent", "x-diloco-learner", "authorization"}
    assert "User-Agent: diloco" in lines


def test_a_token_that_cannot_sign_is_refused_before_anything_is_sent() -> None:
    client = SyncClient("http://127.0.0.1:9", "a", "not-a-token")
    with pytest.raises(SyncRejected) as info:
        client.leave()
    client.close()
    assert (info.value.status, info.value.code) == (401, "unauthenticated")
    assert "cannot sign" in info.value.reason


@pytest.mark.parametrize(
    "body",
    [b"<html>ok</html>", b'{"status": "accepted"}', b"[1, 2"],
    ids=["a page", "other JSON", "cut short"],
)
def test_a_success_answer_that_is_not_the_expected_json_is_retried(body: bytes) -> None:
    """A proxy's page, or a body of another shape, answering a request with success: an error the
    callers retry (``SyncUnavailable``), that says what answered."""

    def answer(method: str, path: str) -> Answer:
        return 202, "text/html", body

    with serving(answer) as url:
        client = SyncClient(url, "a", learner_token("s", "a"))
        client.beats = CarriedBeats(clock=lambda: 100.0)
        try:
            with pytest.raises(SyncBadAnswer) as contributed:
                client.contribute(0, b"payload", base_version=0, steps=4, tokens=100, seq=1)
            with pytest.raises(SyncUnavailable):
                client.heartbeat(Heartbeat(step=1, tokens=1, step_time_s=0.1))
            assert client.beats.due_in(60.0) == 30.0  # not heard: owed again half an interval after it
        finally:
            client.close()
    message = str(contributed.value)
    assert "HTTP 202 (text/html)" in message
    assert "ContributionResult" in message
    assert "/v1/fragments/0/contributions" in message
