"""What happened to each learner over the run: up/down intervals, blocked time, rolled-back work.

The orchestrator records facts into a ``Timeline`` with explicit times (seconds since the start of
the job); ``goodput`` turns a finished timeline into numbers without touching a clock.
"""

from __future__ import annotations

import itertools
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

    def move_training_start(self, learner: int, launched_at_s: float, first_step_s: float) -> None:
        """The process launched at ``launched_at_s`` trained from ``first_step_s`` (what it reported
        itself; the runner's polls see it training up to a second or two later): move the boundary
        between that launch's starting interval and the training interval after it. Applies only
        to a closed timeline, and only within those two intervals."""
        mine = [k for k, i in enumerate(self.intervals) if i.learner == learner]
        for a, b in itertools.pairwise(mine):
            start, train = self.intervals[a], self.intervals[b]
            if start.phase != "starting" or start.start_s != launched_at_s:
                continue
            if (
                train.phase == "training"
                and train.start_s == start.end_s
                and start.start_s <= first_step_s <= train.end_s
            ):
                self.intervals[a] = Interval(learner, "starting", start.start_s, first_step_s)
                self.intervals[b] = Interval(learner, "training", first_step_s, train.end_s)
            return

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
                {"learner": learner, "incarnation": n, "blocked_s": s}
                for (learner, n), s in self.blocked_s.items()
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timeline:
        timeline = cls()
        timeline.intervals = [
            Interval(int(i["learner"]), i["phase"], float(i["start_s"]), float(i["end_s"]))
            for i in data["intervals"]
        ]
        timeline.rollbacks = [
            Rollback(
                int(r["learner"]),
                float(r["at_s"]),
                int(r["from_step"]),
                int(r["to_step"]),
                float(r["step_time_s"]),
            )
            for r in data["rollbacks"]
        ]
        timeline.blocked_s = {
            (int(b["learner"]), int(b["incarnation"])): float(b["blocked_s"]) for b in data["blocked_s"]
        }
        return timeline


@dataclass(frozen=True)
class Goodput:
    """Useful learner-time over total learner-time (docs/algorithm.md §3.11).

    total = every second a learner was allocated (starting + training + down);
    useful = training time - time blocked on communication - work rolled back by failures.

    ``startup_s`` is the learner-time before each learner first trained (its first launch to its
    first step, failures during it included): the job's start-up, paid once. The steady state is
    everything after it, so ``steady_goodput`` reads what failures and synchronisation cost a job
    that has started, and ``goodput`` what the whole run got.
    """

    total_s: float
    training_s: float
    starting_s: float
    down_s: float
    blocked_s: float
    lost_s: float
    startup_s: float = 0.0

    @property
    def useful_s(self) -> float:
        return max(0.0, self.training_s - self.blocked_s - self.lost_s)

    @property
    def goodput(self) -> float | None:
        return self.useful_s / self.total_s if self.total_s > 0 else None

    @property
    def steady_s(self) -> float:
        return max(0.0, self.total_s - self.startup_s)

    @property
    def steady_goodput(self) -> float | None:
        return self.useful_s / self.steady_s if self.steady_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return vars(self) | {
            "useful_s": self.useful_s,
            "goodput": self.goodput,
            "steady_s": self.steady_s,
            "steady_goodput": self.steady_goodput,
        }


def startup_seconds(intervals: Iterable[Interval]) -> float:
    """Learner-time before each learner's first training interval (all of it, for one that never trained)."""
    by_learner: dict[int, list[Interval]] = {}
    for interval in intervals:
        by_learner.setdefault(interval.learner, []).append(interval)
    total = 0.0
    for own in by_learner.values():
        trained = [i.start_s for i in own if i.phase == "training"]
        first = min(trained) if trained else float("inf")
        total += sum(max(0.0, min(i.end_s, first) - i.start_s) for i in own if i.start_s < first)
    return total


def launch_durations(intervals: Iterable[Interval]) -> tuple[list[float], list[float]]:
    """How long launches took to train, from the starting intervals that ended in training (one cut
    short by a failure or by the end of the run says nothing about it): (the first launch of each
    learner, every later launch)."""
    by_learner: dict[int, list[Interval]] = {}
    for interval in intervals:
        by_learner.setdefault(interval.learner, []).append(interval)
    first: list[float] = []
    later: list[float] = []
    for own in by_learner.values():
        own.sort(key=lambda i: i.start_s)
        trained = False
        for a, b in itertools.pairwise(own):
            if a.phase == "starting" and b.phase == "training" and b.start_s == a.end_s:
                (later if trained else first).append(a.duration_s)
            trained = trained or a.phase == "training"
    return first, later


def compute_goodput(
    intervals: Iterable[Interval], blocked_s: Mapping[tuple[int, int], float], rollbacks: Iterable[Rollback]
) -> Goodput:
    intervals = list(intervals)
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
        startup_s=startup_seconds(intervals),
    )


def goodput_of(timeline: Timeline) -> Goodput:
    return compute_goodput(timeline.intervals, timeline.blocked_s, timeline.rollbacks)
