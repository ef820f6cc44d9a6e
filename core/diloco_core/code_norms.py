"""The sum of squares of a quantized tensor computed from its codes, without decoding it.

A blocked quantizer's value is ``level[code] * scale``, so a block's sum of squares is
``scale**2 * sum(level[code]**2)``. Each quantizer's squared levels are integers once multiplied by
a constant (``_SQUARED_LEVELS``), so the codes are summed exactly: sixteen bits of codes at a time
through a table of 65,536 small integers, then block by block in float64 with the scales. An int4
tensor is read several times faster than by decoding it and summing the squares of its float32
values (docs/benchmarks.md), and the result differs from that sum only by their rounding.

The sum is ``inf`` exactly when a decoded value would not be finite: a block whose scale is not finite
decodes to NaN. A payload with a scale large enough for ``level * scale`` to overflow float32, the
formats without codes (fp32, fp16, bf16), topk, a block size that does not hold whole 16-bit words of
codes, and the values after the last whole block are decoded and summed as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from functools import cache

import numpy as np
import numpy.typing as npt

from diloco_core import quantize as q
from diloco_core.code_levels import BITS as _BITS


def _int8_squares(c: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return (c.astype(np.uint8).view(np.int8).astype(np.int64)) ** 2  # value q * s / 127


def _e3m0_squares(c: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    # level 2**((c & 7) - 7) (0 for c & 7 == 0): its square times 2**12 is 2**(2 * (c & 7) - 2)
    return np.where(c & 7, np.left_shift(1, np.maximum(2 * (c & 7) - 2, 0)), 0)


# per quantizer: the squared level of each code times a constant, and that constant
_SQUARED_LEVELS = {
    "int8": (_int8_squares, 127.0**2),
    "int4": (lambda c: (c - 8) ** 2, 49.0),  # level (c - 8) / 7
    "e3m0": (_e3m0_squares, 2.0**12),
    "int2": (lambda c: (2 * c - 3) ** 2, 9.0),  # level (2c - 3) / 3
    "int1": (lambda c: np.ones_like(c), 1.0),  # level -1 or 1
}
_WORDS_AT_ONCE = 1 << 16  # 16-bit words of codes looked up at a time (rounded to whole blocks)
_SAFE_SCALE = float(np.finfo(np.float32).max) / 2  # no level exceeds 128 / 127 < 2 in magnitude


@cache
def _word_table(quantizer: str) -> tuple[npt.NDArray[np.uint16], float]:
    """The sum of the squared levels (times the quantizer's constant) of the codes in each 16-bit
    word, and the constant."""
    squares, constant = _SQUARED_LEVELS[quantizer]
    bits = _BITS[quantizer]
    words = np.arange(1 << 16, dtype=np.int64)
    per_code = squares(np.arange(1 << bits, dtype=np.int64))
    total = sum(per_code[(words >> (i * bits)) & ((1 << bits) - 1)] for i in range(16 // bits))
    assert int(np.max(total)) < (1 << 16)
    return np.asarray(total, dtype=np.uint16), constant


_CHUNK = 1 << 16  # values widened to float64 at a time


def array_sum_squares(x: npt.NDArray[np.floating]) -> float:
    """The sum of squares of an array's values in float64 (``inf`` or NaN when one is not finite),
    widened a chunk at a time into one scratch. ``einsum``, not ``dot``: BLAS would hand each chunk to its thread
    pool, whose waiting threads spin on cores the service's threads need."""
    flat = np.asarray(x).reshape(-1)
    wide = np.empty(min(_CHUNK, flat.size), dtype=np.float64)  # one scratch, not an array a chunk
    total = 0.0
    for start in range(0, flat.size, _CHUNK):
        chunk = wide[: min(_CHUNK, flat.size - start)]
        np.copyto(chunk, flat[start : start + _CHUNK], casting="unsafe")
        total += float(np.einsum("i,i->", chunk, chunk))
    return total


def norm_of_sums(sums: Iterable[float]) -> float:
    """The Euclidean norm from tensors' sums of squares, added in the order given (inf when the
    total is not finite): every norm of named tensors is this of their sums in name order."""
    total = sum(sums)
    return math.sqrt(total) if math.isfinite(total) else math.inf


def arrays_norm(tensors: Mapping[str, npt.NDArray[np.floating]]) -> float:
    """The Euclidean norm of named arrays together, in float64 (inf when a value is not finite)."""
    return norm_of_sums(array_sum_squares(np.asarray(tensors[name])) for name in sorted(tensors))


def _decoded_sum_squares(
    values: bytes | memoryview, scales: bytes | memoryview, quantizer: str, n: int, block_size: int
) -> float:
    return array_sum_squares(q.dequantize(values, scales, quantizer, n, block_size))


def sum_squares(
    values: bytes | memoryview, scales: bytes | memoryview, quantizer: str, n: int, block_size: int
) -> float:
    """The sum of squares of ``q.dequantize(values, scales, quantizer, n, block_size)`` in float64
    (``inf`` when a value is not finite); the byte lengths must already have been checked."""
    per_word = 16 // _BITS.get(quantizer, 16)
    if quantizer not in _BITS or block_size % per_word:
        return _decoded_sum_squares(values, scales, quantizer, n, block_size)
    s = np.frombuffer(scales, dtype="<f4")
    if s.size and not np.isfinite(s).all():
        return math.inf
    if s.size and float(np.max(np.abs(s))) > _SAFE_SCALE:
        return _decoded_sum_squares(values, scales, quantizer, n, block_size)
    whole = n // block_size
    words_per_block = block_size // per_word
    table, constant = _word_table(quantizer)
    # a block's sum in 32 bits where it fits (int4 at any block size; int8 up to 2**17 values)
    wide = np.uint32 if int(table.max()) * words_per_block < (1 << 32) else np.uint64
    packed = np.frombuffer(values, dtype="<u2", count=whole * words_per_block)
    squared_scales = s[:whole].astype(np.float64) ** 2
    blocks_at_once = max(1, _WORDS_AT_ONCE // words_per_block)
    looked_up = np.empty(blocks_at_once * words_per_block, dtype=np.uint16)
    starts = np.arange(0, blocks_at_once * words_per_block, words_per_block)
    total = 0.0
    for first in range(0, whole, blocks_at_once):
        k = min(blocks_at_once, whole - first)
        codes = looked_up[: k * words_per_block]
        # every word indexes the table (65,536 entries): "clip" skips the bounds check
        words = packed[first * words_per_block : (first + k) * words_per_block]
        np.take(table, words, out=codes, mode="clip")
        per_block = np.add.reduceat(codes, starts[:k], dtype=wide).astype(np.float64)
        total += float(np.einsum("i,i->", per_block, squared_scales[first : first + k]))
    total /= constant
    if whole * block_size < n:  # the last, partial block
        offset = whole * words_per_block * 2
        total += _decoded_sum_squares(
            memoryview(values)[offset:],
            memoryview(scales)[4 * whole :],
            quantizer,
            n - whole * block_size,
            block_size,
        )
    return total
