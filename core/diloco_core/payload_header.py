"""The header of a fragment payload: its fields, the limits on it, writing it, and checking an
untrusted one against the data it describes (the layout of a whole blob: :mod:`diloco_core.codec`).

The header is canonical JSON: the fragment id, base version, kind, quantizer, block size and, per
tensor, its name, shape, source dtype and the byte ranges of its values and block scales in the
data. It is bounded before it is parsed: its length (``max_header_size``), its nesting (at most
``MAX_HEADER_DEPTH`` levels of arrays and objects, as deep as the format goes), and each integer
(at most 20 digits, a u64) while it is parsed; it holds no other numbers. A tensor's shape has at
most ``MAX_DIMS`` dimensions, the product of its dimensions other than zero is at most
``MAX_NUMEL`` (an empty tensor's too), and a non-empty shape's product is compared with the data's
length, each before any size is computed from it. Every way a header can be malformed raises a
``CodecError`` subclass with a reason, never another exception.
"""

from __future__ import annotations

import json
import re
from math import prod
from typing import Any, Literal, get_args

from diloco_core import quantize as q
from diloco_core.fragments import Fragment
from diloco_core.payload_errors import CorruptPayload, OversizedPayload, UnsupportedFormat

MAX_HEADER_BYTES = 4 << 20
MAX_HEADER_DEPTH = 4  # header object > tensor list > tensor entry > shape or byte range
MAX_INTEGER_DIGITS = 20  # a u64
MAX_DIMS = 32
MAX_NUMEL = (2**63 - 1) // 8
"""The most values a tensor's shape may describe, its zero dimensions left out: numpy makes no array
of more than 2**63 - 1 bytes, so any shape within this bound is an array of every source dtype
(float64, 8 bytes a value, the widest), an empty one included."""
MAX_VALUES_PER_BYTE = q.TOPK_MAX_BLOCK // (3 * q.TOPK_PER_BLOCK + 4) + 1  # topk, largest blocks
SOURCE_DTYPES = ("float32", "float64", "float16", "bfloat16")

PayloadKind = Literal["outer_grad", "params", "update"]  # update: new version - the version ``base_version``
KINDS: tuple[str, ...] = get_args(PayloadKind)

Spec = tuple[str, tuple[int, ...], tuple[int, int], tuple[int, int]]
"""A checked tensor entry: name, shape, and the (offset, length) of its values and of its scales."""


def check_fields(fragment: int, base_version: int, kind: str, quantizer: str, block_size: int) -> None:
    """Refuse header fields no payload can have (``UnsupportedFormat``), before anything is encoded."""
    if quantizer not in q.WIRE_FORMATS:
        raise UnsupportedFormat(f"unknown quantizer {quantizer!r}; expected one of {q.WIRE_FORMATS}")
    if kind not in KINDS:
        raise UnsupportedFormat(f"unknown payload kind {kind!r}; expected one of {KINDS}")
    if not q.MIN_BLOCK_SIZE <= block_size <= q.MAX_BLOCK_SIZE:
        raise UnsupportedFormat(f"block_size must be in [{q.MIN_BLOCK_SIZE}, {q.MAX_BLOCK_SIZE}]")
    if quantizer == "topk" and block_size > q.TOPK_MAX_BLOCK:
        raise UnsupportedFormat(f"topk takes a block size of at most {q.TOPK_MAX_BLOCK}")
    if fragment < 0 or base_version < -1:
        raise UnsupportedFormat(f"bad fragment {fragment} or base version {base_version}")


def tensor_entry(
    name: str, shape: tuple[int, ...], dtype: str, offset: int, nvalues: int, nscales: int
) -> dict[str, Any]:
    """A tensor's entry: its values at ``offset`` in the data, its scales right after them. A name
    or shape no receiver would take (``check_layout``) is refused here, before a payload is made."""
    if not isinstance(name, str):
        raise UnsupportedFormat(f"tensor name {name!r} is not a string")
    if len(shape) > MAX_DIMS:
        raise UnsupportedFormat(f"tensor {name!r} has {len(shape)} dimensions (at most {MAX_DIMS})")
    if prod(d for d in shape if d) > MAX_NUMEL:
        raise UnsupportedFormat(
            f"tensor {name!r}: shape {list(shape)} describes more than {MAX_NUMEL} values"
        )
    return {
        "name": name,
        "shape": list(shape),
        "dtype": dtype,
        "values": [offset, nvalues],
        "scales": [offset + nvalues, nscales],
    }


def render_header(
    entries: list[dict[str, Any]],
    *,
    fragment: int,
    base_version: int,
    kind: str,
    quantizer: str,
    block_size: int,
) -> bytes:
    """The header as canonical JSON; ``OversizedPayload`` beyond ``MAX_HEADER_BYTES``."""
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
    return hbytes


def max_header_size(fragment: Fragment) -> int:
    """The largest header a payload of this fragment can have (ASCII-escaped names, 20-digit numbers)."""
    per_tensor = sum(12 * len(t.name) + 24 * len(t.shape) + 256 for t in fragment.tensors)
    return min(512 + per_tensor, MAX_HEADER_BYTES)


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


def parse_header(raw: bytes) -> dict[str, Any]:
    """The header's fields, each of the type and in the range the format allows (its tensor entries
    are for :func:`check_layout`)."""
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
    if h["quantizer"] not in q.WIRE_FORMATS:
        raise UnsupportedFormat(f"unknown quantizer {h['quantizer']!r}")
    if h["kind"] not in KINDS:
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


def check_layout(header: dict[str, Any], data_len: int) -> list[Spec]:
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
        if t["dtype"] not in SOURCE_DTYPES:
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
    in any format (``topk`` at its sparsest: 28 bytes per block of ``TOPK_MAX_BLOCK`` values), and
    for an empty tensor once its other dimensions multiply to more than ``MAX_NUMEL`` — before it
    grows into a number no size can be made of, or a shape no array can have."""
    if len(shape) > MAX_DIMS:
        raise CorruptPayload(f"tensor {name!r} has {len(shape)} dimensions (at most {MAX_DIMS})")
    empty = 0 in shape
    n = 1
    for d in shape:
        n *= d or 1
        if not empty and n > MAX_VALUES_PER_BYTE * data_len:
            raise CorruptPayload(
                f"tensor {name!r}: shape {shape} holds more values than {data_len} bytes of data can"
            )
        if n > MAX_NUMEL:
            raise CorruptPayload(
                f"tensor {name!r}: shape {shape} describes more than {MAX_NUMEL} values, its zero "
                "dimensions left out"
            )
    return 0 if empty else n
