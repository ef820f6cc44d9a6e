"""How long a learner process takes to start: named phases from its launch to its first training step.

A learner's start-up is time in which it holds its hardware without training (goodput,
docs/algorithm.md §3.11), and after a failure it is paid again on every restart. The worker marks the
end of each phase on a :class:`StartupClock`; the total runs from the creation of the process (read
from ``/proc`` on Linux, so the interpreter's own start counts) to the end of the first step. The
result goes into the learner's log and into the metrics record of its first step, where
``diloco run`` and ``diloco bench startup`` read it.

This module imports nothing heavy: it is loaded before PyTorch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

# the phases in the order a learner goes through them (docs/run.md, "Start-up")
PHASES: tuple[str, ...] = ("imports", "unit", "task", "optimizer", "checkpoint", "register", "first_step")


def process_started_at(
    now: Callable[[], float] = time.time,
    *,
    stat_path: str = "/proc/self/stat",
    uptime_path: str = "/proc/uptime",
) -> float | None:
    """Wall-clock time at which this process was created, from ``/proc`` (None where there is none).

    ``/proc/self/stat`` gives the start in clock ticks since boot and ``/proc/uptime`` the time since
    boot with 10 ms resolution (the boot time in ``/proc/stat`` is rounded to whole seconds)."""
    try:
        with open(stat_path) as f:
            stat = f.read()
        with open(uptime_path) as f:
            uptime_s = float(f.read().split()[0])
        wall = now()
        # the command name (field 2) may hold spaces: the fields after it follow the last ')'
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        return wall - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class StartupClock:
    """The end of each start-up phase: wall-clock seconds and this process's CPU seconds (all threads)
    at that instant. ``launched_at`` is the creation of the process, where its CPU time was 0; CPU
    time is much less sensitive than wall time to other processes' load on a shared machine."""

    launched_at: float
    marks: list[tuple[str, float, float]] = field(default_factory=list)
    now: Callable[[], float] = time.time
    cpu: Callable[[], float] = time.process_time
    cpu_at_launch: float = 0.0

    @classmethod
    def of_this_process(cls) -> StartupClock:
        """A clock from this process's creation (or from now, where the creation time is unknown)."""
        return cls(process_started_at() or time.time())

    @classmethod
    def from_now(cls) -> StartupClock:
        """A clock from now (a learner run inside a process that did other things first)."""
        return cls(time.time(), cpu_at_launch=time.process_time())

    def mark(self, phase: str) -> None:
        """``phase`` ends now (it began where the previous phase ended)."""
        self.marks.append((phase, self.now(), self.cpu()))

    @property
    def done(self) -> bool:
        return any(mark[0] == "first_step" for mark in self.marks)

    def phases(self, *, cpu: bool = False) -> dict[str, float]:
        """Wall (or CPU) seconds per phase, in the order they were marked."""
        out: dict[str, float] = {}
        previous = self.cpu_at_launch if cpu else self.launched_at
        for phase, wall, cpu_s in self.marks:
            at = cpu_s if cpu else wall
            out[phase] = max(0.0, at - previous)
            previous = at
        return out

    @property
    def total_s(self) -> float:
        return max(0.0, self.marks[-1][1] - self.launched_at) if self.marks else 0.0

    @property
    def total_cpu_s(self) -> float:
        return max(0.0, self.marks[-1][2] - self.cpu_at_launch) if self.marks else 0.0

    def to_record(self) -> dict[str, Any]:
        """What the metrics record of the first step carries."""
        return {
            "startup_s": round(self.total_s, 4),
            "startup_cpu_s": round(self.total_cpu_s, 4),
            "startup_phases": {k: round(v, 4) for k, v in self.phases().items()},
            "startup_cpu_phases": {k: round(v, 4) for k, v in self.phases(cpu=True).items()},
            "launched_at": self.launched_at,
            "first_step_at": self.marks[-1][1] if self.marks else self.launched_at,
        }

    def describe(self) -> str:
        cpu = self.phases(cpu=True)
        parts = ", ".join(f"{phase} {s:.2f} ({cpu[phase]:.2f} CPU)" for phase, s in self.phases().items())
        return (
            f"start-up took {self.total_s:.2f} s ({self.total_cpu_s:.2f} CPU-s) to the end of the first "
            f"step: {parts}"
        )


class _Hook(Protocol):
    def at_boundary(self, state: Any, step_tokens: int, stop: bool, step_time: float) -> bool: ...


class FirstStep:
    """Wraps the training loop's step hook: the first step boundary ends the start-up (``first_step``)
    and hands the clock and the loop's state to ``report``, before the boundary's own work (sync, a
    blocking wait), so the state's counters are still those the process resumed with."""

    def __init__(
        self, inner: _Hook | None, clock: StartupClock, report: Callable[[StartupClock, Any], None]
    ) -> None:
        self.inner, self.clock, self.report = inner, clock, report

    def at_boundary(self, state: Any, step_tokens: int, stop: bool, step_time: float) -> bool:
        if not self.clock.done:
            self.clock.mark("first_step")
            self.report(self.clock, state)
        return self.inner.at_boundary(state, step_tokens, stop, step_time) if self.inner else stop
