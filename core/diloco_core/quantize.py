"""Quantizers of the wire format, on flat float32 arrays (docs/algorithm.md §3.9).

- ``fp32``: the values as they are.
- ``fp32-planes``: the same values with each run's bytes as four byte planes (``diloco_core.byte_planes``),
  which compress better and faster; the wire format of whole versions, not a codec a job chooses.
- ``bf16``: the top 16 bits of each float32, rounded to nearest even (NaN stays NaN).
- ``fp16``: IEEE half precision (values beyond ±65504 become ±inf).
- ``int8`` / ``int4``: per block of ``block_size`` values a float32 scale ``s`` = the block's largest
  magnitude; each value is ``round(x / s * Q)`` with Q = 127 or 7, so the error is at most ``s / (2Q)``.
- ``e3m0`` (Streaming DiLoCo's 4-bit float): a sign bit and a 3-bit level ``L``; ``L = 0`` is 0 and
  ``L`` in 1..7 is ``sign * 2**(L - 7) * s``. A value takes the level nearest in log2 space; values
  below ``2**-6.5 * s`` (nearer to "below the smallest level" than to it) become 0. The error is at
  most ``max((sqrt(2) - 1) * |x|, 2**-6.5 * s)``. The level is found exactly, with no logarithm:
  with ``m = float32(|x| / s)``, ``L`` is the number of the midpoints ``2**(k - 6.5)``, k = 0..6,
  that ``m`` reaches, each compared as the smallest float32 above it (``E3M0_THRESHOLDS``).

Non-finite input is written canonically, so that every implementation of these formats (this
numpy one is the reference; the learner has a byte-identical torch one) writes the same bytes:
a NaN in ``fp16`` or ``bf16`` keeps its sign and the top bits of its payload and is made quiet;
a block of ``int8``, ``int4`` or ``e3m0`` holding a NaN or an infinity has the scale NaN
(``0x7FC00000``) and every value written as 0, so it decodes to NaN throughout.

Formats for the lowest budgets (meant to be used with error feedback, ``diloco_core.feedback``):

- ``int2``: per block a float32 scale ``s`` = the block's largest magnitude; each value takes the
  nearest of the four levels ``{-1, -1/3, 1/3, 1} * s`` (code ``c`` in 0..3 is ``(2c - 3) / 3 * s``).
  The error is at most ``s / 3``. The grid has no zero: an exact 0 takes ``-s/3`` at an even
  position of the tensor and ``+s/3`` at an odd one, and a value halfway between two levels goes away
  from zero, so the rounding is symmetric and zeros add nothing to a sum on average.
- ``int1`` (scaled sign): per block a float32 scale ``s`` = the mean magnitude of the block; each value
  is ``+s`` (bit 0) or ``-s`` (bit 1, for a negative value or -0.0). This is the sign compressor of
  1-bit SGD / EF-SignSGD: unbiased in norm, not in each value, so it needs error feedback.
- ``topk``: per block the ``TOPK_PER_BLOCK`` values of largest magnitude (ties: the lower index),
  each as a u16 index in the block (strictly increasing) and an int8 code of the block's largest
  magnitude ``s``, as in ``int8``; every other value is 0. The density is ``TOPK_PER_BLOCK /
  block_size``; a block of fewer values keeps them all. The block size is at most ``TOPK_MAX_BLOCK``
  (a u16 index). Its value bytes are all the indices of the tensor (u16) then all its codes (int8).
  Decoding refuses an index outside its block or out of order (``ValueError``; the codec reports it
  as a corrupt payload).

2-bit codes are packed four per byte and 1-bit codes eight per byte, the first value in the lowest
bits; 4-bit codes are packed two per byte, the first value in the low nibble. All byte orders are
little-endian. Dequantized values are float32; arithmetic is float32 (scales) and exact integer codes.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

from diloco_core import byte_planes, code_levels

QuantizerName = Literal["fp32", "bf16", "fp16", "int8", "int4", "e3m0", "int2", "int1", "topk"]
QUANTIZERS: tuple[str, ...] = get_args(QuantizerName)
PLANES = byte_planes.NAME  # fp32 in byte planes: how whole versions travel, not a codec a job chooses
WIRE_FORMATS: tuple[str, ...] = (*QUANTIZERS, PLANES)  # what a payload's header may name
LOSSLESS: tuple[str, ...] = ("fp32", PLANES)  # the formats of parameters (every bit kept)
BLOCKED: frozenset[str] = frozenset({"int8", "int4", "e3m0", "int2", "int1", "topk"})
TOPK_PER_BLOCK = 8
TOPK_MAX_BLOCK = 1 << 16
MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 1 << 20
DEFAULT_BLOCK_SIZE = 256
CANONICAL_NAN_BITS = 0x7FC00000  # the scale of a block holding a non-finite value

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

# the codes of a zero value (what a non-finite block's values are written as)
ZERO_CODE: dict[str, int] = {"int8": 0, "int4": 8, "e3m0": 0, "int2": 2, "int1": 0, "topk": 0}


def _smallest_float32_above_midpoint(k: int) -> np.float32:
    """The smallest float32 above ``2**(k - 6.5)`` (irrational, so no float32 equals it), found with
    exact rational arithmetic: ``c > 2**(k - 6.5)`` iff ``c**2 > 2**(2k - 13)``."""
    target = Fraction(2) ** (2 * k - 13)
    c = np.float32(2.0 ** (k - 6.5))
    while Fraction(float(c)) ** 2 > target:
        c = np.nextafter(c, np.float32(0))
    while Fraction(float(c)) ** 2 < target:
        c = np.nextafter(c, np.float32(1))
    return c


E3M0_THRESHOLDS: F32 = np.array([_smallest_float32_above_midpoint(k) for k in range(7)], dtype=np.float32)


def _int2_codes(blocks: F32, safe: F32, scales: F32) -> U8:
    """The nearest of the four int2 levels, symmetric about 0: a value at ``|x| = 2/3 s`` (between
    1/3 and 1) goes away from zero on both sides, and an exact 0 (no zero level) goes to ``-s/3`` at
    an even position of the tensor and ``+s/3`` at an odd one, so zeros add no bias to a sum. A
    block of zeros (scale 0, decoded as zeros whatever the codes) is written with code 2 throughout."""
    y = blocks / safe
    y *= np.float32(1.5)  # the levels at -1.5, -0.5, 0.5, 1.5
    # the code counts the thresholds -1 and 0 strictly below y and 1 at or below it: y = 1 takes the
    # outer level 3, y = -1 the outer level 0 (halfway between two levels goes away from zero)
    codes: U8 = np.greater(y, np.float32(-1)).view(np.uint8)
    codes += np.greater(y, np.float32(0)).view(np.uint8)
    codes += np.greater_equal(y, np.float32(1)).view(np.uint8)
    zero = y == 0
    if zero.any():
        rows, cols = y.shape  # the parity of position row * cols + col, without an index per value
        odd = (np.arange(rows) * cols % 2 == 1)[:, None] ^ (np.arange(cols) % 2 == 1)[None, :]
        codes += (zero & (odd | (scales == 0)[:, None])).view(np.uint8)
    return codes


_CHUNK_VALUES = 1 << 18  # values quantized at once (about a megabyte of float32)


def data_nbytes(quantizer: str, n: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of the quantized values of ``n`` numbers (without scales)."""
    per = {"fp32": 4, PLANES: 4, "bf16": 2, "fp16": 2, "int8": 1}  # integers: exact for any n
    if quantizer in per:
        return per[quantizer] * n
    if quantizer == "int2":
        return (n + 3) // 4
    if quantizer == "int1":
        return (n + 7) // 8
    if quantizer == "topk":
        return 3 * topk_kept(n, block_size)
    return (n + 1) // 2


