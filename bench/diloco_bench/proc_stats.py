"""What the kernel says of a running process (Linux ``/proc``): its CPU seconds so far and its peak
resident memory, for benchmarks that measure a server they started."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, TypeVar

T = TypeVar("T", int, float)

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class CpuTimes(NamedTuple):
    """A process's CPU seconds so far: in its own code, and the kernel's for it (system time)."""

    user: float
    system: float

    @property
    def total(self) -> float:
        return self.user + self.system


def cpu_times(pid: int) -> CpuTimes | None:
    """User and system CPU seconds of ``pid`` (its threads included), read at one moment, or None
    when unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)"; fields 14 and 15 are utime, stime
    return CpuTimes(int(fields[11]) / _TICKS, int(fields[12]) / _TICKS)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (its threads included), or None when unreadable."""
    times = cpu_times(pid)
    return None if times is None else times.total


def peak_rss_bytes(pid: int) -> int | None:
    """The most resident memory ``pid`` has held (``VmHWM``), or None when unreadable."""
    return _status_bytes(pid, "VmHWM:")


def rss_bytes(pid: int) -> int | None:
    """The resident memory ``pid`` holds now (``VmRSS``), or None when unreadable."""
    return _status_bytes(pid, "VmRSS:")


def _status_bytes(pid: int, field: str) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return None


def summed(values: list[T | None]) -> T | None:
    """The sum of one figure read from several processes, or None when one could not be read."""
    known = [v for v in values if v is not None]
    return sum(known[1:], known[0]) if known and len(known) == len(values) else None
