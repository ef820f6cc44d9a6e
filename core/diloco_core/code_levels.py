"""Decoding the blocked low-bit formats (``int8``, ``int4``, ``e3m0``, ``int2``, ``int1``).

Each code is looked up in a table of the levels (for a block scale of 1), then multiplied by its
block's factor. The result is bit for bit that
of each format's formula applied value by value (``levels``, with every block's scale repeated
over its values): a level is the same float32 whichever way it is made, and each value is one
float32 product of its level and its block's factor. The output is the only array the size of the
tensor: no per-value copy of the scales and no temporaries, which a large fragment would otherwise
make several times over (freshly allocated memory is the slow part of a decode). The loops are
compiled (``code_kernels``).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import numpy.typing as npt

from diloco_core import code_kernels

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

BITS = {"int8": 8, "int4": 4, "e3m0": 4, "int2": 2, "int1": 1}

# value of each 4-bit code for a block scale of 1
INT4_LEVELS: F32 = ((np.arange(16, dtype=np.float32) - 8) / np.float32(7)).astype(np.float32)
E3M0_LEVELS: F32 = np.array(
    [(-1.0 if c & 8 else 1.0) * (2.0 ** ((c & 7) - 7) if c & 7 else 0.0) for c in range(16)], dtype=np.float32
)


def levels(quantizer: str, codes: U8) -> F32:
    """The level of each code for a block scale of 1, by each format's formula
    (docs/algorithm.md §3.9); ``int8``'s level is its code, its factor ``scale / 127``."""
    if quantizer == "int8":
        return codes.view(np.int8).astype(np.float32)
    if quantizer == "int4":
        return INT4_LEVELS[codes]
    if quantizer == "e3m0":
        return E3M0_LEVELS[codes]
    if quantizer == "int2":
        return (codes.astype(np.float32) * np.float32(2) - np.float32(3)) / np.float32(3)
    if quantizer == "int1":
        return np.where(codes == 1, np.float32(-1), np.float32(1)).astype(np.float32)
    raise ValueError(f"not a blocked quantizer with codes: {quantizer!r}")


def factors(quantizer: str, scales: F32) -> F32:
    """What each block's levels are multiplied by: its scale (``scale / 127`` for ``int8``)."""
    return scales / np.float32(127) if quantizer == "int8" else scales


@cache
def level_table(quantizer: str) -> F32:
    """The level of each of the ``2**bits`` codes for a block scale of 1 (``levels`` of every code)."""
    return levels(quantizer, np.arange(1 << BITS[quantizer], dtype=np.uint8))


def decode(values: bytes | memoryview, scales: F32, quantizer: str, n: int, block_size: int) -> F32:
    """The ``n`` float32 values of ``quantizer``'s codes ``values`` in blocks of ``block_size`` with
    ``scales`` (one per block, the last block possibly partial); the byte lengths must already have
    been checked."""
    out = np.empty(n, dtype=np.float32)
    _run(code_kernels.WRITE, out, _ONE, values, scales, quantizer, block_size)
    return out


def add_decoded(
    acc: F32,
    factor: np.float32,
    values: bytes | memoryview,
    scales: F32,
    quantizer: str,
    n: int,
    block_size: int,
) -> None:
    """``acc += decode(...) * factor``, each product rounded to float32 and then added, bit for bit
    as those two operations on whole arrays give it, in one pass: no array the size of the tensor is
    made (``acc``: ``n`` contiguous float32 values)."""
    mode = code_kernels.ADD if factor == 1 else code_kernels.ADD_SCALED  # a product with 1 is the value
    _run(mode, acc[:n], np.float32(factor), values, scales, quantizer, block_size)


_ONE = np.float32(1)


def _run(
    mode: int,
    out: F32,
    factor: np.float32,
    values: bytes | memoryview,
    scales: F32,
    quantizer: str,
    block_size: int,
) -> None:
    if not out.flags.c_contiguous:
        raise ValueError("the values are decoded into a contiguous float32 array")
    bits = BITS[quantizer]
    packed = np.frombuffer(values, dtype=np.uint8)
    f = np.ascontiguousarray(factors(quantizer, scales), dtype=np.float32)
    if packed.size * 8 < out.size * bits or f.size * block_size < out.size:  # the loops check no bounds
        raise ValueError(
            f"{out.size} values need more codes or scales than the {packed.size} and {f.size} given"
        )
    kernel = code_kernels.decoder(bits, mode)
    kernel(out, factor, packed, f, level_table(quantizer), block_size)
