"""The live inputs of the round policy: learners alive, their step time, and how long rounds take.

``diloco_core.rounds`` decides from a round's state and these numbers; this class gathers them in
one place, so that the round runner (when to merge) and the long-poll (how much grace is left)
compute the same deadline.
"""

from __future__ import annotations

from typing import TypedDict

from diloco_core import rounds
from diloco_core.config import DiLoCoSettings

from .learners import LearnerRegistry

SYNC_TIME_EMA = 0.3  # weight of the newest round's merge + commit time


class Pace(TypedDict):
    """The grace window's inputs (``diloco_core.rounds.grace_window``) at one moment."""

    step_time: float
    sync_time: float
    overlap: int
    gamma: float
    cap: float


class RoundPolicy:
    def __init__(self, diloco: DiLoCoSettings, registry: LearnerRegistry, max_grace_s: float) -> None:
        self.diloco = diloco
        self.registry = registry
        self.max_grace_s = max_grace_s  # bounds the wait whatever step times learners report
        self.sync_time_s = 0.0  # EMA of merge + commit time

    def record_sync_time(self, elapsed: float) -> None:
        s = self.sync_time_s
        self.sync_time_s = elapsed if s == 0 else (1 - SYNC_TIME_EMA) * s + SYNC_TIME_EMA * elapsed

    def _pace(self, now: float) -> Pace:
        d, step_time = self.diloco, self.registry.step_time(now)
        return Pace(
            step_time=step_time,
            sync_time=self.sync_time_s,
            overlap=d.overlap,
            gamma=d.grace_gamma,
            cap=rounds.grace_cap(step_time=step_time, cap_steps=d.grace_cap_steps, max_s=self.max_grace_s),
        )

    def decide(self, state: rounds.RoundState, now: float) -> rounds.Decision:
        d = self.diloco
        return rounds.decide(
            state,
            now=now,
            quorum=d.quorum,
            alive=self.registry.alive_count(now),
            max_staleness=d.max_staleness,
            **self._pace(now),
        )

    def grace_left(self, state: rounds.RoundState, now: float) -> float | None:
        """Seconds until the round's grace deadline (None while its quorum is not reached)."""
        return rounds.grace_left(state, now=now, **self._pace(now))
