"""Quantizers of the wire format, on flat float32 arrays (docs/algorithm.md §3.9).

- ``fp32``: the values as they are.
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

4-bit codes are packed two per byte, the first value in the low nibble. All byte orders are
little-endian. Dequantized values are float32; arithmetic is float32 (scales) and exact integer codes.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Literal

import numpy as np
import numpy.typing as npt

QuantizerName = Literal["fp32", "bf16", "fp16", "int8", "int4", "e3m0"]
QUANTIZERS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "int4", "e3m0")
BLOCKED: frozenset[str] = frozenset({"int8", "int4", "e3m0"})
MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 1 << 20
DEFAULT_BLOCK_SIZE = 256
CANONICAL_NAN_BITS = 0x7FC00000  # the scale of a block holding a non-finite value

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

# value of each 4-bit code for a block scale of 1
_INT4_LEVELS: F32 = ((np.arange(16, dtype=np.float32) - 8) / np.float32(7)).astype(np.float32)
_E3M0_LEVELS: F32 = np.array(
    [(-1.0 if c & 8 else 1.0) * (2.0 ** ((c & 7) - 7) if c & 7 else 0.0) for c in range(16)], dtype=np.float32
)

# the codes of a zero value (what a non-finite block's values are written as)
ZERO_CODE: dict[str, int] = {"int8": 0, "int4": 8, "e3m0": 0}


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


def data_nbytes(quantizer: str, n: int) -> int:
    """Bytes of the quantized values of ``n`` numbers (without scales)."""
    per = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}  # integers: exact for any n
    if quantizer in per:
        return per[quantizer] * n
    return (n + 1) // 2


def scales_nbytes(quantizer: str, n: int, block_size: int) -> int:
    """Bytes of the float32 block scales of ``n`` numbers (0 for unblocked formats)."""
    return 4 * (-(-n // block_size)) if quantizer in BLOCKED else 0


def quantize(x: F32, quantizer: str, block_size: int) -> tuple[bytes, bytes]:
    """Encode a flat float32 array; returns (values, scales) as little-endian bytes."""
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    if quantizer == "fp32":
        return x.astype("<f4", copy=False).tobytes(), b""
    if quantizer == "fp16":
        return _to_fp16(x).astype("<u2", copy=False).tobytes(), b""
    if quantizer == "bf16":
        return _to_bf16(x).astype("<u2", copy=False).tobytes(), b""
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite block is written canonically
        return _quantize_blocked(x, quantizer, block_size)


def _quantize_blocked(x: F32, quantizer: str, block_size: int) -> tuple[bytes, bytes]:
    if quantizer not in ZERO_CODE:
        raise ValueError(f"unknown quantizer {quantizer!r}")
    scales, blocks = _block_scales(x, block_size)
    safe = np.where(scales > 0, scales, np.float32(1))[:, None]
    if quantizer == "int8":
        q: npt.NDArray[np.integer] = np.clip(np.rint(blocks / safe * np.float32(127)), -127, 127).astype(np.int8)
    elif quantizer == "int4":
        q = (np.clip(np.rint(blocks / safe * np.float32(7)), -7, 7).astype(np.int16) + 8).astype(np.uint8)
    else:
        q = _e3m0_codes(blocks, safe)
    bad = ~np.isfinite(scales)
    if bad.any():
        q[bad] = ZERO_CODE[quantizer]
        scales[bad] = np.uint32(CANONICAL_NAN_BITS).view(np.float32)
    flat = q.ravel()[: x.size]
    codes = flat.tobytes() if quantizer == "int8" else _pack4(flat.astype(np.uint8, copy=False))
    return codes, scales.astype("<f4").tobytes()


def dequantize(values: bytes, scales: bytes, quantizer: str, n: int, block_size: int) -> F32:
    """Inverse of ``quantize``; the byte lengths must already have been checked."""
    if quantizer == "fp32":
        return np.frombuffer(values, dtype="<f4", count=n).astype(np.float32)
    if quantizer == "fp16":
        return np.frombuffer(values, dtype="<f2", count=n).astype(np.float32)
    if quantizer == "bf16":
        bits = np.frombuffer(values, dtype="<u2", count=n).astype(np.uint32) << 16
        return bits.view(np.float32)
    s = np.frombuffer(scales, dtype="<f4").astype(np.float32)
    per_value = np.repeat(s, block_size)[:n]
    if quantizer == "int8":
        q = np.frombuffer(values, dtype=np.int8, count=n).astype(np.float32)
        return q * (per_value / np.float32(127))
    codes = _unpack4(values, n)
    if quantizer == "int4":
        return _INT4_LEVELS[codes] * per_value
    if quantizer == "e3m0":
        return _E3M0_LEVELS[codes] * per_value
    raise ValueError(f"unknown quantizer {quantizer!r}")


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


def _block_scales(x: F32, block_size: int) -> tuple[F32, F32]:
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size}")
    nblocks = -(-x.size // block_size)
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


def _unpack4(data: bytes, n: int) -> U8:
    packed = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(packed.size * 2, dtype=np.uint8)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return out[:n]
