"""Request body size limits: the binary routes take their body in chunks, written as they arrive
(``receive_body``); every other route is guarded by ``JsonBodyLimit``, a thin ASGI middleware, before FastAPI reads it."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.to_thread
from diloco_core.protocol import ErrorBody
from diloco_core.uploads import LOCAL_SPOOL, FileUpload, MemoryUpload, Upload
from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, body_not_written

WRITE_BYTES = 1 << 20  # body bytes gathered before each write of its upload


def scratch_upload() -> Upload:
    """A body that is read and let go (not stored): a file in the local spool, or memory where
    none can be made."""
    try:
        return FileUpload(LOCAL_SPOOL, lambda upload: None)
    except OSError:
        return MemoryUpload(lambda data: None)


async def discard(upload: Upload) -> None:
    """Throw ``upload`` away in a worker thread, even while its request is being cancelled."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(upload.discard)


def declared_length(request: Request, limit: int) -> int | None:
    """The body's ``Content-Length`` (None when not given): 400 when it is not a number, 413
    ``oversized`` when it is more than ``limit``."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    try:
        size = int(declared)
    except ValueError:
        raise ApiError(400, "bad_request", f"invalid Content-Length {declared!r}") from None
    if size > limit:
        raise ApiError(413, "oversized", f"body of {size} bytes exceeds the limit of {limit} bytes")
    return size


async def receive_body(
    request: Request, limit: int, upload: Upload, on_write_error: Callable[[OSError], None] | None = None
) -> int:
    """Write the body into ``upload`` as it arrives, ``WRITE_BYTES`` at a time in a worker thread (a
    disk never holds the event loop); its size. 413 ``oversized`` once more than ``limit`` bytes
    arrive (or are announced), 400 for an empty body or one cut short, 503 ``storage_unavailable``
    (retryable) when the upload cannot be written (``on_write_error`` is told why)."""
    declared_length(request, limit)
    received = 0
    pending = bytearray()
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise ApiError(413, "oversized", f"body exceeds the limit of {limit} bytes")
            pending += chunk
            if len(pending) >= WRITE_BYTES:
                full, pending = pending, bytearray()
                await anyio.to_thread.run_sync(upload.write, full)
        if pending:
            await anyio.to_thread.run_sync(upload.write, pending)
    except ClientDisconnect:  # the client left (or stalled past the body timeout): nobody to answer
        raise ApiError(
            400, "bad_request", f"the connection closed after {received} bytes of the body"
        ) from None
    except OSError as exc:
        if on_write_error is not None:
            on_write_error(exc)
        raise body_not_written(exc) from None
    if received == 0:
        raise ApiError(400, "bad_request", "empty body: a codec payload is expected")
    return received


class JsonBodyLimit:
    """413 ``oversized`` (an ``ErrorBody``) for a body over ``limit`` bytes on every route ``exempt``
    does not name, and for any body at all on a route ``takes_body`` does not name (the routes that
    answer everyone take none: a body sent to one is refused unread, so no caller holds a connection
    and memory there by sending it slowly).

    A declared ``Content-Length`` is judged before anything is read (the server holds the body to
    it); a body without one (chunked) is read up to the limit before the route sees any of it.
    """

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        exempt: Callable[[str], bool],
        takes_body: Callable[[str], bool] = lambda path: True,
    ) -> None:
        self.app = app
        self.limit = limit
        self.exempt = exempt
        self.takes_body = takes_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.exempt(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if not self.takes_body(scope["path"]) and (
            b"transfer-encoding" in headers or (declared is not None and declared.strip() != b"0")
        ):
            await _refuse(send, 413, "oversized", f"{scope['path']} takes no request body")
            return
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _refuse(
                    send, 400, "bad_request", f"invalid Content-Length {declared.decode(errors='replace')!r}"
                )
                return
            if size > self.limit:
                await _refuse(
                    send, 413, "oversized", f"body of {size} bytes exceeds the limit of {self.limit} bytes"
                )
                return
            await self.app(scope, receive, send)
            return
        received = await _read_up_to(receive, self.limit)
        if received is None:
            await _refuse(send, 413, "oversized", f"body exceeds the limit of {self.limit} bytes")
            return
        await self.app(scope, _replay(received, receive), send)


async def _read_up_to(receive: Receive, limit: int) -> list[Message] | None:
    """The messages of the whole body (ending early if the client leaves), or None as soon as more
    than ``limit`` bytes arrived."""
    messages: list[Message] = []
    received = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        received += len(message.get("body", b""))
        if received > limit:
            return None
        if not message.get("more_body", False):
            return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that answers the messages already read, then the live ones."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


async def _refuse(send: Send, status: int, code: str, reason: str) -> None:
    content = ErrorBody(code=code, reason=reason).model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})
