"""The compiled loop of the ``fp32-planes`` layout (``diloco_core.byte_planes``): byte planes joined
back into float32 words in one pass, each word from its four bytes by integer shifts (``diloco_core.
compiled``: compiled in the background, used once ready; ``byte_planes.decode`` runs its numpy code,
a strided copy per plane, until then and where there is no compiler). The same bytes as the numpy
code. The loop checks no bounds: ``byte_planes.decode`` gives it ``4 * n`` bytes for ``n`` words.

The split the other way (``byte_planes.Planes.runs``) stays in numpy: compiled, it took 26-39 ms
against numpy's 26-34 for 50 M values (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from diloco_core.compiled import Loop, read_only


def _join(njit: Callable[..., Any]) -> Any:
    @njit(boundscheck=False)
    def join(words: Any, packed: Any, run: int) -> None:
        n = words.size
        for start in range(0, n, run):
            m = min(run, n - start)
            b3 = packed[4 * start : 4 * start + m]
            b2 = packed[4 * start + m : 4 * start + 2 * m]
            b1 = packed[4 * start + 2 * m : 4 * start + 3 * m]
            b0 = packed[4 * start + 3 * m : 4 * start + 4 * m]
            out = words[start : start + m]
            for i in range(m):
                out[i] = (
                    (np.uint32(b3[i]) << np.uint32(24))
                    | (np.uint32(b2[i]) << np.uint32(16))
                    | (np.uint32(b1[i]) << np.uint32(8))
                    | np.uint32(b0[i])
                )

    return join


JOIN = Loop(
    key="planes-join",
    build=_join,
    sample=lambda: (np.zeros(2, np.uint32), read_only(np.zeros(8, np.uint8)), 4),
)
"""``(words, packed, run)``: the ``n`` words (uint32) from ``4 * n`` bytes of planes (read-only uint8)
in runs of ``run`` values, the last holding the rest."""
