"""The wire format of fragment payloads (outer gradients and parameters). No pickle anywhere.

Layout of a blob (all integers little-endian)::

    b"DLCF"  u16 format version  u64 length of the zstd frame  | zstd frame
    zstd frame (content size declared, content checksum on) decompresses to:
    u32 header length | header (canonical JSON) | data

The header carries the fragment id, base version, kind, quantizer, block size and, per tensor, its
name, shape, source dtype and where its values and block scales lie in the data. The data is the
concatenation of each tensor's values then scales, in header order, with no gaps.

Decoding treats the bytes as untrusted: the frame length must match the blob exactly (shorter:
``TruncatedPayload``), the declared decompressed size must be at most ``max_bytes`` (by default
``DEFAULT_MAX_BYTES`` without an expected fragment) and, when the expected fragment is given, at
most what that fragment can take in any format, however large — all checked before anything is
allocated or decompressed. The declared length holds exactly one zstd frame: a second
frame or any byte after the first is ``CorruptPayload``, and so is a frame that does not declare its
size or carry its content checksum. Then the checksum (``CorruptPayload``), the header, and the
names and shapes (``ShapeMismatch``) are checked.

The header is bounded before it is parsed, and every way its bytes can be malformed raises a
``CodecError`` subclass with a reason (:mod:`diloco_core.payload_header`); so does every other way
a blob can be malformed, never another exception.

Block scales are stored in the data, as little-endian float32, with only their byte range in the
header, for three reasons. The header's size then depends only on the tensors' names and shapes,
so ``max_header_size`` can bound it (and ``max_decoded_size`` the whole payload) before anything is
decompressed; scales in the header would grow it with the number of values (one scale per block,
millions for a large fragment). The scales stay exact bit patterns, which JSON numbers are not
(nor can strict JSON hold a NaN or an infinite scale). And every range is checked against the size
the shape implies and the ranges must tile the data, so values and scales are read as plain slices
of the data once the header has been accepted.

NaN and infinite values pass the codec on purpose: ``encode`` accepts them and ``decode`` returns
them (fp32, bf16 and fp16 keep them as they are; int8, int4 and e3m0 turn a block holding one into
NaN, its scale being non-finite). The codec is a format: it says whether bytes are a well-formed
payload, not whether the numbers in it are acceptable. That judgement belongs to merging, where
``merge.check_finite`` rejects a contribution or initial parameters with a reason that names the
offending tensor (the synchronizer answers 400 ``non_finite``), once, on the decoded float32
arrays, whatever the quantizer.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from math import prod
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import zstandard

from diloco_core import quantize as q
from diloco_core.byte_planes import Planes
from diloco_core.fragments import Fragment
from diloco_core.payload_errors import (
    CodecError,
    CorruptPayload,
    OversizedPayload,
    ShapeMismatch,
    TruncatedPayload,
    UnsupportedFormat,
)
from diloco_core.payload_frame import HEADER_LENGTH, QuantizedTensor, frame
from diloco_core.payload_header import (
    MAX_HEADER_BYTES,
    PayloadKind,
    Spec,
    check_fields,
    check_layout,
    max_header_size,
    parse_header,
)
from diloco_core.quantized_arrays import QuantizedArrays
from diloco_core.stored_frame import ENTROPY, Level

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "CodecError",
    "CorruptPayload",
    "OversizedPayload",
    "Payload",
    "PayloadKind",
    "QuantizedArrays",
    "QuantizedPayload",
    "QuantizedTensor",
    "ShapeMismatch",
    "TruncatedPayload",
    "UnsupportedFormat",
    "decode",
    "decode_quantized",
    "encode",
    "encode_into",
    "encode_params",
    "encode_quantized",
    "max_bytes_for_values",
    "max_decoded_size",
    "max_payload_size",
    "quantized",
]

MAGIC = b"DLCF"
FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 1 << 30
_PREFIX = struct.Struct("<4sHQ")


@dataclass(frozen=True)
class Payload:
    fragment: int
    base_version: int
    kind: str
    quantizer: str
    tensors: dict[str, npt.NDArray[np.float32]]


def encode(
    tensors: Mapping[str, npt.NDArray[Any]],
    *,
    fragment: int,
    base_version: int,
    kind: PayloadKind,
    quantizer: str,
    block_size: int = q.DEFAULT_BLOCK_SIZE,
    level: Level | None = None,
) -> bytes:
    """Serialize named float arrays; deterministic (same input, same bytes). ``level``: zstd's
    (None: the format's own, ``payload_frame.payload_level``)."""
    fields = Fields(fragment, base_version, kind, quantizer, block_size)
    return encode_with_parts(tensors, fields, level=level)[0]


@dataclass(frozen=True)
class Fields:
    """The fields of a payload's header other than its tensors."""

    fragment: int
    base_version: int
    kind: PayloadKind
    quantizer: str
    block_size: int = q.DEFAULT_BLOCK_SIZE


def encode_params(params: Mapping[str, npt.NDArray[Any]], fragment: int, version: int) -> bytes:
    """Parameters as they travel whole and are stored (a learner's initial upload, with version -1;
    a global version as the synchronizer serves and keeps it): lossless, never quantized, as byte
    planes whose high plane is entropy-coded (``diloco_core.byte_planes``)."""
    return encode(
        params, fragment=fragment, base_version=version, kind="params", quantizer=q.PLANES, level=ENTROPY
    )


def encode_params_into(
    sink: Sink, params: Mapping[str, npt.NDArray[Any]], fragment: int, version: int
) -> int:
    """``encode_params``' bytes written into ``sink`` as they are made (``encode_into``); their size."""
    return encode_into(
        sink,
        params,
        fragment=fragment,
        base_version=version,
        kind="params",
        quantizer=q.PLANES,
        level=ENTROPY,
    )


def encode_with_parts(
    tensors: Mapping[str, npt.NDArray[Any]], fields: Fields, *, level: Level | None = None
) -> tuple[bytes, dict[str, QuantizedTensor]]:
    """:func:`encode`'s bytes and the quantized parts they were made of (:func:`dequantized` gives
    what a receiver decodes from each)."""
    check_fields(fields.fragment, fields.base_version, fields.kind, fields.quantizer, fields.block_size)
    parts = quantized(tensors, fields.quantizer, fields.block_size)
    return encode_quantized(parts, **asdict(fields), level=level), parts


class Sink(Protocol):
    """Where ``encode_into`` writes (an upload of ``diloco_core.uploads``, or anything alike)."""

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def patch(self, offset: int, data: bytes) -> None: ...


def encode_into(
    sink: Sink,
    tensors: Mapping[str, npt.NDArray[Any]],
    *,
    fragment: int,
    base_version: int,
    kind: PayloadKind,
    quantizer: str,
    block_size: int = q.DEFAULT_BLOCK_SIZE,
    level: Level | None = None,
) -> int:
    """``encode``'s bytes written to ``sink`` piece by piece as they are compressed, the frame's
    length patched into the prefix at its end: a large payload is never held whole, nor any copy of
    it. Returns its size."""
    check_fields(fragment, base_version, kind, quantizer, block_size)
    parts = quantized(tensors, quantizer, block_size)
    sink.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, 0))
    length = 0
    for piece in frame(parts, fragment, base_version, kind, quantizer, block_size, level):
        sink.write(piece)
        length += len(piece)
    sink.patch(0, _PREFIX.pack(MAGIC, FORMAT_VERSION, length))
    return _PREFIX.size + length


