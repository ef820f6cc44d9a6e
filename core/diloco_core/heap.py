"""How the synchronizer's and the learner's processes allocate memory (glibc's ``mallopt``, where
the C library is glibc; elsewhere nothing changes).

Their large arrays (a fragment's parameters, momentum, a round's update, a payload being checked;
a learner's outer gradients, residuals and the global versions it takes) are made and freed in
several threads. By default glibc gives each thread its own arena (up to 8 per core) and keeps what
a thread freed in that thread's arena, so a long-lived process grows to several times the memory it
uses at any moment; ``ARENAS`` arenas keep the reuse in a few places.

The synchronizer makes the same large arrays every round. glibc maps each block above its mmap
threshold (at most 32 MiB by default) afresh and unmaps it when freed, so every round pays the kernel
to fault in and zero its arrays again: on a busy machine up to 2 ns per byte, as much as decoding
them. With ``reuse_large`` every thread allocates from the main heap (one arena: the only one that
grows past 64 MiB without mapping), blocks up to ``REUSED_BLOCK`` bytes come from it, and freed
memory stays in it up to ``REUSED_BLOCK`` bytes at its top: the next round's arrays take the pages
the last round freed. The process's peak is unchanged (the same arrays are alive at once); between
rounds it keeps that peak instead of giving it back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

ARENAS = 2
REUSED_BLOCK = (1 << 31) - 1  # the largest value mallopt takes (a C int)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8

log = logging.getLogger(__name__)


def limit_heap(*, reuse_large: bool = False) -> bool:
    """Set the arena count (one with ``reuse_large``, and the thresholds above); False where the C
    library is not glibc or refuses a setting."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    settings = {_M_ARENA_MAX: ARENAS}
    if reuse_large:
        settings = {_M_ARENA_MAX: 1, _M_MMAP_THRESHOLD: REUSED_BLOCK, _M_TRIM_THRESHOLD: REUSED_BLOCK}
    for option, value in settings.items():
        if not mallopt(option, value):
            log.warning("mallopt refused %d for option %d: the allocator's default stays", value, option)
            return False
    return True
