"""Built-in chaos: the pure decision of which learner pods fail now.

Failures of each unit arrive as a Poisson process with mean time between failures
``mtbfSeconds``: over an interval ``dt`` a unit fails with probability ``1 - exp(-dt / mtbf)``.
A failed unit loses one pod at random (which breaks the unit's data-parallel group, as a chip
failure does) and, with ``repairSeconds > 0``, stays down (scaled to zero) for that long before
it comes back — the same experiment as the paper's goodput study.

Chaos deletes pods for real, so it takes two keys: the operator must allow it
(``--allow-chaos``, ``DILOCO_OPERATOR_ALLOW_CHAOS``, the chart's ``operator.allowChaos``) and
the job must set ``spec.chaos.enabled: true``. A job that asks for chaos without both gets a
``Chaos`` condition (status False) and a Warning event saying which key is missing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diloco_operator.schema.spec import ChaosSpec, DiLoCoJobSpec
from diloco_operator.schema.status import JobStatus
from diloco_operator.status.events import Event

# A timer that was not called for a long time must not fire a burst of failures at once.
MAX_INTERVAL_S = 300.0


@dataclass(frozen=True)
class Gate:
    """Whether chaos runs for a job, as the ``Chaos`` condition reports it."""

    active: bool
    reason: str  # Enabled, NotAllowed or NotEnabled
    message: str


def chaos_gate(chaos: ChaosSpec, allowed: bool) -> Gate | None:
    """The decision of the two keys; None when the job does not ask for chaos at all.

    Fields other than ``enabled`` that differ from their defaults ask for chaos too (the CRD
    fills the defaults in, so "set" can only mean "not the default").
    """
    if chaos.enabled and allowed:
        return Gate(
            True, "Enabled", f"chaos kills learner pods, mean time between failures {chaos.mtbf_seconds:g}s"
        )
    if chaos.enabled:
        return Gate(
            False,
            "NotAllowed",
            "spec.chaos.enabled is true but this operator does not allow chaos "
            "(start it with --allow-chaos, or the chart with operator.allowChaos=true); no pod is killed",
        )
    if chaos.model_dump(exclude={"enabled"}) != ChaosSpec().model_dump(exclude={"enabled"}):
        return Gate(
            False,
            "NotEnabled",
            "spec.chaos sets failure parameters but not enabled: true; " "chaos is off and no pod is killed",
        )
    return None


GATE_EVENTS = {"NotAllowed": "ChaosRefused", "NotEnabled": "ChaosNotEnabled"}


def gate_events(old: JobStatus, gate: Gate) -> list[Event]:
    """A Warning when chaos is newly refused (or refused for another reason than before)."""
    before = c.reason if (c := old.condition("Chaos")) else None
    if gate.reason in GATE_EVENTS and gate.reason != before:
        return [Event("Warning", GATE_EVENTS[gate.reason], gate.message)]
    return []


@dataclass(frozen=True)
class PodRef:
    name: str
    unit: str
    running: bool


@dataclass(frozen=True)
class ChaosUnit:
    name: str
    mtbf_s: float
    down_until: float = 0.0  # epoch seconds; the unit is under repair until then


@dataclass(frozen=True)
class Victim:
    unit: str
    pod: str


def chaos_units(chaos: ChaosSpec, spec: DiLoCoJobSpec, down_until: Mapping[str, float]) -> list[ChaosUnit]:
    """The units chaos may hit (all units when ``chaos.units`` is empty)."""
    if not chaos.enabled:
        return []
    names = chaos.units or [u.name for u in spec.learner_units]
    return [ChaosUnit(n, chaos.mtbf_seconds, down_until.get(n, 0.0)) for n in names]


def failure_probability(dt: float, mtbf_s: float) -> float:
    if dt <= 0 or mtbf_s <= 0:
        return 0.0
    return 1.0 - math.exp(-min(dt, MAX_INTERVAL_S) / mtbf_s)


def pick_victims(
    units: Sequence[ChaosUnit],
    pods: Sequence[PodRef],
    now: float,
    rng: random.Random,
    *,
    last_tick: float,
) -> list[Victim]:
    """Which pods fail between ``last_tick`` and ``now``: at most one per unit, none under repair."""
    victims = []
    dt = now - last_tick
    for unit in sorted(units, key=lambda u: u.name):
        if unit.down_until > now:
            continue
        candidates = sorted(p.name for p in pods if p.unit == unit.name and p.running)
        if not candidates:
            continue
        if rng.random() < failure_probability(dt, unit.mtbf_s):
            victims.append(Victim(unit.name, rng.choice(candidates)))
    return victims


def repaired(down_until: Mapping[str, float], now: float) -> dict[str, float]:
    """The units still under repair at ``now``."""
    return {unit: until for unit, until in down_until.items() if until > now}
