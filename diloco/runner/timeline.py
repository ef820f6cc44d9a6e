"""What happened to each learner over the run: up/down intervals, blocked time, rolled-back work.

The orchestrator records facts into a ``Timeline`` with explicit times (seconds since the start of
the job); ``goodput`` turns a finished timeline into numbers without touching a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

PhaseName = Literal["starting", "training", "down"]
PHASES: tuple[PhaseName, ...] = ("starting", "training", "down")


@dataclass(frozen=True)
class Interval:
    """One learner spent ``[start_s, end_s)`` in ``phase`` (``starting``: process launched, not yet
    training, i.e. start-up or rejoining; ``training``; ``down``: killed, waiting for repair)."""

    learner: int
    phase: PhaseName
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end_s - self.start_s)


@dataclass(frozen=True)
class Rollback:
    """Work lost to a failure: the learner was at ``from_step`` when killed and resumed at ``to_step``."""

    learner: int
    at_s: float
    from_step: int
    to_step: int
    step_time_s: float

    @property
    def lost_s(self) -> float:
        return max(0, self.from_step - self.to_step) * self.step_time_s


@dataclass
class Timeline:
    """A recorder of learner phases; every method takes the time it is about."""

    intervals: list[Interval] = field(default_factory=list)
    rollbacks: list[Rollback] = field(default_factory=list)
    # blocked seconds reported by each incarnation (process launch) of each learner: (learner, n) -> s
    blocked_s: dict[tuple[int, int], float] = field(default_factory=dict)
    _open: dict[int, tuple[PhaseName, float]] = field(default_factory=dict)
    _blocked_base: dict[tuple[int, int], float] = field(default_factory=dict)

    def phase_of(self, learner: int) -> PhaseName | None:
        current = self._open.get(learner)
        return current[0] if current else None

    def enter(self, learner: int, phase: PhaseName, at_s: float) -> None:
        """Close the learner's current phase at ``at_s`` and open ``phase``."""
        if self.phase_of(learner) == phase:
            return
        self.leave(learner, at_s)
        self._open[learner] = (phase, at_s)

    def leave(self, learner: int, at_s: float) -> None:
        """Close the learner's current phase (it finished or the job ended)."""
        current = self._open.pop(learner, None)
        if current is not None:
            self.intervals.append(Interval(learner, current[0], current[1], max(at_s, current[1])))

    def close(self, at_s: float) -> None:
        for learner in list(self._open):
            self.leave(learner, at_s)

    def record_blocked(self, learner: int, incarnation: int, blocked_s: float) -> None:
        """The cumulative blocked time an incarnation (process launch) reports.

        A learner restores its counter from its checkpoint, so an incarnation after the first counts
        only what it added beyond the first value it reported; the largest value seen counts."""
        key = (learner, incarnation)
        base = self._blocked_base.setdefault(key, blocked_s if incarnation > 0 else 0.0)
        self.blocked_s[key] = max(self.blocked_s.get(key, 0.0), blocked_s - base)

    def to_dict(self) -> dict[str, Any]:
        return {
            "intervals": [vars(i) | {"duration_s": i.duration_s} for i in self.intervals],
            "rollbacks": [vars(r) | {"lost_s": r.lost_s} for r in self.rollbacks],
            "blocked_s": [
                {"learner": learner, "incarnation": n, "blocked_s": s} for (learner, n), s in self.blocked_s.items()
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timeline:
        timeline = cls()
        timeline.intervals = [
            Interval(int(i["learner"]), i["phase"], float(i["start_s"]), float(i["end_s"])) for i in data["intervals"]
        ]
        timeline.rollbacks = [
            Rollback(int(r["learner"]), float(r["at_s"]), int(r["from_step"]), int(r["to_step"]), float(r["step_time_s"]))
            for r in data["rollbacks"]
        ]
        timeline.blocked_s = {(int(b["learner"]), int(b["incarnation"])): float(b["blocked_s"]) for b in data["blocked_s"]}
        return timeline


@dataclass(frozen=True)
class Goodput:
    """Useful learner-time over total learner-time (docs/algorithm.md §3.11).

    total = every second a learner was allocated (starting + training + down);
    useful = training time - time blocked on communication - work rolled back by failures.
    """

    total_s: float
    training_s: float
    starting_s: float
    down_s: float
    blocked_s: float
    lost_s: float

    @property
    def useful_s(self) -> float:
        return max(0.0, self.training_s - self.blocked_s - self.lost_s)

    @property
    def goodput(self) -> float | None:
        return self.useful_s / self.total_s if self.total_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return vars(self) | {"useful_s": self.useful_s, "goodput": self.goodput}


def compute_goodput(
    intervals: Iterable[Interval], blocked_s: Mapping[tuple[int, int], float], rollbacks: Iterable[Rollback]
) -> Goodput:
    by_phase = dict.fromkeys(PHASES, 0.0)
    for interval in intervals:
        by_phase[interval.phase] += interval.duration_s
    blocked = min(sum(blocked_s.values()), by_phase["training"])
    lost = sum(r.lost_s for r in rollbacks)
    return Goodput(
        total_s=sum(by_phase.values()),
        training_s=by_phase["training"],
        starting_s=by_phase["starting"],
        down_s=by_phase["down"],
        blocked_s=blocked,
        lost_s=lost,
    )


def goodput_of(timeline: Timeline) -> Goodput:
    return compute_goodput(timeline.intervals, timeline.blocked_s, timeline.rollbacks)
