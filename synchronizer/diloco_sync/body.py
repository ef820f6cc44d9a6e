"""Reading a request body in chunks, refusing it as soon as it passes the size limit."""

from __future__ import annotations

from fastapi import Request

from .errors import ApiError


async def read_limited_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 ``oversized`` once more than ``limit`` bytes arrive (or are announced)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "bad_request", f"invalid Content-Length {declared!r}") from None
        if size > limit:
            raise ApiError(413, "oversized", f"body of {size} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise ApiError(413, "oversized", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    if received == 0:
        raise ApiError(400, "bad_request", "empty body: a codec payload is expected")
    return b"".join(chunks)
