"""The failure model of a local job, shared by ``diloco run`` (which kills real learner processes)
and ``diloco simulate run`` (which predicts the goodput of the same job), so that both draw the same
failures from the same flags and seed.

- **When learners fail.** Learner ``i`` fails at the instants of a Poisson process in wall-clock
  time with mean ``mtbf_s`` between instants, drawn once from ``(seed, i)``. An instant hits the
  learner only while it is *up* (its process is starting or training); one that comes while it is
  down, or after it finished, is absorbed. Because the process is memoryless this is the same as "an
  exponential time to failure from every restart", but the instants do not depend on how long
  restarts take, so a real run and its simulation see exactly the same ones.
- **What a failure takes down.** ``elastic``: only the learner that failed (decoupled training,
  synchronous DiLoCo: independent processes). Not elastic: every learner of the job, because they
  are the ranks of one data-parallel unit that cannot train without any of them.
- **Repair.** A learner that went down stays down ``repair_s`` seconds, then its process is started
  again; in a non-elastic job the whole unit comes back together.
- **Quorum.** How many learners must be training for training to count: 1 when learners train
  independently (decoupled), all of them when every sync waits for every learner (synchronous
  DiLoCo, data-parallel). A learner that trains while fewer than ``quorum`` learners do is blocked.
- **Restart.** The time from a process's launch to its first step. Real processes take what they
  take (``diloco bench startup`` measures it); the simulator takes it as a measured input.

Time is in seconds from the start of the job; nothing here reads a clock.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

# how each mode of `diloco run` meets a failure: (elastic, quorum of all learners)
MODE_RULES: dict[str, tuple[bool, bool]] = {
    "decoupled": (True, False),
    "diloco-sync": (True, True),
    "ddp": (False, True),
}


@dataclass(frozen=True)
class FailureModel:
    """Failures of the learners of one job (see the module's docstring); ``mtbf_s = 0``: none."""

    learners: int
    mtbf_s: float = 60.0
    repair_s: float = 8.0
    seed: int = 0
    elastic: bool = True
    quorum: int = 1

    def __post_init__(self) -> None:
        if self.learners < 1:
            raise ValueError(f"a job needs at least one learner, got {self.learners}")
        if not self.mtbf_s >= 0 or not self.repair_s >= 0:
            raise ValueError(
                f"MTBF and repair time must be >= 0 seconds, got {self.mtbf_s} and {self.repair_s}"
            )
        if not 1 <= self.quorum <= self.learners:
            raise ValueError(f"the quorum must be between 1 and {self.learners} learners, got {self.quorum}")

    @property
    def enabled(self) -> bool:
        return self.mtbf_s > 0

    def group_of(self, learner: int) -> tuple[int, ...]:
        """The learners a failure of ``learner`` takes down."""
        return (learner,) if self.elastic else tuple(range(self.learners))


def failure_model_for(mode: str, *, learners: int, mtbf_s: float, repair_s: float, seed: int) -> FailureModel:
    """The failure model of a ``diloco run`` mode: decoupled (elastic, quorum 1), diloco-sync
    (elastic, quorum all) or ddp (not elastic, quorum all)."""
    if mode not in MODE_RULES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODE_RULES)}")
    elastic, all_learners = MODE_RULES[mode]
    return FailureModel(learners, mtbf_s, repair_s, seed, elastic, learners if all_learners else 1)


@dataclass(frozen=True, order=True)
class Failure:
    """Learner ``learner`` fails at ``at_s`` (if it is up then)."""

    at_s: float
    learner: int


def failure_times(model: FailureModel, learner: int, horizon_s: float) -> tuple[float, ...]:
    """The failure instants of one learner in ``[0, horizon_s)`` (none when failures are off)."""
    if horizon_s < 0:
        raise ValueError(f"horizon must be >= 0 seconds, got {horizon_s}")
    if not model.enabled:
        return ()
    rng = random.Random(f"chaos:{model.seed}:{learner}")
    out: list[float] = []
    at = rng.expovariate(1.0 / model.mtbf_s)
    while at < horizon_s:
        out.append(at)
        at += rng.expovariate(1.0 / model.mtbf_s)
    return tuple(out)


def failure_schedule(model: FailureModel, horizon_s: float) -> tuple[Failure, ...]:
    """Every learner's failure instants in ``[0, horizon_s)``, in time order."""
    return tuple(
        sorted(
            Failure(at, learner)
            for learner in range(model.learners)
            for at in failure_times(model, learner, horizon_s)
        )
    )


def add_failure_flags(
    group: argparse._ArgumentGroup | argparse.ArgumentParser, *, mtbf_s: float, repair_s: float, seed: int
) -> None:
    """The failure flags ``diloco run`` and ``diloco simulate run`` share, with their defaults."""
    group.add_argument(
        "--mtbf",
        type=float,
        default=mtbf_s,
        help="mean seconds between failures of each learner while it is up (Poisson); 0 disables "
        "failures (default %(default)s)",
    )
    group.add_argument(
        "--repair",
        type=float,
        default=repair_s,
        help="seconds a failed learner stays down before it is started again (default %(default)s)",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=seed,
        help="seed of the failure instants (and of the model) (default %(default)s)",
    )
