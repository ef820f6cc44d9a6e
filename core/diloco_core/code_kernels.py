"""Compiled loops over the codes of a blocked low-bit tensor (``int8``, ``int4``, ``e3m0``, ``int2``,
``int1``): decoding it into a float32 array, or adding it (times a factor) into one, in one pass over
the codes and the output without temporaries (``diloco_core.compiled``: compiled in the background,
used once ready; ``code_levels`` runs its numpy code until then and where there is no compiler).

Each value is one float32 product of its level and its block's factor (then, when added with a
factor, one float32 product with that factor, then one float32 sum): the operations
``code_levels``' numpy code applies, in the same order, so the results are the same bit for bit.

A block of any size is read: where a block starts or ends inside a byte (a block size that is not a
multiple of the values in a byte), those values are taken one by one. The loops check no bounds
and index with unsigned integers (numba then checks no index for a negative value): the caller
gives codes and scales enough for the values (``code_levels`` checks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from diloco_core.compiled import Loop, read_only

WRITE, ADD, ADD_SCALED = 0, 1, 2
"""What a decoding loop does with each value ``v``: ``out = v``, ``out += v``, ``out += v * factor``."""


def decoder(quantizer: str, bits: int, mode: int) -> Loop:
    """The loop ``(out, factor, packed, factors, levels, block_size)`` for ``quantizer``'s codes of
    ``bits`` bits:
    value ``i`` is ``level(code_i) * factors[i // block_size]``, put into ``out[i]`` by ``mode``
    (``out``: the tensor's ``n`` float32 values, contiguous; ``factor``: float32; ``packed``: the
    codes as read-only uint8; ``factors``: float32; ``levels``: the float32 level of each code,
    ``code_levels.level_table``, which the loop reads for ``e3m0`` and computes for the others by the
    format's formula in float32, the same values, so that the loop has no lookup to wait on)."""
    return Loop(
        key=("codes", quantizer, mode),
        build=lambda njit: _decoder(njit, quantizer, bits, mode),
        sample=lambda: _decoder_sample(bits),
    )


def _decoder_sample(bits: int) -> tuple[Any, ...]:
    return (
        np.zeros(16, np.float32),
        np.float32(1),
        read_only(np.zeros(16, np.uint8)),
        np.ones(2, np.float32),
        np.zeros(1 << bits, np.float32),
        8,
    )


def level(njit: Callable[..., Any], quantizer: str) -> Any:
    """``level(code, levels)``, compiled inline: the float32 level of a code, as
    ``code_levels.levels`` makes it (``levels``, the table, is read for ``e3m0`` only)."""
    two, three, seven, eight = np.float32(2), np.float32(3), np.float32(7), np.float32(8)
    one, minus_one = np.float32(1), np.float32(-1)

    def int8(c: Any, levels: Any) -> Any:
        return np.float32(np.int8(c))

    def int4(c: Any, levels: Any) -> Any:
        return (np.float32(c) - eight) / seven

    def int2(c: Any, levels: Any) -> Any:
        return (np.float32(c) * two - three) / three

    def int1(c: Any, levels: Any) -> Any:
        return minus_one if c == 1 else one

    def table(c: Any, levels: Any) -> Any:
        return levels[c]

    formula = {"int8": int8, "int4": int4, "int2": int2, "int1": int1, "e3m0": table}[quantizer]
    return njit(inline="always")(formula)


def _decoder(njit: Callable[..., Any], quantizer: str, bits: int, mode: int) -> Any:
    per, mask = 8 // bits, (1 << bits) - 1
    level_of = level(njit, quantizer)

    @njit(inline="always")
    def spans(start: int, end: int) -> tuple[int, int, int]:
        """For a block of values ``[start, end)``: the values before its first whole byte, the index
        of that byte and the number of whole bytes (the values after them are taken one by one)."""
        head = min((per - start % per) % per, end - start)
        return head, (start + head) // per, (end - start - head) // per

    @njit(inline="always")
    def put(out: Any, i: Any, v: Any, factor: Any) -> None:
        if mode == WRITE:
            out[i] = v
        elif mode == ADD:
            out[i] += v
        else:
            out[i] += v * factor

    @njit(inline="always")
    def one_by_one(out: Any, factor: Any, packed: Any, s: Any, levels: Any, start: int, end: int) -> None:
        for i in range(start, end):
            code = (packed[np.uint64(i // per)] >> (i % per * bits)) & mask
            put(out, np.uint64(i), level_of(code, levels) * s, factor)

    @njit(boundscheck=False)
    def kernel(out: Any, factor: Any, packed: Any, f: Any, levels: Any, block_size: int) -> None:
        n = out.size
        for block in range((n + block_size - 1) // block_size):
            s = f[np.uint64(block)]
            start, end = block * block_size, min(block * block_size + block_size, n)
            head, first, whole = spans(start, end)
            one_by_one(out, factor, packed, s, levels, start, start + head)
            o = out[(start + head) : (start + head) + whole * per]
            p = packed[first : first + whole]
            for j in range(whole):
                byte = p[j]
                for k in range(per):
                    put(o, j * per + k, level_of((byte >> (k * bits)) & mask, levels) * s, factor)
            one_by_one(out, factor, packed, s, levels, start + head + whole * per, end)

    return kernel
