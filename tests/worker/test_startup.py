"""The start-up clock: phases from a process's creation to its first step, and the first-step hook."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path

from diloco_worker.metrics import MetricsLog, read_metrics
from diloco_worker.startup import FirstStep, StartupClock, process_started_at


def test_phases_run_from_the_launch_and_each_from_the_end_of_the_previous() -> None:
    walls = iter([11.5, 14.0, 14.25])
    cpus = iter([0.5, 1.5, 1.75])
    clock = StartupClock(10.0, now=lambda: next(walls), cpu=lambda: next(cpus))
    for phase in ("imports", "task", "first_step"):
        clock.mark(phase)
    assert clock.phases() == {"imports": 1.5, "task": 2.5, "first_step": 0.25}
    assert clock.phases(cpu=True) == {"imports": 0.5, "task": 1.0, "first_step": 0.25}
    assert clock.total_s == 4.25
    assert clock.total_cpu_s == 1.75
    record = clock.to_record()
    assert record["launched_at"] == 10.0
    assert record["first_step_at"] == 14.25
    assert record["startup_s"] == 4.25
    assert "first_step 0.25 (0.25 CPU)" in clock.describe()


def test_a_clock_without_marks_reports_nothing_spent() -> None:
    clock = StartupClock(10.0)
    assert clock.total_s == 0.0
    assert clock.phases() == {}
    assert not clock.done


def test_the_creation_of_this_process_is_before_now_and_after_the_parent_launched_it() -> None:
    launched = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "from diloco_worker.startup import process_started_at; print(process_started_at())"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    started = float(out.stdout)
    assert launched - 0.05 <= started <= time.time()
    own = process_started_at()
    assert own is not None
    assert own <= time.time()


def test_without_proc_the_creation_time_is_unknown(tmp_path: Path) -> None:
    assert process_started_at(stat_path=str(tmp_path / "no-stat")) is None
    (tmp_path / "stat").write_text("garbage")
    assert process_started_at(stat_path=str(tmp_path / "stat")) is None


class Inner:
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def at_boundary(self, state: object, step_tokens: int, stop: bool, step_time: float) -> bool:
        self.calls.append(stop)
        return not stop


def test_the_first_boundary_ends_the_start_up_once_and_every_boundary_reaches_the_hook() -> None:
    ticks = itertools.count(1.0)
    clock = StartupClock(0.0, now=lambda: next(ticks), cpu=lambda: 0.0)
    reported: list[float] = []
    inner = Inner()
    hook = FirstStep(inner, clock, lambda c, state: reported.append(c.total_s))
    assert hook.at_boundary(None, 1, False, 0.1) is True
    assert hook.at_boundary(None, 1, True, 0.1) is False
    assert reported == [1.0]
    assert inner.calls == [False, True]
    assert clock.done


def test_without_a_hook_the_loop_keeps_its_own_stop_decision() -> None:
    hook = FirstStep(None, StartupClock(0.0), lambda c, state: None)
    assert hook.at_boundary(None, 1, True, 0.1) is True
    assert hook.at_boundary(None, 1, False, 0.1) is False


def test_a_noted_value_goes_into_the_next_record_only(tmp_path: Path) -> None:
    path = f"{tmp_path}/m.jsonl"
    log = MetricsLog(path, pid=1)
    log.note(startup_s=2.5)
    log.write(step=1)
    log.write(step=2)
    first, second = read_metrics(path)
    assert first["startup_s"] == 2.5
    assert "startup_s" not in second
