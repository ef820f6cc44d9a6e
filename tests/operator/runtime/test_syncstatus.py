"""Reading GET /v1/status over a real socket: a small HTTP server stands in for the synchronizer.

The synchronizer's own tests cover its status endpoint; here the operator's client must parse a
valid StatusResponse and turn anything else (refused connection, bad JSON, an error) into None.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from diloco_core.protocol import FragmentStatus, StatusResponse
from diloco_operator.runtime.syncstatus import http_fetcher

STATUS = StatusResponse(
    job_id="j",
    shard=0,
    num_shards=1,
    learners=[],
    fragments=[FragmentStatus(fragment=0, version=3, pending=0, rounds=3)],
    rounds=3,
    recent_rounds=[],
    bytes_in=10,
    bytes_out=20,
    tokens=4096,
)


class Handler(BaseHTTPRequestHandler):
    bodies: dict[str, tuple[int, bytes]] = {
        "/ok/v1/status": (200, STATUS.model_dump_json().encode()),
        "/garbage/v1/status": (200, b'{"job_id": 1}'),
        "/broken/v1/status": (503, b"{}"),
    }

    def do_GET(self) -> None:
        code, body = self.bodies.get(self.path, (404, b""))
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.integration
def test_fetch_parses_status(server: str) -> None:
    fetch = http_fetcher(timeout=2.0)
    assert fetch(f"{server}/ok") == STATUS
    assert fetch(f"{server}/ok/") == STATUS


@pytest.mark.integration
@pytest.mark.parametrize("path", ["/garbage", "/broken", "/missing"])
def test_bad_answers_are_none(server: str, path: str) -> None:
    assert http_fetcher(timeout=2.0)(f"{server}{path}") is None


def test_unreachable_is_none() -> None:
    assert http_fetcher(timeout=1.0)("http://127.0.0.1:9") is None
