"""The chaos schedule: when each learner is killed and when it comes back (pure).

Each learner fails as a Poisson process while it is up: the time from its (re)start to its next
failure is exponential with mean ``mtbf_s``; after a failure it stays down for ``repair_s`` and is
then restarted. Time is in seconds from the start of the job. The schedule depends only on its
arguments, so the same seed gives the same chaos.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ChaosAction = Literal["kill", "restart"]


@dataclass(frozen=True, order=True)
class ChaosEvent:
    at_s: float
    learner: int
    action: ChaosAction


def build_chaos_schedule(
    *, seed: int, mtbf_s: float, repair_s: float, learners: Sequence[int], horizon_s: float
) -> tuple[ChaosEvent, ...]:
    """Kill/restart events for ``learners`` in ``[0, horizon_s)``, sorted by time.

    Every kill is followed by its restart ``repair_s`` later (even past the horizon, so that a kill
    never leaves a learner down for good); ``mtbf_s <= 0`` means no chaos.
    """
    if repair_s < 0:
        raise ValueError(f"repair time must be >= 0 seconds, got {repair_s}")
    if horizon_s < 0:
        raise ValueError(f"horizon must be >= 0 seconds, got {horizon_s}")
    if mtbf_s <= 0:
        return ()
    events: list[ChaosEvent] = []
    for learner in learners:
        rng = random.Random(f"chaos:{seed}:{learner}")
        up_since = 0.0
        while True:
            fail_at = up_since + rng.expovariate(1.0 / mtbf_s)
            if fail_at >= horizon_s:
                break
            events.append(ChaosEvent(fail_at, learner, "kill"))
            up_since = fail_at + repair_s
            events.append(ChaosEvent(up_since, learner, "restart"))
    return tuple(sorted(events, key=lambda e: (e.at_s, e.learner, e.action != "kill")))


def due_events(schedule: Sequence[ChaosEvent], cursor: int, now_s: float) -> tuple[list[ChaosEvent], int]:
    """The events of ``schedule[cursor:]`` whose time has come, and the new cursor."""
    end = cursor
    while end < len(schedule) and schedule[end].at_s <= now_s:
        end += 1
    return list(schedule[cursor:end]), end
