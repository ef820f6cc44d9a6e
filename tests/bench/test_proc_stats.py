"""What /proc says of a process: CPU seconds that grow with work, a peak resident size."""

from __future__ import annotations

import os

from diloco_bench.proc_stats import cpu_seconds, peak_rss_bytes, rss_bytes, system_seconds


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
    peak, now = peak_rss_bytes(pid), rss_bytes(pid)
    assert peak is not None
    assert now is not None
    assert peak >= now >= len(block)


def test_system_seconds_grow_with_the_kernels_work_and_are_part_of_the_cpu_seconds() -> None:
    pid = os.getpid()
    before = system_seconds(pid)
    assert before is not None
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        while (system_seconds(pid) or 0.0) - before < 0.05:  # reads the kernel fills
            os.read(fd, 1 << 20)
    finally:
        os.close(fd)
    system, total = system_seconds(pid), cpu_seconds(pid)
    assert system is not None
    assert total is not None
    assert system <= total


def test_a_process_that_is_gone_reads_as_none() -> None:
    assert cpu_seconds(2**22 + 12345) is None
    assert peak_rss_bytes(2**22 + 12345) is None
    assert rss_bytes(2**22 + 12345) is None
    assert system_seconds(2**22 + 12345) is None
