"""How the synchronizer's and the learner's processes allocate memory (glibc's ``mallopt``, where
the C library is glibc; elsewhere nothing changes).

Their large arrays (a fragment's parameters, momentum, a round's update, a payload being checked;
a learner's outer gradients, residuals and the global versions it takes) are made and freed in
several threads. By default glibc gives each thread its own arena (up to 8 per core) and keeps what
a thread freed in that thread's arena, so a long-lived process grows to several times the memory it
uses at any moment; ``ARENAS`` arenas keep the reuse in a few places.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

ARENAS = 2
_M_ARENA_MAX = -8

log = logging.getLogger(__name__)


def limit_heap() -> bool:
    """Set the arena count; False where the C library is not glibc or refuses it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    if not mallopt(_M_ARENA_MAX, ARENAS):
        log.warning("mallopt refused %d arenas: the allocator's default stays", ARENAS)
        return False
    return True