def quantized(
    tensors: Mapping[str, npt.NDArray[Any]], quantizer: str, block_size: int
) -> dict[str, QuantizedTensor]:
    """Named float arrays in a quantizer's format, ready for :func:`encode_quantized` (which frames
    the same parts again for another base version without quantizing them again)."""
    parts: dict[str, QuantizedTensor] = {}
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if arr.dtype.kind != "f":
            raise UnsupportedFormat(f"tensor {name!r} has dtype {arr.dtype}; only floating point is encoded")
        values, scales = q.quantize(arr.astype(np.float32, copy=False), quantizer, block_size)
        parts[name] = QuantizedTensor(tuple(arr.shape), values, scales, str(arr.dtype))
    return parts


def dequantized(part: QuantizedTensor, quantizer: str, block_size: int) -> npt.NDArray[np.float32]:
    """The float32 values a receiver decodes from ``part`` (quantized by :func:`quantized` with
    ``quantizer`` and ``block_size``), without framing and reading back a payload."""
    if isinstance(part.values, Planes):
        return part.values.values().reshape(part.shape)
    values = q.dequantize(part.values, part.scales, quantizer, prod(part.shape), block_size)
    return values.reshape(part.shape)


def encode_quantized(
    parts: Mapping[str, QuantizedTensor],
    *,
    fragment: int,
    base_version: int,
    kind: PayloadKind,
    quantizer: str,
    block_size: int = q.DEFAULT_BLOCK_SIZE,
    level: Level | None = None,
) -> bytes:
    """Serialize tensors already quantized with ``quantizer`` and ``block_size``; the same bytes as
    ``encode`` of the arrays they were quantized from. Each part's byte sizes must be those its shape
    implies."""
    pieces = list(frame(parts, fragment, base_version, kind, quantizer, block_size, level))
    return b"".join([_PREFIX.pack(MAGIC, FORMAT_VERSION, sum(map(len, pieces))), *pieces])


def max_decoded_size(fragment: Fragment) -> int:
    """The largest decompressed size a payload of this fragment can have in any format."""
    per_tensor = 4  # a partial block's scale can exceed the 4 bytes per value of fp32 by one scale
    return (
        HEADER_LENGTH.size
        + max_header_size(fragment)
        + 4 * fragment.numel
        + per_tensor * len(fragment.tensors)
    )


@dataclass(frozen=True)
class QuantizedPayload:
    """A checked payload whose tensors are read one at a time (``QuantizedArrays``)."""

    fragment: int
    base_version: int
    kind: str
    quantizer: str
    tensors: QuantizedArrays


