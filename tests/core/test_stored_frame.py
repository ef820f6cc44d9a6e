"""The stored zstd frame: an ordinary frame every zstd decoder reads, with its size and checksum."""

from __future__ import annotations

import io
from itertools import pairwise

import numpy as np
import pytest
import zstandard
from diloco_core import codec, stored_frame
from diloco_core.codec import CorruptPayload
from diloco_core.fragments import build_plan
from diloco_core.stored_frame import STORED, StoredFrame
from diloco_core.uploads import MemoryUpload
from hypothesis import given, settings
from hypothesis import strategies as st

BLOCK = 1 << 17


def framed(content: bytes, cuts: list[int]) -> bytes:
    """The stored frame of ``content`` given in the pieces that ``cuts`` (sorted offsets) make."""
    writer = StoredFrame(len(content))
    out = [writer.compress(content[a:b]) for a, b in pairwise([0, *cuts, len(content)])]
    return b"".join([*out, writer.flush()])


def content_of(size: int) -> bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 5 * BLOCK + 17])
def test_zstd_s_decoders_read_the_frame_whole_and_streamed(size: int) -> None:
    """One shot, as a stream and fed a few bytes at a time, each with no more than the frame's
    128 KiB window (a size-0 frame is read whole without looking past its header: the streaming
    readers check its last block and checksum)."""
    content = content_of(size)
    frame = framed(content, [size // 3, size // 3, size // 2] if size else [])
    params = zstandard.get_frame_parameters(frame)
    assert (params.content_size, params.has_checksum, params.window_size) == (size, True, BLOCK)
    dctx = zstandard.ZstdDecompressor(max_window_size=BLOCK)
    assert dctx.decompress(frame, allow_extra_data=False) == content
    with dctx.stream_reader(io.BytesIO(frame)) as reader:
        assert reader.read() == content
    fed = dctx.decompressobj()
    assert b"".join(fed.decompress(frame[at : at + 7001]) for at in range(0, len(frame), 7001)) == content
    assert fed.eof
    # given whole: 18 bytes of header and checksum, and 3 per block of at most 128 KiB (one if empty)
    assert len(framed(content, [])) == size + 18 + 3 * max(1, -(-size // BLOCK))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 4 * BLOCK), st.lists(st.floats(0, 1), max_size=6))
def test_any_split_into_pieces_makes_a_frame_of_the_same_content(size: int, fractions: list[float]) -> None:
    content = content_of(size)
    cuts = sorted(int(f * size) for f in fractions)
    assert zstandard.ZstdDecompressor().decompress(framed(content, cuts)) == content


def test_the_frame_of_nothing_byte_for_byte() -> None:
    """Magic, descriptor (8-byte size, checksum), 128 KiB window, size 0, an empty last raw block,
    and the checksum of nothing."""
    assert StoredFrame(0).flush().hex() == "28b52ffdc438000000000000000001000099e9d851"


def test_a_changed_byte_fails_the_checksum() -> None:
    frame = bytearray(framed(content_of(3 * BLOCK), [BLOCK // 2]))
    for at in (100, 2 * BLOCK, len(frame) - 2):  # the content, a later block, the checksum itself
        bad = bytearray(frame)
        bad[at] ^= 0x10
        with pytest.raises(zstandard.ZstdError, match="checksum"):
            zstandard.ZstdDecompressor().decompress(bytes(bad))


def test_pieces_that_do_not_add_up_to_the_declared_size_are_refused() -> None:
    writer = StoredFrame(10)
    with pytest.raises(ValueError, match="11 bytes given where 10 were left"):
        writer.compress(b"x" * 11)
    writer.compress(b"x" * 4)
    with pytest.raises(ValueError, match="6 bytes short"):
        writer.flush()
    with pytest.raises(ValueError, match="negative"):
        StoredFrame(-1)
    done = StoredFrame(1)
    done.compress(b"x")
    done.flush()
    for late in (lambda: done.flush(), lambda: done.compress(b"")):
        with pytest.raises(ValueError, match="flushed"):
            late()


@pytest.mark.parametrize("size", [0, 1, BLOCK, 3 * BLOCK + 5])
def test_pieces_are_the_compressed_bytes_unjoined_with_each_block_a_view_of_the_content(size: int) -> None:
    """``pieces`` gives ``compress``'s bytes without copying the content: each block is a view of
    what it was given; too much content is refused before the first piece."""
    content = bytearray(content_of(size))
    joined, unjoined = StoredFrame(size), StoredFrame(size)
    pieces = list(unjoined.pieces(content))
    assert b"".join(pieces) == joined.compress(bytes(content))
    assert unjoined.flush() == joined.flush()
    blocks = [p for p in pieces if isinstance(p, memoryview)]
    assert sum(map(len, blocks)) == size
    assert all(len(b) <= BLOCK for b in blocks)
    if size:
        content[0] ^= 0xFF  # the first block reads the content as it now is
        assert bytes(blocks[0][:1]) == bytes(content[:1])
    with pytest.raises(ValueError, match="were left"):
        StoredFrame(size).pieces(bytes(size + 1))


def test_a_frame_takes_no_more_content_until_the_last_pieces_are_read() -> None:
    """Two calls to ``pieces`` before the first's blocks are read would each pass the size check
    with the same room left: the second call, and a flush, are refused until the first is read."""
    frame = StoredFrame(3 * BLOCK)
    first = frame.pieces(bytes(2 * BLOCK))
    with pytest.raises(ValueError, match="not all read"):
        frame.pieces(bytes(2 * BLOCK))
    with pytest.raises(ValueError, match="not all read"):
        frame.flush()
    written = b"".join(first) + frame.compress(content_of(BLOCK)) + frame.flush()
    assert zstandard.ZstdDecompressor().decompress(written) == bytes(2 * BLOCK) + content_of(BLOCK)


def test_a_compression_level_gives_zstd_s_own_compressor() -> None:
    stream = stored_frame.compressor(1, 1000)
    frame = stream.compress(b"a" * 1000) + stream.flush()
    assert len(frame) < 100
    assert zstandard.ZstdDecompressor().decompress(frame) == b"a" * 1000
    with pytest.raises(ValueError, match="not a compression level: 'store'"):
        stored_frame.compressor("store", 10)  # type: ignore[arg-type]


def test_a_stored_payload_decodes_to_the_values_of_a_compressed_one() -> None:
    rng = np.random.default_rng(0)
    plan = build_plan([("w", (300, 500)), ("b", (7,))], 1, 16)
    tensors = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in plan.fragments[0].tensors}
    fields = {"fragment": 0, "base_version": 3, "kind": "params", "quantizer": "fp32"}
    stored = codec.encode(tensors, **fields, level=STORED)
    sink = MemoryUpload(lambda data: None)
    size = codec.encode_into(sink, tensors, **fields, level=STORED)
    assert (bytes(sink.data), size) == (stored, len(stored))
    for blob in (stored, codec.encode(tensors, **fields, level=1)):
        decoded = codec.decode(blob, fragment=plan.fragments[0])
        assert all(np.array_equal(decoded.tensors[n], tensors[n]) for n in tensors)
    assert zstandard.get_frame_parameters(stored[codec._PREFIX.size :]).window_size == BLOCK
    bad = bytearray(stored)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(CorruptPayload, match="checksum"):
        codec.decode(bytes(bad), fragment=plan.fragments[0])
