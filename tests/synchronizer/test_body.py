"""The body limits in front of the routes, as an ASGI middleware driven directly (its decisions,
without a server): what is refused unread, and what reaches the route."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from diloco_sync.api import is_binary_route, is_learner_route
from diloco_sync.body import JsonBodyLimit
from starlette.types import Message, Receive, Scope, Send

LIMIT = 1024


def drive(
    path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> tuple[int, dict[str, Any], int]:
    """POST ``path`` with ``headers`` and a body in ``chunks`` through the limit: the answer's status,
    its JSON body, and how many of the body's messages were read (by the limit or the route)."""
    reads = 0
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal reads
        reads += 1
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        content = json.dumps({"read": len(body)}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": content})

    app = JsonBodyLimit(route, limit=LIMIT, exempt=is_binary_route, takes_body=is_learner_route)
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"]), reads


CHUNKED = [(b"transfer-encoding", b"chunked")]


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/", "/v1/status", "/anything"])
@pytest.mark.parametrize("headers", [CHUNKED, [(b"content-length", b"10")]])
def test_a_route_that_answers_everyone_refuses_a_body_unread(
    path: str, headers: list[tuple[bytes, bytes]]
) -> None:
    """An unauthenticated caller cannot hold a connection there by sending a body slowly: the
    refusal comes before any of it is read."""
    status, body, reads = drive(path, headers, [b"x" * 10])
    assert (status, body["code"], reads) == (413, "oversized", 0)
    assert f"{path} takes no request body" in body["reason"]


@pytest.mark.parametrize("headers", [[], [(b"content-length", b"0")]])
def test_a_route_that_answers_everyone_is_served_without_a_body(headers: list[tuple[bytes, bytes]]) -> None:
    assert drive("/healthz", headers, [b""])[:2] == (200, {"read": 0})


def test_a_learner_route_reads_a_chunked_body_up_to_the_limit() -> None:
    assert drive("/v1/learners/a/heartbeat", CHUNKED, [b"x" * 600, b"y" * 400])[:2] == (200, {"read": 1000})
    status, body, _ = drive("/v1/learners/a/heartbeat", CHUNKED, [b"x" * 600, b"y" * 600])
    assert (status, body["code"]) == (413, "oversized")
