"""How the synchronizer's process allocates memory (glibc's ``mallopt``, where the C library is
glibc; elsewhere nothing changes).

The synchronizer's large arrays (a fragment's parameters, momentum, a round's update) are made and
freed in worker threads. By default glibc gives each thread its own arena (up to 8 per core) and
keeps what a thread freed in that thread's arena, so a long-lived process grows to several times
the memory it uses at any moment; two arenas keep the reuse in a few places. Arrays above
``MMAP_THRESHOLD`` are always their own mapping, returned to the system when freed (glibc would
otherwise raise that threshold as large arrays are freed, up to 32 MiB, and keep such arrays in
the arenas).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

ARENAS = 2
MMAP_THRESHOLD = 4 << 20  # bytes
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

log = logging.getLogger(__name__)


def limit_heap() -> bool:
    """Set the arena count and the mapping threshold; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    done = bool(mallopt(_M_ARENA_MAX, ARENAS)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not done:
        log.warning("mallopt refused the heap settings: the default allocator settings stay")
    return done
