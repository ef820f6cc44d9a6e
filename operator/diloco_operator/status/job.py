"""Pure computation of a job's status (phase, conditions, synchronizer summary).

Inputs are what the handler observed (StatefulSets, synchronizer Deployments, the synchronizer's
``GET /v1/status``) and the previous status; time is a parameter. Statuses are typed
(``diloco_operator.schema.status.JobStatus``).

Phases: ``Pending`` (not yet enough units ready), ``Running`` (synchronizer ready and at least
``quorum`` units fully ready), ``Degraded`` (was running, now below quorum or without its
synchronizer), ``Suspended``, ``Succeeded`` (budget reached), ``Failed`` (the spec can never work).
A running job whose units are below quorum only because the operator restarts some of them (for a
new pod template, within ``unitLostAfterSeconds``) stays ``Running``: that is no loss.
Each unit's own status is computed in ``units``, the conditions in ``conditions``, the events in
``events``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from diloco_core.protocol import StatusResponse

from diloco_operator.schema.spec import DiLoCoJobSpec
from diloco_operator.schema.status import ACTIVE_PHASES, STOPPED_PHASES, ChaosStatus, JobStatus, Phase
from diloco_operator.status.conditions import (
    condition,
    health_condition,
    learners_condition,
    quorum_condition,
    scheduled_condition,
    sync_condition,
)
from diloco_operator.status.units import UnitObserved, gone_units, unit_status


@dataclass(frozen=True)
class Observed:
    units: Sequence[UnitObserved]
    sync_ready: bool
    sync: StatusResponse | None = None
    chaos_kills: int = 0
    down_until: Mapping[str, float] = field(default_factory=dict)
    job: str = ""  # the job's name: its learners are its pods, ``<job>-<unit>-<ordinal>``
    sync_problem: str | None = None  # why the synchronizer's answer was not used (a wrong job, say)
    sync_unschedulable: str = ""  # the scheduler's message about a synchronizer pod it cannot place
    sync_unreachable: str = ""  # the synchronizer URL asked that gave no status (without credentials)
    restarting: frozenset[str] = frozenset()  # units whose outdated pods the operator deleted, not yet back
    sync_image: str = ""  # why a synchronizer pod cannot get its image
    sync_conflict: str = ""  # why the synchronizer refuses its storage prefix (another job owns it)


def budget_reached(spec: DiLoCoJobSpec, sync: StatusResponse | None) -> bool:
    if sync is None:
        return False
    if spec.budget.tokens is not None and sync.tokens >= spec.budget.tokens:
        return True
    steps = spec.budget.steps
    return steps is not None and bool(sync.learners) and all(s.step >= steps for s in sync.learners)


def choose_phase(
    spec: DiLoCoJobSpec, obs: Observed, ready_units: int, old_phase: str | None, restarting: int = 0
) -> Phase:
    """``restarting``: the units not ready because the operator restarts them; a running job that
    they alone keep below quorum stays ``Running``."""
    if old_phase == "Succeeded" or budget_reached(spec, obs.sync):
        return "Succeeded"
    if spec.suspend:
        return "Suspended"
    if obs.sync_ready and ready_units >= spec.diloco.quorum:
        return "Running"
    if old_phase == "Running" and obs.sync_ready and ready_units + restarting >= spec.diloco.quorum:
        return "Running"
    if old_phase in ACTIVE_PHASES:
        return "Degraded"
    return "Pending"


def compute_status(
    spec: DiLoCoJobSpec, obs: Observed, old: JobStatus, now: datetime, generation: int | None = None
) -> JobStatus:
    """The job's whole status for a valid spec."""
    old_units = {u.name: u for u in old.units}
    seen = {u.name: u for u in obs.units}
    units = []
    for unit in spec.learner_units:
        observed = seen.get(unit.name, UnitObserved(unit.name, 0, 0, exists=False))
        units.append(unit_status(unit.replicas, observed, old_units.get(unit.name), obs.sync, now, obs.job))
    ready = sum(1 for u in units if u.ready)
    restarting = [u.name for u in units if not u.ready and u.name in obs.restarting]
    phase = choose_phase(spec, obs, ready, old.phase, len(restarting))
    prev = old.conditions
    gone = [] if phase in STOPPED_PHASES else gone_units(units, now, spec.unit_lost_after_seconds)
    units = [u.model_copy(update={"state": "Lost"}) if u.name in gone else u for u in units]
    conditions = [
        condition(prev, "SpecValid", True, "Valid", "the spec is valid", now),
        sync_condition(
            prev,
            ready=obs.sync_ready,
            problem=obs.sync_problem,
            unreachable=obs.sync_unreachable,
            phase=phase,
            now=now,
            conflict=obs.sync_conflict,
            image=obs.sync_image,
        ),
        quorum_condition(prev, ready, len(units), spec.diloco.quorum, phase, now, restarting),
        health_condition(prev, gone, spec.unit_lost_after_seconds, now),
        learners_condition(prev, units, obs.sync is not None, phase, now),
        scheduled_condition(prev, units, obs.sync_unschedulable, now),
        condition(prev, "Ready", phase == "Running", phase, f"job is {phase}", now),
    ]
    optional: dict[str, Any] = {"observed_generation": generation} if generation is not None else {}
    return JobStatus(
        phase=phase,
        message=obs.sync_conflict or None,  # None removes a stored one; a conflict waits for the user
        conditions=tuple(conditions),
        units=tuple(units),
        ready_units=ready,
        total_units=len(units),
        units_ready=f"{ready}/{len(units)}",
        chaos=ChaosStatus(kills=obs.chaos_kills, down_until=dict(obs.down_until)),
        **optional,
        **sync_summary(obs.sync),
    )


def sync_summary(sync: StatusResponse | None) -> dict[str, Any]:
    """The job-wide progress fields of the status (none without the synchronizer's status: the
    stored ones stay). ``version`` is the newest global version of any fragment, absent while no
    fragment has one (0 is the initial parameters)."""
    if sync is None:
        return {}
    versions = [f.version for f in sync.fragments if f.version >= 0]  # -1: no parameters yet
    out: dict[str, Any] = {
        "rounds": sync.rounds,
        "tokens": sync.tokens,
        "version": max(versions) if versions else None,  # None removes a stored one
    }
    if sync.goodput is not None:
        out["goodput"] = sync.goodput
    return out


def invalid_status(message: str, old: JobStatus, now: datetime, generation: int | None) -> JobStatus:
    """The status of a job whose spec can never work: Failed, why, and nothing left of the units'
    readiness (no longer followed, it would only grow stale)."""
    prev = old.conditions
    optional: dict[str, Any] = {"observed_generation": generation} if generation is not None else {}
    return JobStatus(
        phase="Failed",
        message=message,
        conditions=(
            condition(prev, "SpecValid", False, "InvalidSpec", message, now),
            condition(prev, "Ready", False, "Failed", message, now),
        ),
        units=(),
        units_ready=None,
        ready_units=None,
        total_units=None,
        **optional,
    )
