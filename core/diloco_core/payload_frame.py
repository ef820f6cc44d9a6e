"""A payload's zstd frame written in pieces: the header and each tensor's bytes compressed as they
are made, with no uncompressed copy of the payload (the layout: :mod:`diloco_core.codec`)."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

from diloco_core import quantize as q
from diloco_core.byte_planes import Planes
from diloco_core.payload_errors import CodecError, UnsupportedFormat
from diloco_core.payload_header import SOURCE_DTYPES, PayloadKind, check_fields, render_header, tensor_entry
from diloco_core.stored_frame import BLOCK_END, Bytes, Level, StoredFrame, Stream, compressor

HEADER_LENGTH = struct.Struct("<I")  # the u32 before the header in the frame's content
_PIECE = 1 << 22  # bytes compressed at a time
_LEVELS: dict[str, Level] = {"topk": 3}
"""The zstd level of a format's payloads where it is not ``DEFAULT_LEVEL`` (docs/benchmarks.md,
"Payloads at zstd level 1")."""
DEFAULT_LEVEL: Level = 1


def payload_level(quantizer: str) -> Level:
    """The zstd level a payload in ``quantizer``'s format is compressed at when none is asked for:
    level 1, which writes the quantized formats' codes as small as level 3 does or smaller, in a
    fraction of the time (their bytes compress by their frequencies, hardly by repeats); ``topk``'s
    indices have repeats, and level 3 finds them."""
    return _LEVELS.get(quantizer, DEFAULT_LEVEL)


@dataclass(frozen=True)
class QuantizedTensor:
    """One tensor already in a quantizer's format (``quantize.quantize``'s two byte strings, or the
    same bytes from another implementation of the formats): shape, source dtype, values, scales.
    ``fp32-planes`` values are a ``Planes``, whose bytes are made as they are framed (the frame
    refuses them as bytes, and a ``Planes`` for any other format)."""

    shape: tuple[int, ...]
    values: Bytes | Planes
    scales: Bytes
    dtype: str = "float32"


def frame(
    parts: Mapping[str, QuantizedTensor],
    fragment: int,
    base_version: int,
    kind: PayloadKind,
    quantizer: str,
    block_size: int,
    level: Level | None,
) -> Iterator[Bytes]:
    """The zstd frame of the header and the parts, in pieces: compressed tensor by tensor, with no
    uncompressed copy of the payload (the checks run before the first piece), at ``level`` (None:
    :func:`payload_level`). A block ends after each ``Planes`` run's high plane and after the run."""
    check_fields(fragment, base_version, kind, quantizer, block_size)
    entries: list[dict[str, Any]] = []
    chunks: list[Bytes | Planes] = []
    pos = 0
    for name in sorted(parts):
        part = parts[name]
        if part.dtype not in SOURCE_DTYPES:
            raise UnsupportedFormat(f"tensor {name!r} has dtype {part.dtype}; only floating point is encoded")
        if isinstance(part.values, Planes) != (quantizer == q.PLANES):
            raise CodecError(f"tensor {name!r}: {quantizer} values given as {type(part.values).__name__}")
        n = prod(part.shape)
        nv, ns = _nbytes(part.values), _nbytes(part.scales)
        if (nv, ns) != (q.data_nbytes(quantizer, n, block_size), q.scales_nbytes(quantizer, n, block_size)):
            raise CodecError(
                f"tensor {name!r}: {nv} value and {ns} scale bytes do not fit its shape {part.shape}"
            )
        entries.append(tensor_entry(name, part.shape, part.dtype, pos, nv, ns))
        chunks += [part.values, part.scales]
        pos += nv + ns
    hbytes = render_header(
        entries,
        fragment=fragment,
        base_version=base_version,
        kind=kind,
        quantizer=quantizer,
        block_size=block_size,
    )
    head = HEADER_LENGTH.pack(len(hbytes)) + hbytes
    stream = compressor(payload_level(quantizer) if level is None else level, len(head) + pos)
    yield stream.compress(head)
    for chunk in chunks:
        yield from _pieces(stream, chunk)
    yield stream.flush()


def _nbytes(data: Bytes | Planes) -> int:
    return data.nbytes if isinstance(data, Planes) else len(memoryview(data).cast("B"))


def _pieces(stream: Stream, data: Bytes | Planes) -> Iterator[Bytes]:
    """``data`` through ``stream`` in small pieces (only one is held beside the frame); a ``Planes``
    run by run, a block ended after its high plane and after the run, so that no block mixes the
    high bytes, which compress, with the others, which do not."""
    if isinstance(data, Planes):
        for high, rest in data.runs():
            yield stream.compress(high)
            yield stream.flush(BLOCK_END)
            yield stream.compress(rest)
            yield stream.flush(BLOCK_END)
        return
    view = memoryview(data).cast("B")
    if isinstance(stream, StoredFrame):  # the blocks as views of ``data``, not joined into a copy
        yield from stream.pieces(view)
        return
    for start in range(0, len(view), _PIECE):
        yield stream.compress(view[start : start + _PIECE])
