"""The chaos schedule of a run: the failure instants of its learners, and which are due (pure).

The instants come from the failure model shared with the simulator (:mod:`diloco.failures`): the
same flags and seed give the same failures. The runner kills a learner (in ddp mode, its whole unit)
at an instant that finds it up, and starts it again ``repair_s`` later; instants that find it down
are absorbed.
"""

from __future__ import annotations

from collections.abc import Sequence

from diloco.failures import Failure, failure_schedule
from diloco.runner.settings import RunSettings


def build_chaos_schedule(settings: RunSettings) -> tuple[Failure, ...]:
    """Every learner's failure instants within the run's time limit, in time order."""
    return failure_schedule(settings.failures, settings.time_limit_s)


def due_events(schedule: Sequence[Failure], cursor: int, now_s: float) -> tuple[list[Failure], int]:
    """The failures of ``schedule[cursor:]`` whose time has come, and the new cursor."""
    end = cursor
    while end < len(schedule) and schedule[end].at_s <= now_s:
        end += 1
    return list(schedule[cursor:end]), end
