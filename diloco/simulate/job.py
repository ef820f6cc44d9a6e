"""A local job as ``diloco run`` runs it, simulated: N learner processes under the shared failure
model (:mod:`diloco.failures`), with the same failure instants, and the same timeline and goodput
accounting as the real run (:mod:`diloco.runner.timeline`), so the two can be compared figure by
figure.

Each learner is *starting* (its process was launched: ``startup_s`` for the first launch,
``restart_s`` after a failure), *training* (one step every ``step_time_s``), *down* (``repair_s``
after a failure) or *finished* (``max_steps`` reached). A failure instant that finds a learner up
takes down the learners of its group (the whole job when it is not elastic) and rolls each back to
its last checkpoint (every ``checkpoint_every`` steps); one that finds it down is absorbed. A
training learner whose job has fewer than ``quorum`` learners training (finished learners left the
job and no longer count) is blocked: its time is allocated, not useful, and it makes no progress.

Modelled choices (docs/simulator.md, "A local job"): blocking starts at the failure, not at the
learner's next sync (at most ``inner_steps / fragments`` steps later) and ends when the restarted
learner trains again; while every learner trains, a measured share of each one's time goes to
synchronisation (``JobTiming.blocked_fraction``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from diloco.failures import Failure, FailureModel, failure_schedule
from diloco.runner.timeline import PhaseName, Rollback, Timeline


@dataclass(frozen=True)
class JobTiming:
    """What the job's processes take, measured on the machine that runs them: the simulator's only
    calibration. ``startup_s`` None: the same as ``restart_s``. ``blocked_fraction`` is the share of
    a training learner's time spent at step boundaries on synchronisation while every learner trains
    (applying and sending fragments, a data-parallel unit's exchange, lock-step waits for merges):
    the cost of syncing itself, which failures do not cause."""

    restart_s: float
    step_time_s: float
    startup_s: float | None = None
    checkpoint_every: int = 10
    blocked_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not (
            self.restart_s >= 0 and self.step_time_s > 0 and (self.startup_s is None or self.startup_s >= 0)
        ):
            raise ValueError(
                f"restart and start-up times must be >= 0 and the step time > 0 seconds, got restart "
                f"{self.restart_s}, start-up {self.startup_s}, step {self.step_time_s}"
            )
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 step, got {self.checkpoint_every}")
        if not 0 <= self.blocked_fraction < 1:
            raise ValueError(f"the blocked fraction must be in [0, 1), got {self.blocked_fraction}")

    @property
    def first_start_s(self) -> float:
        return self.restart_s if self.startup_s is None else self.startup_s


@dataclass
class _Learner:
    phase: PhaseName | None  # None: finished
    until_s: float  # end of a starting or down phase
    steps: float = 0.0
    checkpoint: int = 0
    incarnation: int = 0
    blocked_s: float = 0.0


@dataclass
class SimulatedJob:
    """The simulated run: its timeline (the runner's accounting) and the failures that hit."""

    timeline: Timeline
    kills: int = 0
    absorbed: int = 0
    steps: list[int] = field(default_factory=list)


def simulate_job(
    model: FailureModel,
    timing: JobTiming,
    *,
    time_limit_s: float,
    max_steps: int,
    failures: Sequence[Failure] | None = None,
) -> SimulatedJob:
    """Run the job from time 0 until ``time_limit_s`` or until every learner finished; ``failures``
    (in time order) replaces the model's own draw."""
    if time_limit_s <= 0 or max_steps < 1:
        raise ValueError(f"need a time limit > 0 and max_steps >= 1, got {time_limit_s} and {max_steps}")
    learners = [_Learner("starting", timing.first_start_s) for _ in range(model.learners)]
    timeline = Timeline()
    for i in range(model.learners):
        timeline.enter(i, "starting", 0.0)
    failures = list(failure_schedule(model, time_limit_s) if failures is None else failures)
    job = SimulatedJob(timeline)
    now, cursor = 0.0, 0
    while now < time_limit_s and any(x.phase is not None for x in learners):
        progressing = _progressing(learners, model.quorum)
        step_rate = (1.0 - timing.blocked_fraction) / timing.step_time_s if progressing else 0.0
        candidates = [time_limit_s]
        if cursor < len(failures):
            candidates.append(failures[cursor].at_s)
        candidates += [x.until_s for x in learners if x.phase in ("starting", "down")]
        if step_rate > 0:
            candidates += [now + (max_steps - x.steps) / step_rate for x in learners if x.phase == "training"]
        t = max(now, min(candidates))
        for x in learners:
            if x.phase == "training":
                if progressing:
                    x.steps = min(float(max_steps), x.steps + (t - now) * step_rate)
                    x.blocked_s += (t - now) * timing.blocked_fraction
                else:
                    x.blocked_s += t - now
        now = t
        _phase_ends(learners, timeline, timing, now, max_steps)
        while cursor < len(failures) and failures[cursor].at_s <= now:
            _fail(failures[cursor].learner, learners, model, timeline, timing, now, job)
            cursor += 1
    timeline.close(min(now, time_limit_s))
    for i, x in enumerate(learners):
        timeline.blocked_s[(i, x.incarnation)] = x.blocked_s
    job.steps = [math.floor(x.steps + 1e-9) for x in learners]
    return job


def _progressing(learners: list[_Learner], quorum: int) -> bool:
    """Whether training learners make progress: enough of those still in the job are training."""
    in_job = sum(x.phase is not None for x in learners)
    training = sum(x.phase == "training" for x in learners)
    return training > 0 and training >= min(quorum, in_job)


def _phase_ends(
    learners: list[_Learner], timeline: Timeline, timing: JobTiming, now: float, max_steps: int
) -> None:
    for i, x in enumerate(learners):
        if x.phase == "training" and x.steps >= max_steps - 1e-9:
            x.phase = None
            timeline.leave(i, now)
        elif x.phase == "starting" and x.until_s <= now:
            x.phase = "training"
            timeline.enter(i, "training", now)
        elif x.phase == "down" and x.until_s <= now:
            x.phase, x.until_s = "starting", now + timing.restart_s
            timeline.blocked_s[(i, x.incarnation)] = x.blocked_s
            x.incarnation, x.blocked_s = x.incarnation + 1, 0.0
            timeline.enter(i, "starting", now)


def _fail(
    learner: int,
    learners: list[_Learner],
    model: FailureModel,
    timeline: Timeline,
    timing: JobTiming,
    now: float,
    job: SimulatedJob,
) -> None:
    """A failure instant of ``learner``: its group goes down if it is up, else it is absorbed."""
    if learners[learner].phase not in ("starting", "training"):
        job.absorbed += 1
        return
    job.kills += 1
    for i in model.group_of(learner):
        x = learners[i]
        if x.phase not in ("starting", "training"):
            continue
        reached = math.floor(x.steps + 1e-9)
        checkpoint = max(x.checkpoint, reached - reached % timing.checkpoint_every)
        if reached > checkpoint:
            timeline.rollbacks.append(Rollback(i, now, reached, checkpoint, timing.step_time_s))
        x.steps, x.checkpoint = float(checkpoint), checkpoint
        x.phase, x.until_s = "down", now + model.repair_s
        timeline.enter(i, "down", now)
