"""A fragment version served from its object in storage, a piece at a time (``publication.Stored``):
a version larger than ``--served-in-memory-bytes`` is not held in memory for its readers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio.to_thread
from diloco_core.storage import StorageError
from fastapi.responses import StreamingResponse

from .errors import ApiError
from .publication import Stored

PIECE = 8 * 1024 * 1024  # bytes read from storage at a time
ReadRange = Callable[[str, int, int], bytes]  # (key, start, length) -> bytes


async def stored_response(
    read_range: ReadRange, stored: Stored, fragment: int, media_type: str, headers: dict[str, str]
) -> StreamingResponse:
    """Answer with the stored version. Its first piece is read before the answer starts, so a
    version that cannot be read now (storage down, or the object collected as a newer version came)
    answers 503 ``storage_unavailable`` (``retryable``); a failure after that ends the connection
    before ``Content-Length`` bytes, which the reader sees as a broken download and asks again."""
    try:
        first = await anyio.to_thread.run_sync(read_range, stored.key, 0, min(PIECE, stored.size))
    except StorageError as exc:
        raise ApiError(
            503,
            "storage_unavailable",
            f"fragment {fragment}'s version cannot be read from storage now",
            retryable=True,
        ) from exc
    return StreamingResponse(
        _pieces(read_range, stored, first),
        media_type=media_type,
        headers={**headers, "Content-Length": str(stored.size)},
    )


async def _pieces(read_range: ReadRange, stored: Stored, first: bytes) -> AsyncIterator[bytes]:
    yield first
    sent = len(first)
    while sent < stored.size:
        piece = await anyio.to_thread.run_sync(read_range, stored.key, sent, min(PIECE, stored.size - sent))
        if not piece:
            raise StorageError(f"{stored.key} ends at {sent} bytes, {stored.size} served")
        yield piece
        sent += len(piece)
