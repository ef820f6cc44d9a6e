"""A zstd frame that stores its content as it is: for data that does not compress, such as the outer
optimizer's float32 state, which zstd at level -1 leaves a few bytes in a million larger
(docs/benchmarks.md) after scanning all of it for matches.

The frame is an ordinary zstd frame (RFC 8878), so every zstd decoder reads it, the codec's
included: its header declares the content size and a 128 KiB window, the content follows in raw
blocks of at most 128 KiB, and the frame ends with the content checksum (the low 32 bits of its
XXH64), checked by the decoder as for any other frame. Writing it costs a copy and the checksum.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Literal, Protocol

import xxhash
import zstandard

STORED: Literal["stored"] = "stored"
ENTROPY: Literal["entropy"] = "entropy"
Level = int | Literal["stored", "entropy"]
"""A zstd compression level; ``STORED``: the content as it is, in a frame every decoder reads;
``ENTROPY``: zstd's fast strategy with the smallest match tables (64 entries, matches of 7 bytes or
more, a 128 KiB window), for bytes that compress by their frequencies and hardly by repeats: the
high byte planes of float32 (``byte_planes``), which it brings nearer their order-0 entropy than
level 1 does, in about half the time (docs/benchmarks.md)."""
BLOCK_END = zstandard.COMPRESSOBJ_FLUSH_BLOCK
"""The flush mode that ends a block where the content given so far ends, and not the frame."""

_MAGIC = 0xFD2FB528
_DESCRIPTOR = 0b1100_0100  # an 8-byte content size, no single segment, a checksum, no dictionary
_WINDOW = 0b0011_1000  # a window of 2**(10 + 7) bytes: 128 KiB, the largest block
_BLOCK = 1 << 17
_HEAD = struct.Struct("<IBBQ")
_BLOCK_HEAD = struct.Struct("<I")  # three bytes of it: last-block bit, type 0 (raw), size << 3
_CHECKSUM = struct.Struct("<I")

Bytes = bytes | bytearray | memoryview


class Stream(Protocol):
    """What ``zstandard``'s ``compressobj`` is to a frame's writer: pieces in, frame bytes out."""

    def compress(self, data: Bytes) -> bytes: ...

    def flush(self, flush_mode: int = zstandard.COMPRESSOBJ_FLUSH_FINISH) -> bytes: ...


class StoredFrame:
    """The frame of ``size`` bytes of content given piece by piece to :meth:`compress` (each call
    returns the frame's bytes for its piece, the frame's header before the first); :meth:`flush`
    returns the checksum, and nothing with ``BLOCK_END`` (each piece's blocks are whole).
    ``ValueError`` when the pieces do not add up to ``size``, for a piece or a flush after the
    flush, and for a piece or a flush before the blocks of the last :meth:`pieces` are all read."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"a frame's content size cannot be negative ({size})")
        self._left = size
        self._hash = xxhash.xxh64()
        self._head: bytes | None = _HEAD.pack(_MAGIC, _DESCRIPTOR, _WINDOW, size)
        self._ended = False  # the last block written
        self._flushed = False
        self._reading = False  # the blocks of a call to pieces are not all read yet

    def compress(self, data: Bytes) -> bytes:
        return b"".join(self.pieces(data))

    def pieces(self, data: Bytes) -> Iterator[Bytes]:
        """:meth:`compress`'s bytes as they are made, without joining them: the frame's header before
        the first, then each block's three-byte head and the block itself, a view of ``data`` (which
        must not change until it is read). Checked before the first piece; the pieces must all be read
        before the frame takes another piece or its flush (the blocks are counted as they are read)."""
        self._check_open()
        view = memoryview(data).cast("B")
        if len(view) > self._left:
            raise ValueError(f"{len(view)} bytes given where {self._left} were left of the frame's content")
        self._reading = True
        return self._blocks(view)

    def _blocks(self, view: memoryview) -> Iterator[Bytes]:
        head = self._take_head()
        if head:
            yield head
        for start in range(0, len(view), _BLOCK):
            block = view[start : start + _BLOCK]
            self._left -= len(block)
            self._ended = self._left == 0
            self._hash.update(block)
            yield _BLOCK_HEAD.pack(len(block) << 3 | self._ended)[:3]
            yield block
        self._reading = False

    def flush(self, flush_mode: int = zstandard.COMPRESSOBJ_FLUSH_FINISH) -> bytes:
        self._check_open()
        if flush_mode == BLOCK_END:
            return b""  # every piece is already written in whole blocks
        if self._left:
            raise ValueError(f"the frame's content is {self._left} bytes short of its declared size")
        empty = b"" if self._ended else _BLOCK_HEAD.pack(1)[:3]  # a last, empty raw block
        self._ended = self._flushed = True
        return self._take_head() + empty + _CHECKSUM.pack(self._hash.intdigest() & 0xFFFF_FFFF)

    def _check_open(self) -> None:
        if self._flushed:
            raise ValueError("the frame is flushed: it takes nothing more")
        if self._reading:
            raise ValueError("the pieces of the frame's last content are not all read")

    def _take_head(self) -> bytes:
        head, self._head = self._head or b"", None
        return head


def compressor(level: Level, size: int) -> Stream:
    """The writer of one frame of ``size`` bytes of content, with the content size and checksum
    declared: zstd at ``level`` (or with ``ENTROPY``'s parameters), or the content as it is (``STORED``)."""
    if level == STORED:
        return StoredFrame(size)
    if level == ENTROPY:
        params = zstandard.ZstdCompressionParameters(
            window_log=17,
            hash_log=6,
            chain_log=6,
            search_log=1,
            min_match=7,
            target_length=0,
            strategy=zstandard.STRATEGY_FAST,
            write_checksum=1,
            write_content_size=1,
        )
        return zstandard.ZstdCompressor(compression_params=params).compressobj(size=size)
    if isinstance(level, str):
        raise ValueError(f"not a compression level: {level!r} (an integer, {STORED!r} or {ENTROPY!r})")
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cctx.compressobj(size=size)
