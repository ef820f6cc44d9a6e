"""The synchronizer's and the learner's allocator settings take effect where the C library is glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys

import pytest
from diloco_core.heap import limit_heap

# In a process of its own (the settings are the whole process's): a thread makes and frees arrays of
# the given sizes twice, as a round's arrays are made every round; how many pages each making faulted in.
_TWICE = """
import json, resource, sys, threading
import numpy as np
from diloco_core.heap import limit_heap
taken = limit_heap(reuse_large=sys.argv[1] == "reuse")
sizes = [int(n) for n in sys.argv[2:]]
faults = []
def make():
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        arrays = [np.ones(n, dtype=np.uint8) for n in sizes]
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        del arrays
t = threading.Thread(target=make)
t.start()
t.join()
print(json.dumps({"taken": taken, "faults": faults}))
"""


def _glibc() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "gnu_get_libc_version"):
        pytest.skip("the C library is not glibc: the settings do not apply")


def _faults(mode: str, *sizes: int) -> list[int]:
    args = [sys.executable, "-c", _TWICE, mode, *map(str, sizes)]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    if not result["taken"]:
        pytest.skip("this glibc refuses the settings (older ones cap the mmap threshold at 32 MiB)")
    return list(result["faults"])


def test_the_heap_settings_are_taken_on_glibc() -> None:
    _glibc()
    assert limit_heap() is True


def test_reusing_large_blocks_makes_a_threads_second_large_array_in_the_pages_of_its_first() -> None:
    _glibc()
    # 128 MiB is at least 64 faults of 2 MiB pages (32,768 of 4 KiB pages), whichever the kernel gives
    first, second = _faults("reuse", 128 << 20)
    assert first >= 64
    assert second <= 16, (first, second)
    # without it, each large array is mapped afresh and faulted in again
    first, second = _faults("default", 128 << 20)
    assert min(first, second) >= 32, (first, second)


@pytest.mark.integration  # 2.5 GiB of memory faulted in
def test_more_than_two_gib_freed_at_the_heaps_top_is_kept_for_the_next_round() -> None:
    # a billion-parameter fragment's round frees arrays of 1 GB and more at once: with a bound on
    # what the heap's top keeps (the largest mallopt takes is 2 GiB), glibc gave it back every round
    _glibc()
    first, second = _faults("reuse", 1280 << 20, 1280 << 20)
    assert first >= 1280  # 2.5 GiB in pages of 2 MiB at most
    assert second <= 16, (first, second)