def topk_kept(n: int, block_size: int) -> int:
    """How many of ``n`` values ``topk`` keeps: ``TOPK_PER_BLOCK`` per block, all of a smaller block."""
    full, rest = divmod(n, block_size)
    return full * min(TOPK_PER_BLOCK, block_size) + min(TOPK_PER_BLOCK, rest)


def scales_nbytes(quantizer: str, n: int, block_size: int) -> int:
    """Bytes of the float32 block scales of ``n`` numbers (0 for unblocked formats)."""
    return 4 * (-(-n // block_size)) if quantizer in BLOCKED else 0


def quantize(
    x: F32, quantizer: str, block_size: int
) -> tuple[bytes | memoryview | byte_planes.Planes, bytes]:
    """Encode a flat float32 array; returns (values, scales) as little-endian bytes. The values of
    an unblocked format are a view of an array, not a copy (of ``x`` itself for fp32 when it is
    contiguous): a fragment's parameters are encoded without a second copy of them. ``fp32-planes``
    values are a ``byte_planes.Planes``, which makes the bytes a run at a time as they are framed."""
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    if quantizer == "fp32":
        return x.astype("<f4", copy=False).data.cast("B"), b""
    if quantizer == PLANES:
        return byte_planes.Planes(x), b""
    if quantizer == "fp16":
        return _to_fp16(x).astype("<u2", copy=False).data.cast("B"), b""
    if quantizer == "bf16":
        return _to_bf16(x).astype("<u2", copy=False).data.cast("B"), b""
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite block is written canonically
        return _quantize_blocked(x, quantizer, block_size)


def _quantize_blocked(x: F32, quantizer: str, block_size: int) -> tuple[bytes, bytes]:
    """A blocked format a chunk of whole blocks at a time: each chunk holds a multiple of 8 values
    (its codes fill whole bytes) and starts at an even position, so the bytes are those of the
    whole array at once, with temporaries of the chunk's size instead of several of the array's."""
    if quantizer not in ZERO_CODE:
        raise ValueError(f"unknown quantizer {quantizer!r}")
    if quantizer == "topk":
        return _quantize_topk(x, block_size)
    check_block_size(block_size)
    step = max(1, _CHUNK_VALUES // (8 * block_size)) * 8 * block_size
    if x.size <= step:
        return _quantize_chunk(x, quantizer, block_size)
    parts = [_quantize_chunk(x[i : i + step], quantizer, block_size) for i in range(0, x.size, step)]
    return b"".join(codes for codes, _ in parts), b"".join(scales for _, scales in parts)


def _quantize_chunk(x: F32, quantizer: str, block_size: int) -> tuple[bytes, bytes]:
    scales, blocks = _block_scales(x, block_size)
    if quantizer == "int1":
        scales = _mean_magnitudes(x, blocks, scales)
    safe = np.where(scales > 0, scales, np.float32(1))[:, None]
    if quantizer == "int8":
        q: npt.NDArray[np.integer] = _rounded_levels(blocks, safe, 127, 0).astype(np.int8)
    elif quantizer == "int4":
        q = _rounded_levels(blocks, safe, 7, 8).astype(np.uint8)
    elif quantizer == "int2":
        q = _int2_codes(blocks, safe, scales)
    elif quantizer == "int1":
        q = np.signbit(blocks).astype(np.uint8)
    else:
        q = _e3m0_codes(blocks, safe)
    bad = ~np.isfinite(scales)
    if bad.any():
        q[bad] = ZERO_CODE[quantizer]
        scales[bad] = np.uint32(CANONICAL_NAN_BITS).view(np.float32)
    flat = q.ravel()[: x.size]
    if quantizer == "int8":
        codes = flat.tobytes()
    elif quantizer in ("int2", "int1"):
        codes = _pack_bits(flat.astype(np.uint8, copy=False), 2 if quantizer == "int2" else 1)
    else:
        codes = _pack4(flat.astype(np.uint8, copy=False))
    return codes, scales.astype("<f4").tobytes()


def _rounded_levels(blocks: F32, safe: F32, levels: int, offset: int) -> F32:
    """``rint(x / s * levels) + offset`` in one array: integers from ``offset - levels`` to
    ``offset + levels`` for every finite block (its scale is its largest magnitude, so ``|x / s| <= 1``
    exactly and no clipping is needed), whatever for the others (their codes are rewritten)."""
    t = np.divide(blocks, safe)
    np.multiply(t, np.float32(levels), out=t)
    np.rint(t, out=t)
    if offset:
        np.add(t, np.float32(offset), out=t)
    return t


def _mean_magnitudes(x: F32, blocks: F32, maxima: F32) -> F32:
    """Each block's mean magnitude over its real values (the padding of the last block excluded);
    NaN where the block holds a non-finite value (its maximum is not finite)."""
    counts = np.full(blocks.shape[0], blocks.shape[1], dtype=np.float32)
    if counts.size:
        counts[-1] = x.size - blocks.shape[1] * (blocks.shape[0] - 1)
    means = (np.abs(blocks).astype(np.float64).sum(axis=1) / counts).astype(np.float32)
    return np.where(np.isfinite(maxima), means, np.float32(np.nan)).astype(np.float32)


def _quantize_topk(x: F32, block_size: int) -> tuple[bytes, bytes]:
    if block_size > TOPK_MAX_BLOCK:
        raise ValueError(f"topk takes a block size of at most {TOPK_MAX_BLOCK}, got {block_size}")
    scales, blocks = _block_scales(x, block_size)
    indices: list[npt.NDArray[np.uint16]] = []
    codes: list[npt.NDArray[np.int8]] = []
    for b in range(blocks.shape[0]):
        real = min(block_size, x.size - b * block_size)
        block, s = blocks[b, :real], scales[b]
        keep = min(TOPK_PER_BLOCK, real)
        if not np.isfinite(s):
            idx = np.arange(keep)
            code = np.zeros(keep, dtype=np.int8)
            scales[b] = np.uint32(CANONICAL_NAN_BITS).view(np.float32)
        else:
            order = np.argsort(-np.abs(block), kind="stable")[:keep]
            idx = np.sort(order)
            safe = s if s > 0 else np.float32(1)
            code = np.clip(np.rint(block[idx] / safe * np.float32(127)), -127, 127).astype(np.int8)
        indices.append(idx.astype(np.uint16))
        codes.append(code)
    flat_idx = np.concatenate(indices) if indices else np.zeros(0, dtype=np.uint16)
    flat_codes = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int8)
    return flat_idx.astype("<u2").tobytes() + flat_codes.tobytes(), scales.astype("<f4").tobytes()


def dequantize(
    values: bytes | memoryview, scales: bytes | memoryview, quantizer: str, n: int, block_size: int
) -> F32:
    """Inverse of ``quantize`` on the bytes a payload carries (``fp32-planes``: the bytes a ``Planes``
    makes); the byte lengths must already have been checked."""
    if quantizer == "fp32":
        return np.frombuffer(values, dtype="<f4", count=n).astype(np.float32)
    if quantizer == PLANES:
        return byte_planes.decode(values, n)
    if quantizer == "fp16":
        return np.frombuffer(values, dtype="<f2", count=n).astype(np.float32)
    if quantizer == "bf16":
        bits = np.frombuffer(values, dtype="<u2", count=n).astype(np.uint32) << 16
        return bits.view(np.float32)
    s = np.frombuffer(scales, dtype="<f4").astype(np.float32)
    if quantizer == "topk":
        return _dequantize_topk(values, s, n, block_size)
    if quantizer in code_levels.BITS:
        return code_levels.decode(values, s, quantizer, n, block_size)
    raise ValueError(f"unknown quantizer {quantizer!r}")


def add_dequantized(
    acc: F32,
    factor: np.float32,
    values: bytes | memoryview,
    scales: bytes | memoryview,
    quantizer: str,
    n: int,
    block_size: int,
) -> None:
    """``acc += dequantize(...) * factor`` for a blocked low-bit format (``decodes_in_chunks``), the
    values decoded a chunk at a time (``code_levels.add_decoded``); the byte lengths must already
    have been checked."""
    if not decodes_in_chunks(quantizer):
        raise ValueError(f"{quantizer!r} is not decoded a chunk at a time")
    s = np.frombuffer(scales, dtype="<f4").astype(np.float32)
    code_levels.add_decoded(acc, factor, values, s, quantizer, n, block_size)


def decodes_in_chunks(quantizer: str) -> bool:
    """Whether ``add_dequantized`` takes ``quantizer``'s payloads (the blocked low-bit formats)."""
    return quantizer in code_levels.BITS


def _dequantize_topk(values: bytes | memoryview, s: F32, n: int, block_size: int) -> F32:
    kept = topk_kept(n, block_size)
    idx = np.frombuffer(values, dtype="<u2", count=kept).astype(np.int64)
    codes = np.frombuffer(values, dtype=np.int8, count=kept, offset=2 * kept).astype(np.float32)
    per_block = np.full(s.size, min(TOPK_PER_BLOCK, block_size), dtype=np.int64)
    if s.size:
        per_block[-1] = kept - per_block[0] * (s.size - 1)
    block_of = np.repeat(np.arange(s.size), per_block)
    lengths = np.minimum(block_size, n - np.arange(s.size) * block_size)
    if kept and (np.any(idx >= lengths[block_of]) or np.any((np.diff(idx) <= 0) & (np.diff(block_of) == 0))):
        raise ValueError("topk index outside its block or not strictly increasing")
    out = np.zeros(n, dtype=np.float32)
    out[block_of * block_size + idx] = codes * (s[block_of] / np.float32(127))
    bad = ~np.isfinite(s)
    if bad.any():
        out.reshape(-1)[np.repeat(bad, block_size)[:n]] = np.float32(np.nan)
    return out


def _pack_bits(codes: U8, bits: int) -> bytes:
    """``8 / bits`` codes to a byte, the first in the lowest bits: the codes read as little-endian
    words of one byte per code, each code shifted down from its byte to its bits in the word."""
    per = 8 // bits
    if codes.size % per:
        codes = np.concatenate([codes, np.zeros(-codes.size % per, dtype=np.uint8)])
    words: npt.NDArray[np.unsignedinteger] = np.ascontiguousarray(codes).view(f"<u{per}")
    kind = words.dtype.type
    out = words & kind((1 << bits) - 1)
    for i in range(1, per):
        out |= (words >> kind(i * (8 - bits))) & kind(((1 << bits) - 1) << (i * bits))
    packed: bytes = out.astype(np.uint8).tobytes()
    return packed


def _to_fp16(x: F32) -> npt.NDArray[np.uint16]:
    with np.errstate(over="ignore"):
        out = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        bits = x[nan].view(np.uint32)
        sign = ((bits >> 16) & 0x8000).astype(np.uint16)
        out[nan] = sign | np.uint16(0x7E00) | ((bits >> 13) & 0x3FF).astype(np.uint16)
    return out


def _to_bf16(x: F32) -> npt.NDArray[np.uint16]:
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((bits[nan] >> 16).astype(np.uint16)) | np.uint16(0x0040)
    return out


def check_block_size(block_size: int) -> None:
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size}")


def _block_scales(x: F32, block_size: int) -> tuple[F32, F32]:
    check_block_size(block_size)
    nblocks = -(-x.size // block_size)
    if x.size == nblocks * block_size:  # whole blocks: read in place, through a view that refuses writes
        blocks = x.reshape(nblocks, block_size)
        blocks.flags.writeable = False
    else:
        padded = np.zeros(nblocks * block_size, dtype=np.float32)
        padded[: x.size] = x
        blocks = padded.reshape(nblocks, block_size)
    scales = np.abs(blocks).max(axis=1) if nblocks else np.zeros(0, dtype=np.float32)
    return scales.astype(np.float32), blocks


def _e3m0_codes(blocks: F32, safe: F32) -> U8:
    mag = np.abs(blocks) / safe
    level = np.zeros(mag.shape, dtype=np.uint8)
    for t in E3M0_THRESHOLDS:
        np.add(level, mag >= t, out=level, casting="unsafe")
    sign: U8 = (np.signbit(blocks) & (level > 0)).astype(np.uint8) << np.uint8(3)
    codes: U8 = np.bitwise_or(sign, level).astype(np.uint8)
    return codes


def _pack4(codes: U8) -> bytes:
    if codes.size % 2:
        codes = np.concatenate([codes, np.zeros(1, dtype=np.uint8)])
    pairs = codes.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).astype(np.uint8).tobytes()
