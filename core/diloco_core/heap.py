"""How the synchronizer's and the learner's processes allocate memory (glibc's ``mallopt``, where
the C library is glibc; elsewhere nothing changes).

Their large arrays (a fragment's parameters, momentum, a round's update, a payload being checked;
a learner's outer gradients, residuals and the global versions it takes) are made and freed in
several threads. By default glibc gives each thread its own arena (up to 8 per core) and keeps what
a thread freed in that thread's arena, so a long-lived process grows to several times the memory it
uses at any moment; ``ARENAS`` arenas keep the reuse in a few places.

The synchronizer makes the same large arrays every round. glibc maps each block above its mmap
threshold (at most 32 MiB by default) afresh and unmaps it when freed, so every round pays the kernel
to fault in and zero its arrays again: on this project's VMs decoding 50 M int4 values into a fresh
array took 0.46 s, 0.39 s of it system time, against 0.08 s into pages already faulted in. With
``reuse_large`` every thread allocates from the main heap (one arena: the only one that grows past
64 MiB without mapping), blocks up to ``REUSED_BLOCK`` bytes come from it, and freed memory stays in
it, however much of it is free at its top (``NEVER_TRIM``): the next round's arrays take the pages
the last round freed. With a bound on what the top may keep instead (at most ``REUSED_BLOCK``), a
billion-parameter model's rounds, whose freed arrays reach 2.5 GB, gave the top back and faulted it
in again every round: a quarter of the synchronizer's CPU went to the kernel's zeroing of pages
(docs/benchmarks.md). Between rounds the process keeps its peak instead of giving
it back, and the peak itself rises, since a block left between freed ones keeps a larger one from
their pages (measured: 3.4x → 3.5x the fp32 model at 1 B parameters, 3.8x → 4.3-4.5x at 200 M). A
glibc that refuses the thresholds (older ones cap the mmap threshold at 32 MiB) keeps ``ARENAS``
arenas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

ARENAS = 2
REUSED_BLOCK = (1 << 31) - 1  # the largest value mallopt takes (a C int)
NEVER_TRIM = -1  # glibc: a trim threshold of -1 keeps every freed page in the heap
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
    if reuse_large:  # the thresholds first: one arena without them would only add contention
        if mallopt(_M_MMAP_THRESHOLD, REUSED_BLOCK) and mallopt(_M_TRIM_THRESHOLD, NEVER_TRIM):
            return _arenas(mallopt, 1)
        log.warning("mallopt refused to keep blocks of %d bytes: %d arenas instead", REUSED_BLOCK, ARENAS)
        _arenas(mallopt, ARENAS)
        return False
    return _arenas(mallopt, ARENAS)


def _arenas(mallopt: Callable[[int, int], int], count: int) -> bool:
    if not mallopt(_M_ARENA_MAX, count):
        log.warning("mallopt refused %d arenas: the allocator's default stays", count)
        return False
    return True
