"""Loops compiled to machine code (numba), for the few places where numpy would make several passes
or temporaries over an array the size of a model's fragment.

numba is imported on the first compilation: a process that never runs such a loop does not load the
compiler (about 0.2 s and 125 MB of resident memory). Each loop is compiled in each process on
first use (a fraction of a second; nothing is cached on disk, so a read-only image works as it is)
and runs without the GIL, so the event loop and other threads go on meanwhile. Floating-point
arithmetic is not reordered or contracted (``fastmath`` off): a compiled loop rounds as numpy does
when it applies the same operations in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """numba's ``njit`` without the GIL and with ``options``."""
    import numba

    return numba.njit(nogil=True, **options)  # type: ignore[no-any-return]
