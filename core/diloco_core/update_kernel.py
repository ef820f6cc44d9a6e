"""The synchronizer's int2 download update (``downlink.publish``, the default download codec) in one
compiled pass over a tensor (``diloco_core.compiled``: compiled in the background, used once ready;
``publish`` runs its numpy code until then and where there is no compiler).

For each block of ``block_size`` values it makes what the numpy code makes over whole arrays, with
the same float32 operations in the same order, so the same bits: ``c = (merged - previous) +
residual``; the block's scale, its largest ``|c|`` (NaN with a NaN in the block, as numpy's ``max``);
each value's int2 code by ``quantize``'s rule (``y = c / s * 1.5`` against -1, 0 and 1, an exact zero
by its position's parity, a block of zeros with code 2, a block whose scale is not finite with code 2
and the canonical NaN scale); the decoded value ``d = level(code) * s``; the new residual ``c - d``
and the new version ``previous + d``. The codes are packed four to a byte, the first in the lowest
bits. The loop checks no bounds: :func:`downlink.publish` gives it arrays of the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from diloco_core.code_kernels import level
from diloco_core.compiled import Loop, read_only


def _int2_update(njit: Callable[..., Any]) -> Any:
    half, one = np.float32(1.5), np.float32(1)
    level_of = level(njit, "int2")

    @njit(boundscheck=False)
    def update(
        params: Any,
        rest: Any,
        codes: Any,
        scales: Any,
        previous: Any,
        merged: Any,
        residual: Any,
        with_residual: bool,
        block_size: int,
        nan: Any,
    ) -> None:
        # each step is a loop of its own without branches, which the compiler runs several values at
        # a time (a float32's magnitude orders as its bits do, so the largest is an integer maximum)
        n = previous.size
        c = np.empty(block_size, np.float32)
        bits = c.view(np.uint32)
        word = np.zeros(1, np.uint32)
        as_float = word.view(np.float32)
        code = np.zeros(block_size + 3, np.uint8)
        for block in range((n + block_size - 1) // block_size):
            start = block * block_size
            m = min(block_size, n - start)
            p = previous[start : start + m]
            if with_residual:
                r = residual[start : start + m]
                for i in range(m):
                    c[i] = (merged[start + i] - p[i]) + r[i]
            else:
                for i in range(m):
                    c[i] = merged[start + i] - p[i]
            largest = np.uint32(0)
            for i in range(m):
                b = bits[i] & np.uint32(0x7FFFFFFF)
                largest = b if b > largest else largest
            if largest < np.uint32(0x7F800000):  # no NaN and no infinity
                word[0] = largest
                s = as_float[0]
                safe = s if s > 0 else one
                zeros_up = s == 0  # a block of zeros takes code 2 throughout
                parity = start % 2
                for i in range(m):
                    y = (c[i] / safe) * half
                    k = (
                        np.uint8(y > -one)
                        + np.uint8(y > 0)
                        + np.uint8(y >= one)
                        + np.uint8((y == 0) & (((i + parity) % 2 == 1) | zeros_up))
                    )
                    code[i] = k
                    d = level_of(k, None) * s
                    rest[start + i] = c[i] - d
                    params[start + i] = p[i] + d
            else:
                s = nan
                d = level_of(2, None) * s  # code 2's value at the NaN scale
                for i in range(m):
                    code[i] = 2
                    rest[start + i] = c[i] - d
                    params[start + i] = p[i] + d
            scales[block] = s
            code[m] = code[m + 1] = code[m + 2] = 0
            if start % 4 == 0:
                first = start // 4
                for j in range((m + 3) // 4):
                    codes[first + j] |= (
                        code[4 * j] | (code[4 * j + 1] << 2) | (code[4 * j + 2] << 4) | (code[4 * j + 3] << 6)
                    )
            else:  # a block size that is not a multiple of 4: this block starts inside a byte
                for i in range(m):
                    codes[(start + i) // 4] |= code[i] << (2 * ((start + i) % 4))

    return update


def _sample() -> tuple[Any, ...]:
    def ro() -> Any:
        return read_only(np.zeros(8, np.float32))

    out = (np.zeros(8, np.float32), np.zeros(8, np.float32), np.zeros(2, np.uint8), np.zeros(1, np.float32))
    return (*out, ro(), ro(), ro(), True, 8, np.float32(np.nan))


INT2_UPDATE = Loop(key="int2-update", build=_int2_update, sample=_sample)
"""``(params, rest, codes, scales, previous, merged, residual, with_residual, block_size, nan)``: the
new version, new residual, packed codes (zeroed beforehand) and block scales of one tensor, from its
previous version, the merged values and the residual (read-only; any array when ``with_residual`` is
False), all flat float32 but the codes; ``nan``: the canonical NaN scale, as float32."""
