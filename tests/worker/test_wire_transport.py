"""The learner's client counts the bytes at the socket: exactly what a server read and wrote,
heads included, over kept-alive and new connections."""

from __future__ import annotations

import socket
import threading

import httpx
from diloco_core.wire import WireTally
from diloco_worker.wire_transport import counting_transport

BODY = b"z" * 777


def _serve(server: socket.socket, seen: dict[str, int], requests: int) -> None:
    """Answer ``requests`` requests, one connection each (the answer says close), counting bytes."""
    for _ in range(requests):
        conn, _ = server.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            while len(rest) < length:
                rest += conn.recv(65536)
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY) + BODY
            conn.sendall(answer)
            seen["read"] += len(head) + 4 + len(rest)
            seen["written"] += len(answer)


def test_the_bytes_counted_are_the_bytes_the_server_read_and_wrote() -> None:
    seen = {"read": 0, "written": 0}
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        thread = threading.Thread(target=_serve, args=(server, seen, 3), daemon=True)
        thread.start()
        tally = WireTally()
        with httpx.Client(transport=counting_transport(tally), base_url=f"http://127.0.0.1:{port}") as client:
            assert client.get("/v1/fragments/0").content == BODY
            assert client.post("/v1/fragments/0/contributions", content=b"p" * 5000).status_code == 200
            assert client.post("/v1/learners/a/heartbeat", json={"step": 1}).status_code == 200
        thread.join(timeout=10)
    assert seen["read"] > 5000
    assert tally.totals() == (seen["read"], seen["written"])