def decode_quantized(
    blob: bytes | memoryview, *, fragment: Fragment | None = None, max_bytes: int | None = None
) -> QuantizedPayload:
    """Check untrusted bytes as ``decode`` does and keep the tensors quantized (read each with
    ``payload.tensors[name]``; topk's indices are checked at that read)."""
    inner = _decompress(blob, fragment, max_bytes)
    if len(inner) < HEADER_LENGTH.size:
        raise CorruptPayload("payload too short for its header length")
    (hlen,) = HEADER_LENGTH.unpack_from(inner)
    hmax = MAX_HEADER_BYTES if fragment is None else max_header_size(fragment)
    if hlen > hmax or HEADER_LENGTH.size + hlen > len(inner):
        raise CorruptPayload(f"header length {hlen} is out of bounds")
    header = parse_header(bytes(inner[HEADER_LENGTH.size : HEADER_LENGTH.size + hlen]))
    data = memoryview(inner)[HEADER_LENGTH.size + hlen :]
    specs = check_layout(header, len(data))
    if fragment is not None:
        _check_fragment(header, specs, fragment)
    arrays = QuantizedArrays(data, specs, header["quantizer"], header["block_size"])
    return QuantizedPayload(
        header["fragment"], header["base_version"], header["kind"], header["quantizer"], arrays
    )


def decode(
    blob: bytes | memoryview, *, fragment: Fragment | None = None, max_bytes: int | None = None
) -> Payload:
    """Parse untrusted bytes into a ``Payload`` of float32 arrays, or raise a ``CodecError``."""
    lazy = decode_quantized(blob, fragment=fragment, max_bytes=max_bytes)
    tensors = {name: lazy.tensors[name] for name in lazy.tensors}
    return Payload(lazy.fragment, lazy.base_version, lazy.kind, lazy.quantizer, tensors)


def max_payload_size(fragment: Fragment) -> int:
    """The largest blob a payload of this fragment can be: ``max_decoded_size`` with room for a
    frame that does not compress (zstd adds at most about 0.4 %) and the prefix."""
    return max_decoded_size(fragment) * 101 // 100 + 4096


def max_bytes_for_values(values: int) -> int:
    """A bound for a payload of ``values`` values where no fragment says its layout: 4 bytes per
    value, room for the block scales and the header, and never below ``DEFAULT_MAX_BYTES``."""
    return max(DEFAULT_MAX_BYTES, 5 * values + (1 << 20))


def _decompress(blob: bytes | memoryview, fragment: Fragment | None, max_bytes: int | None) -> bytes:
    """The frame's content, within ``max_bytes`` (blob and content) where given, else within what
    ``fragment`` can take, else within ``DEFAULT_MAX_BYTES``."""
    if max_bytes is None:
        max_bytes = DEFAULT_MAX_BYTES if fragment is None else max_payload_size(fragment)
    if len(blob) > max_bytes:
        raise OversizedPayload(f"payload of {len(blob)} bytes exceeds the limit of {max_bytes}")
    if len(blob) < _PREFIX.size:
        raise TruncatedPayload(f"payload of {len(blob)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, frame_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptPayload("not a DiLoCo payload (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise UnsupportedFormat(f"payload format version {version}; this build reads {FORMAT_VERSION}")
    frame = memoryview(blob)[_PREFIX.size :]
    if len(frame) < frame_len:
        raise TruncatedPayload(f"payload truncated: {len(frame)} of {frame_len} compressed bytes")
    if len(frame) > frame_len:
        raise CorruptPayload(f"{len(frame) - frame_len} unexpected bytes after the payload")
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"bad compressed frame header: {exc}") from exc
    size = params.content_size
    if size == zstandard.CONTENTSIZE_UNKNOWN or size == zstandard.CONTENTSIZE_ERROR:
        raise CorruptPayload("compressed frame does not declare its size")
    if not params.has_checksum:  # without it, a flipped byte of a stored frame would decode as data
        raise CorruptPayload("compressed frame carries no content checksum")
    limit = max_bytes if fragment is None else min(max_bytes, max_decoded_size(fragment))
    if size > limit:
        raise OversizedPayload(f"declared size {size} exceeds the limit of {limit} bytes")
    try:
        return zstandard.ZstdDecompressor().decompress(frame, max_output_size=limit, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptPayload(
            f"payload failed to decompress (one zstd frame, nothing after it): {exc}"
        ) from exc


def _check_fragment(header: dict[str, Any], specs: list[Spec], fragment: Fragment) -> None:
    if header["fragment"] != fragment.index:
        raise ShapeMismatch(f"payload is for fragment {header['fragment']}, expected {fragment.index}")
    got = {name: shape for name, shape, _, _ in specs}
    want = {t.name: t.shape for t in fragment.tensors}
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ShapeMismatch(f"fragment {fragment.index}: missing tensors {missing}, unexpected {extra}")
    for name, shape in want.items():
        if got[name] != shape:
            raise ShapeMismatch(f"tensor {name!r} has shape {list(got[name])}, expected {list(shape)}")
