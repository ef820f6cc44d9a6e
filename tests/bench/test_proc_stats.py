"""What /proc says of a process: CPU seconds that grow with work, a peak resident size."""

from __future__ import annotations

import os

from diloco_bench.proc_stats import cpu_seconds, cpu_times, peak_rss_bytes, rss_bytes


def test_cpu_seconds_grow_with_work_and_the_peak_rss_holds_an_allocation() -> None:
    pid = os.getpid()
    before = cpu_seconds(pid)
    assert before is not None
    total = 0
    while (cpu_seconds(pid) or 0.0) - before < 0.05:  # spin until the kernel has counted 50 ms
        total += sum(range(10_000))
    assert total > 0
    block = bytearray(64 * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    now = rss_bytes(pid)  # first: the process may grow a page before the peak is read
    peak = peak_rss_bytes(pid)
    assert peak is not None
    assert now is not None
    assert peak >= now >= len(block)


def test_system_seconds_grow_with_the_kernels_work_and_are_part_of_the_cpu_seconds() -> None:
    pid = os.getpid()
    before = cpu_times(pid)
    assert before is not None
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        while (after := cpu_times(pid)) is not None and after.system - before.system < 0.05:
            os.read(fd, 1 << 20)  # reads the kernel fills
    finally:
        os.close(fd)
    assert after is not None
    assert after.system <= after.total
    assert after.total <= (cpu_seconds(pid) or 0.0)  # read later: all of it, and no less


def test_a_process_that_is_gone_reads_as_none() -> None:
    assert cpu_seconds(2**22 + 12345) is None
    assert peak_rss_bytes(2**22 + 12345) is None
    assert rss_bytes(2**22 + 12345) is None
    assert cpu_times(2**22 + 12345) is None
