"""Compiled loops over the codes of a blocked low-bit tensor (``int8``, ``int4``, ``e3m0``, ``int2``,
``int1``): decoding it, adding it into a float32 array, and its sum of squares, each in one pass
over the codes and the output, without temporaries (numba, compiled on first use for each width of
code and each operation, and run without the GIL so that the event loop goes on meanwhile).

Each value is one float32 product of its level and its block's factor (then, when added with a
factor, one float32 product with that factor, then one float32 sum): the operations numpy applies
to whole arrays, in the same order, so the results are the same bit for bit. The compiled code
contracts no product and sum into one rounding (numba's default, ``fastmath`` off).

A block of any size is read: where a block starts or ends inside a byte (a block size that is not a
multiple of the values in a byte), those values are taken one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


def _compiled(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """numba's ``njit`` without the GIL, imported on the first kernel: a process that never reads
    codes does not load the compiler (about 0.2 s and 125 MB of resident memory)."""
    import numba

    return numba.njit(nogil=True, **options)  # type: ignore[no-any-return]


WRITE, ADD, ADD_SCALED = 0, 1, 2
"""What a decoding kernel does with each value ``v``: ``out = v``, ``out += v``, ``out += v * factor``."""


def _spans(bits: int) -> Callable[..., tuple[int, int, int]]:
    """For a block of values ``[start, end)``: the values before its first whole byte, the index
    of that byte and the number of whole bytes (the values after them are taken one by one)."""
    per = 8 // bits

    @_compiled(inline="always")
    def spans(start: int, end: int) -> tuple[int, int, int]:
        head = min((per - start % per) % per, end - start)
        return head, (start + head) // per, (end - start - head) // per

    return spans  # type: ignore[no-any-return]


@cache
def decoder(bits: int, mode: int) -> Callable[..., None]:
    """The kernel ``(out, factor, packed, factors, levels, block_size)`` for codes of ``bits`` bits:
    value ``i`` is ``levels[code_i] * factors[i // block_size]``, put into ``out[i]`` by ``mode``
    (``out``: the tensor's ``n`` float32 values, contiguous; ``levels``: the ``2**bits`` levels).
    The loops index with unsigned integers: numba then checks no index for a negative one."""
    per, mask, spans = 8 // bits, (1 << bits) - 1, _spans(bits)

    @_compiled(inline="always")
    def put(out: Any, i: Any, v: Any, factor: Any) -> None:
        if mode == WRITE:
            out[i] = v
        elif mode == ADD:
            out[i] += v
        else:
            out[i] += v * factor

    @_compiled(inline="always")
    def one_by_one(out: Any, factor: Any, packed: Any, s: Any, levels: Any, start: int, end: int) -> None:
        for i in range(start, end):
            put(
                out,
                np.uint64(i),
                levels[(packed[np.uint64(i // per)] >> (i % per * bits)) & mask] * s,
                factor,
            )

    @_compiled(boundscheck=False)
    def kernel(out: Any, factor: Any, packed: Any, f: Any, levels: Any, block_size: int) -> None:
        n = out.size
        for block in range((n + block_size - 1) // block_size):
            s = f[np.uint64(block)]
            start, end = block * block_size, min(block * block_size + block_size, n)
            head, first, whole = spans(start, end)
            one_by_one(out, factor, packed, s, levels, start, start + head)
            for j in range(whole):
                byte = packed[np.uint64(first + j)]
                o = np.uint64((first + j) * per)
                for k in range(per):
                    put(out, o + np.uint64(k), levels[(byte >> (k * bits)) & mask] * s, factor)
            one_by_one(out, factor, packed, s, levels, start + head + whole * per, end)

    return kernel  # type: ignore[no-any-return]


@cache
def squares(bits: int, square: Callable[[int], int]) -> Callable[..., float]:
    """The kernel ``(packed, scales, factors, constant, levels, n, block_size, safe)`` for codes of
    ``bits`` bits: the sum of squares of the decoded values in float64, ``inf`` when a scale is not
    finite. A block whose scale is at most ``safe`` is summed exactly from its codes (``square(code)``,
    a plain function, compiled with the kernel: the squared level times ``constant``, an integer), then multiplied by its
    scale squared; a larger scale could make ``level * scale`` overflow float32, so that block's
    values are decoded as float32 (``levels[code] * factors[block]``) and squared."""
    per, mask, spans = 8 // bits, (1 << bits) - 1, _spans(bits)
    square = _compiled(inline="always")(square)

    @_compiled(inline="always")
    def code(packed: Any, i: int) -> int:
        return (packed[np.uint64(i // per)] >> (i % per * bits)) & mask  # type: ignore[no-any-return]

    @_compiled(boundscheck=False)
    def kernel(
        packed: Any, s: Any, f: Any, constant: float, levels: Any, n: int, block_size: int, safe: float
    ) -> float:
        exact = 0.0  # times constant
        decoded = 0.0
        for block in range((n + block_size - 1) // block_size):
            scale = s[np.uint64(block)]
            if not np.isfinite(scale):
                return np.inf
            start, end = block * block_size, min(block * block_size + block_size, n)
            if abs(scale) > safe:
                for i in range(start, end):
                    v = np.float64(levels[code(packed, i)] * f[np.uint64(block)])
                    decoded += v * v
                continue
            head, first, whole = spans(start, end)
            total = 0
            for i in range(start, start + head):
                total += square(code(packed, i))
            for j in range(whole):
                byte = packed[np.uint64(first + j)]
                for k in range(per):
                    total += square((byte >> (k * bits)) & mask)
            for i in range(start + head + whole * per, end):
                total += square(code(packed, i))
            exact += np.float64(total) * (np.float64(scale) * np.float64(scale))
        return exact / constant + decoded

    return kernel  # type: ignore[no-any-return]


@cache
def array_squares() -> Callable[[Any], float]:
    """The kernel ``(x)``: the sum of squares of a contiguous one-dimensional array's values in
    float64, in eight running sums (values ``i`` with the same ``i % 8``) that are then added
    pairwise: the compiled loop keeps eight additions in flight instead of waiting on each."""
    return _compiled(boundscheck=False)(_array_squares)  # type: ignore[no-any-return]


def _array_squares(x: Any) -> float:
    n = x.size
    whole = n // 8 * 8
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    for i in range(0, whole, 8):
        j = np.uint64(i)
        v0, v1, v2, v3 = np.float64(x[j]), np.float64(x[j + 1]), np.float64(x[j + 2]), np.float64(x[j + 3])
        v4, v5, v6, v7 = (
            np.float64(x[j + 4]),
            np.float64(x[j + 5]),
            np.float64(x[j + 6]),
            np.float64(x[j + 7]),
        )
        s0 += v0 * v0
        s1 += v1 * v1
        s2 += v2 * v2
        s3 += v3 * v3
        s4 += v4 * v4
        s5 += v5 * v5
        s6 += v6 * v6
        s7 += v7 * v7
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for i in range(whole, n):
        v = np.float64(x[np.uint64(i)])
        total += v * v
    return total
