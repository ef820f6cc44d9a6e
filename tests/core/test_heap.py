"""The synchronizer's and the learner's allocator settings take effect where the C library is glibc."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
from diloco_core.heap import limit_heap


def test_the_heap_settings_are_taken_on_glibc() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "gnu_get_libc_version"):
        pytest.skip("the C library is not glibc: the settings do not apply")
    assert limit_heap() is True
