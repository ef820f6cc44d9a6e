"""The wire format of fragment payloads (outer gradients and parameters). No pickle anywhere.

Layout of a blob (all integers little-endian)::

    b"DLCF"  u16 format version  u64 length of the zstd frame  | zstd frame
    zstd frame (content size declared, content checksum on) decompresses to:
    u32 header length | header (canonical JSON) | data

The header carries the fragment id, base version, kind, quantizer, block size and, per tensor, its
name, shape, source dtype and where its values and block scales lie in the data. The data is the
concatenation of each tensor's values then scales, in header order, with no gaps.

Decoding treats the bytes as untrusted: the frame length must match the blob exactly (shorter:
``TruncatedPayload``), the declared decompressed size must be at most ``max_bytes`` and, when the
expected fragment is given, at most what that fragment can take in any format — all checked before
anything is allocated or decompressed. The declared length holds exactly one zstd frame: a second
frame or any byte after the first is ``CorruptPayload``. Then the checksum (``CorruptPayload``),
the header, and the names and shapes (``ShapeMismatch``) are checked.

The header is bounded before it is parsed: its length (``max_header_size``), its nesting (at most
``MAX_HEADER_DEPTH`` levels of arrays and objects, as deep as the format goes), and each integer
(at most 20 digits, a u64) while it is parsed; it holds no other numbers. A tensor's shape has at
most ``MAX_DIMS`` dimensions and its product is compared with the data's length before any size is
computed from it. Every way bytes can be malformed raises a ``CodecError`` subclass with a reason,
never another exception.

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

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import zstandard

from diloco_core import quantize as q
from diloco_core.fragments import Fragment

MAGIC = b"DLCF"
FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 1 << 30
MAX_HEADER_BYTES = 4 << 20
MAX_HEADER_DEPTH = 4  # header object > tensor list > tensor entry > shape or byte range
MAX_INTEGER_DIGITS = 20  # a u64
MAX_DIMS = 32
MAX_VALUES_PER_BYTE = q.TOPK_MAX_BLOCK // (3 * q.TOPK_PER_BLOCK + 4) + 1  # topk, largest blocks
_PREFIX = struct.Struct("<4sHQ")
_HLEN = struct.Struct("<I")
_KINDS = ("outer_grad", "params", "update")  # update: new version - the version ``base_version``
_SOURCE_DTYPES = ("float32", "float64", "float16", "bfloat16")

PayloadKind = Literal["outer_grad", "params", "update"]


class CodecError(ValueError):
    """A payload that cannot be encoded or decoded; ``code`` names the reason for the API."""

    code = "codec_error"


class TruncatedPayload(CodecError):
    code = "truncated"


class CorruptPayload(CodecError):
    code = "corrupt"


class OversizedPayload(CodecError):
    code = "oversized"


class ShapeMismatch(CodecError):
    code = "wrong_shape"


class UnsupportedFormat(CodecError):
    code = "unsupported"


@dataclass(frozen=True)
class Payload:
    fragment: int
    base_version: int
    kind: str
    quantizer: str
    tensors: dict[str, npt.NDArray[np.float32]]


Bytes = bytes | bytearray | memoryview


@dataclass(frozen=True)
class QuantizedTensor:
    """One tensor already in a quantizer's format (``quantize.quantize``'s two byte strings, or the
    same bytes from another implementation of the formats): shape, source dtype, values, scales."""

    shape: tuple[int, ...]
    values: Bytes
    scales: Bytes
    dtype: str = "float32"


def encode(
    tensors: Mapping[str, npt.NDArray[Any]],
    *,
    fragment: int,
    base_version: int,
    kind: PayloadKind,
    quantizer: str,
    block_size: int = q.DEFAULT_BLOCK_SIZE,
    level: int = 3,
) -> bytes:
    """Serialize named float arrays; deterministic (same input, same bytes)."""
    _check_encode_args(fragment, base_version, kind, quantizer, block_size)
    parts: dict[str, QuantizedTensor] = {}
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if arr.dtype.kind != "f":
            raise UnsupportedFormat(f"tensor {name!r} has dtype {arr.dtype}; only floating point is encoded")
        values, scales = q.quantize(arr.astype(np.float32, copy=False), quantizer, block_size)
        parts[name] = QuantizedTensor(tuple(arr.shape), values, scales, str(arr.dtype))
    return encode_quantized(
        parts,
        fragment=fragment,
        base_version=base_version,
        kind=kind,
        quantizer=quantizer,
        block_size=block_size,
        level=level,
    )


def encode_quantized(
    parts: Mapping[str, QuantizedTensor],
    *,
    fragment: int,
    base_version: int,
    kind: PayloadKind,
    quantizer: str,
    block_size: int = q.DEFAULT_BLOCK_SIZE,
    level: int = 3,
) -> bytes:
    """Serialize tensors already quantized with ``quantizer`` and ``block_size``; the same bytes as
    ``encode`` of the arrays they were quantized from. Each part's byte sizes must be those its shape
    implies."""
    _check_encode_args(fragment, base_version, kind, quantizer, block_size)
    entries: list[dict[str, Any]] = []
    chunks: list[Bytes] = []
    pos = 0
    for name in sorted(parts):
        part = parts[name]
        if part.dtype not in _SOURCE_DTYPES:
            raise UnsupportedFormat(f"tensor {name!r} has dtype {part.dtype}; only floating point is encoded")
        n = prod(part.shape)
        nv, ns = len(memoryview(part.values).cast("B")), len(memoryview(part.scales).cast("B"))
        if (nv, ns) != (q.data_nbytes(quantizer, n, block_size), q.scales_nbytes(quantizer, n, block_size)):
            raise CodecError(
                f"tensor {name!r}: {nv} value and {ns} scale bytes do not fit its shape {part.shape}"
            )
        entries.append(
            {
                "name": name,
                "shape": list(part.shape),
                "dtype": part.dtype,
                "values": [pos, nv],
                "scales": [pos + nv, ns],
            }
        )
        chunks += [part.values, part.scales]
        pos += nv + ns
    header = {
        "fragment": fragment,
        "base_version": base_version,
        "kind": kind,
        "quantizer": quantizer,
        "block_size": block_size,
        "tensors": entries,
    }
    hbytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(hbytes) > MAX_HEADER_BYTES:
        raise OversizedPayload(f"header of {len(hbytes)} bytes exceeds {MAX_HEADER_BYTES}")
    inner = b"".join([_HLEN.pack(len(hbytes)), hbytes, *chunks])
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    frame = cctx.compress(inner)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(frame)) + frame


def _check_encode_args(fragment: int, base_version: int, kind: str, quantizer: str, block_size: int) -> None:
    if quantizer not in q.QUANTIZERS:
        raise UnsupportedFormat(f"unknown quantizer {quantizer!r}; expected one of {q.QUANTIZERS}")
    if kind not in _KINDS:
        raise UnsupportedFormat(f"unknown payload kind {kind!r}; expected one of {_KINDS}")
    if not q.MIN_BLOCK_SIZE <= block_size <= q.MAX_BLOCK_SIZE:
        raise UnsupportedFormat(f"block_size must be in [{q.MIN_BLOCK_SIZE}, {q.MAX_BLOCK_SIZE}]")
    if quantizer == "topk" and block_size > q.TOPK_MAX_BLOCK:
        raise UnsupportedFormat(f"topk takes a block size of at most {q.TOPK_MAX_BLOCK}")
    if fragment < 0 or base_version < -1:
        raise UnsupportedFormat(f"bad fragment {fragment} or base version {base_version}")


def max_header_size(fragment: Fragment) -> int:
    """The largest header a payload of this fragment can have (ASCII-escaped names, 20-digit numbers)."""
    per_tensor = sum(12 * len(t.name) + 24 * len(t.shape) + 256 for t in fragment.tensors)
    return min(512 + per_tensor, MAX_HEADER_BYTES)


def max_decoded_size(fragment: Fragment) -> int:
    """The largest decompressed size a payload of this fragment can have in any format."""
    per_tensor = 4  # a partial block's scale can exceed the 4 bytes per value of fp32 by one scale
    return _HLEN.size + max_header_size(fragment) + 4 * fragment.numel + per_tensor * len(fragment.tensors)


def decode(blob: bytes, *, fragment: Fragment | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Payload:
    """Parse untrusted bytes into a ``Payload`` of float32 arrays, or raise a ``CodecError``."""
    inner = _decompress(blob, fragment, max_bytes)
    if len(inner) < _HLEN.size:
        raise CorruptPayload("payload too short for its header length")
    (hlen,) = _HLEN.unpack_from(inner)
    hmax = MAX_HEADER_BYTES if fragment is None else max_header_size(fragment)
    if hlen > hmax or _HLEN.size + hlen > len(inner):
        raise CorruptPayload(f"header length {hlen} is out of bounds")
    header = _parse_header(bytes(inner[_HLEN.size : _HLEN.size + hlen]))
    data = memoryview(inner)[_HLEN.size + hlen :]
    specs = _check_layout(header, len(data))
    if fragment is not None:
        _check_fragment(header, specs, fragment)
    tensors = {}
    for name, shape, (vo, vn), (so, sn) in specs:
        n = prod(shape)
        try:
            flat = q.dequantize(
                bytes(data[vo : vo + vn]),
                bytes(data[so : so + sn]),
                header["quantizer"],
                n,
                header["block_size"],
            )
        except ValueError as exc:  # only topk's indices can be malformed once the layout is checked
            raise CorruptPayload(f"tensor {name!r}: {exc}") from exc
        tensors[name] = flat.reshape(shape)
    return Payload(header["fragment"], header["base_version"], header["kind"], header["quantizer"], tensors)


def _decompress(blob: bytes, fragment: Fragment | None, max_bytes: int) -> bytes:
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
        size = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"bad compressed frame header: {exc}") from exc
    if size == zstandard.CONTENTSIZE_UNKNOWN or size == zstandard.CONTENTSIZE_ERROR:
        raise CorruptPayload("compressed frame does not declare its size")
    limit = max_bytes if fragment is None else min(max_bytes, max_decoded_size(fragment))
    if size > limit:
        raise OversizedPayload(f"declared size {size} exceeds the limit of {limit} bytes")
    try:
        return zstandard.ZstdDecompressor().decompress(frame, max_output_size=limit, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptPayload(
            f"payload failed to decompress (one zstd frame, nothing after it): {exc}"
        ) from exc


_JSON_STRUCTURE = re.compile(rb'["\\\[\]{}]')


def _nesting_exceeds(raw: bytes, limit: int) -> bool:
    """Whether arrays and objects nest deeper than ``limit`` outside strings; stops at the first
    level too many, so a crafted header costs no more than its length to refuse."""
    depth, in_string, skip_to = 0, False, -1
    for match in _JSON_STRUCTURE.finditer(raw):
        pos = match.start()
        if pos < skip_to:
            continue
        c = raw[pos]
        if in_string:
            if c == 0x5C:  # a backslash escapes the next byte, a quote included
                skip_to = pos + 2
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in b"[{":
            depth += 1
            if depth > limit:
                return True
        elif c in b"]}":
            depth -= 1
    return False


def _header_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise CorruptPayload(f"header holds an integer of {len(text)} digits (at most {MAX_INTEGER_DIGITS})")
    return int(text)


def _not_in_header(text: str) -> Any:
    raise CorruptPayload(f"header holds the number {text[:32]!r}; it holds integers only")


def _parse_header(raw: bytes) -> dict[str, Any]:
    if _nesting_exceeds(raw, MAX_HEADER_DEPTH):
        raise CorruptPayload(f"header nests deeper than {MAX_HEADER_DEPTH} levels")
    try:
        h = json.loads(raw, parse_int=_header_int, parse_float=_not_in_header, parse_constant=_not_in_header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptPayload(f"header is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # not reached after the nesting check; kept as the codec's error
        raise CorruptPayload("header nests too deep") from exc
    if not isinstance(h, dict) or set(h) != {
        "fragment",
        "base_version",
        "kind",
        "quantizer",
        "block_size",
        "tensors",
    }:
        raise CorruptPayload("header has missing or unexpected fields")
    if h["quantizer"] not in q.QUANTIZERS:
        raise UnsupportedFormat(f"unknown quantizer {h['quantizer']!r}")
    if h["kind"] not in _KINDS:
        raise UnsupportedFormat(f"unknown payload kind {h['kind']!r}")
    ok = (
        _is_int(h["fragment"], 0)
        and _is_int(h["base_version"], -1)
        and _is_int(h["block_size"], q.MIN_BLOCK_SIZE)
        and h["block_size"] <= q.MAX_BLOCK_SIZE
        and isinstance(h["tensors"], list)
        and (h["quantizer"] != "topk" or h["block_size"] <= q.TOPK_MAX_BLOCK)
    )
    if not ok:
        raise CorruptPayload("header has a field of the wrong type or range")
    return h


def _is_int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


Spec = tuple[str, tuple[int, ...], tuple[int, int], tuple[int, int]]


def _check_layout(header: dict[str, Any], data_len: int) -> list[Spec]:
    """Each tensor's byte ranges must have exactly the size its shape implies and tile the data."""
    specs: list[Spec] = []
    pos = 0
    quant, block = header["quantizer"], header["block_size"]
    for t in header["tensors"]:
        if not isinstance(t, dict) or set(t) != {"name", "shape", "dtype", "values", "scales"}:
            raise CorruptPayload("tensor entry has missing or unexpected fields")
        name, shape, ranges = t["name"], t["shape"], (t["values"], t["scales"])
        if not isinstance(name, str) or not isinstance(shape, list) or not all(_is_int(d, 0) for d in shape):
            raise CorruptPayload(f"tensor entry {name!r} has a bad name or shape")
        if t["dtype"] not in _SOURCE_DTYPES:
            raise UnsupportedFormat(f"tensor {name!r} has unsupported dtype {t['dtype']!r}")
        n = _numel(name, shape, data_len)
        want = (q.data_nbytes(quant, n, block), q.scales_nbytes(quant, n, block))
        for r, size in zip(ranges, want, strict=True):
            if not (isinstance(r, list) and len(r) == 2 and r[0] == pos and r[1] == size):
                raise CorruptPayload(f"tensor {name!r}: byte range {r!r} does not match its shape {shape}")
            pos += size
        specs.append((name, tuple(shape), (t["values"][0], t["values"][1]), (t["scales"][0], t["scales"][1])))
    if pos != data_len:
        raise CorruptPayload(f"data has {data_len} bytes; the header describes {pos}")
    if len({s[0] for s in specs}) != len(specs):
        raise CorruptPayload("a tensor name appears twice")
    return specs


def _numel(name: str, shape: list[int], data_len: int) -> int:
    """The number of values of ``shape``, refused once it exceeds what ``data_len`` bytes can hold
    in any format (``topk`` at its sparsest: 28 bytes per block of ``TOPK_MAX_BLOCK`` values) —
    before it grows into a number no size can be made of."""
    if len(shape) > MAX_DIMS:
        raise CorruptPayload(f"tensor {name!r} has {len(shape)} dimensions (at most {MAX_DIMS})")
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > MAX_VALUES_PER_BYTE * data_len:
            raise CorruptPayload(
                f"tensor {name!r}: shape {shape} holds more values than {data_len} bytes of data can"
            )
    return n


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
