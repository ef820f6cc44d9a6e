"""The sum of squares of a quantized tensor computed from its codes, without decoding it.

A blocked quantizer's value is ``level[code] * scale``, so a block's sum of squares is
``scale**2 * sum(level[code]**2)``. Each quantizer's squared levels are integers once multiplied by
a constant (``_SQUARED_LEVELS``), so each block's codes are summed exactly as integers, then
multiplied by the block's scale squared in float64, in one compiled pass over the codes
(``code_kernels.squares``). An int4 tensor is read several times faster than by decoding it and
summing the squares of its float32 values (docs/benchmarks.md), and the result differs from that sum
only by their rounding.

The sum is ``inf`` exactly when a decoded value would not be finite: a block whose scale is not finite
decodes to NaN, and a block whose scale is large enough for ``level * scale`` to overflow float32 is
decoded to float32 and squared. The formats without codes (fp32, fp16, bf16) and topk are decoded
and summed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt

from diloco_core import code_kernels, code_levels
from diloco_core import quantize as q

_BITS = {"int8": 8, "int4": 4, "e3m0": 4, "int2": 2, "int1": 1}


def _int8_square(c: int) -> int:
    v = c - 256 if c > 127 else c  # the code is a signed byte; value v * s / 127
    return v * v


def _int4_square(c: int) -> int:
    return (c - 8) * (c - 8)  # level (c - 8) / 7


def _e3m0_square(c: int) -> int:
    # level 2**((c & 7) - 7) (0 for c & 7 == 0): its square times 2**12 is 2**(2 * (c & 7) - 2)
    return (1 << (2 * (c & 7) - 2)) if c & 7 else 0


def _int2_square(c: int) -> int:
    return (2 * c - 3) * (2 * c - 3)  # level (2c - 3) / 3


def _int1_square(c: int) -> int:
    return 1  # level -1 or 1


# per quantizer: the squared level of a code times a constant (an integer), and that constant
_SQUARED_LEVELS = {
    "int8": (_int8_square, 127.0**2),
    "int4": (_int4_square, 49.0),
    "e3m0": (_e3m0_square, 2.0**12),
    "int2": (_int2_square, 9.0),
    "int1": (_int1_square, 1.0),
}
_SAFE_SCALE = float(np.finfo(np.float32).max) / 2  # no level exceeds 128 / 127 < 2 in magnitude


def array_sum_squares(x: npt.NDArray[np.floating]) -> float:
    """The sum of squares of an array's values in float64 (``inf`` or NaN when one is not finite), in
    one compiled pass (``code_kernels.array_squares``; no BLAS, whose waiting threads would spin on
    cores the service's threads need)."""
    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.dtype not in (np.float32, np.float64):  # each compiled once, for these two
        flat = flat.astype(np.float64)
    return float(code_kernels.array_squares()(flat))


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
    if quantizer not in _BITS:
        return _decoded_sum_squares(values, scales, quantizer, n, block_size)
    bits = _BITS[quantizer]
    packed = np.frombuffer(values, dtype=np.uint8)
    s = np.frombuffer(scales, dtype="<f4")
    if packed.size * 8 < n * bits or s.size * block_size < n:  # the loop checks no bounds
        raise ValueError(f"{n} values need more codes or scales than the {packed.size} and {s.size} given")
    square, constant = _SQUARED_LEVELS[quantizer]
    f = np.ascontiguousarray(code_levels.factors(quantizer, s), dtype=np.float32)
    kernel = code_kernels.squares(bits, square)
    return float(
        kernel(packed, s, f, constant, code_levels.level_table(quantizer), n, block_size, _SAFE_SCALE)
    )
