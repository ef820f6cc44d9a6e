"""Pure computation of a job's status (phase, conditions, per-unit progress) and of its events.

Inputs are what the handler observed (StatefulSets, synchronizer Deployments, the synchronizer's
``GET /v1/status``) and the previous status; time is a parameter. Statuses are typed
(``job_status.JobStatus``).

Phases: ``Pending`` (not yet enough units ready), ``Running`` (synchronizer ready and at least
``quorum`` units fully ready), ``Degraded`` (was running, now below quorum or without its
synchronizer), ``Suspended``, ``Succeeded`` (budget reached), ``Failed`` (the spec can never work).

A unit is ready when all its pods are ready and the synchronizer does not report its learners dead
(pods can be ready while their learner cannot reach the synchronizer, across regions say). Each
unit's ``state`` is ``Ready``, ``NotReady`` or ``Lost`` (it was ready once and has been down for
longer than ``unitLostAfterSeconds``); a unit whose pods the scheduler cannot place says so
(reason ``Unschedulable``, with the scheduler's message), and so does the job's ``PodsScheduled``
condition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from diloco_core.protocol import StatusResponse

from diloco_operator.job_status import ChaosStatus, Condition, JobStatus, Phase, UnitReason, UnitStatus
from diloco_operator.models import DiLoCoJobSpec

ACTIVE_PHASES = ("Running", "Degraded")
# phases in which the operator scales the learner units down on purpose: units down are no loss
STOPPED_PHASES = ("Succeeded", "Suspended")


@dataclass(frozen=True)
class UnitObserved:
    """A learner unit's pods as observed (none: ``exists`` False).

    ``unschedulable`` is the scheduler's message about one of its pods that cannot be placed
    ("0/4 nodes are available: ..."), empty when every pod found a node.
    """

    name: str
    replicas: int
    ready_replicas: int
    exists: bool = True
    unschedulable: str = ""


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


@dataclass(frozen=True)
class Event:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


EVENT_NOTE_LIMIT = 1024  # the API rejects longer notes
REPORTING_CONTROLLER = "diloco.dev/operator"


def event_object(job: Mapping[str, Any], ev: Event, now: datetime, instance: str) -> dict[str, Any]:
    """The ``events.k8s.io/v1`` Event that reports ``ev`` about ``job`` (a DiLoCoJob body).

    ``kubectl describe`` and ``kubectl get events`` show it on the job (``regarding``).
    """
    meta = job["metadata"]
    note = ev.message if len(ev.message) <= EVENT_NOTE_LIMIT else ev.message[: EVENT_NOTE_LIMIT - 3] + "..."
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}-", "namespace": meta["namespace"]},
        "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "type": ev.type,
        "reason": ev.reason,
        "note": note,
        "action": "Reconcile",
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:128],
        "regarding": {
            "apiVersion": job["apiVersion"],
            "kind": job["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
    }


def parse_iso(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def condition(
    previous: Sequence[Condition], ctype: str, ok: bool | None, reason: str, message: str, now: datetime
) -> Condition:
    """A condition (``ok`` None: Unknown); its lastTransitionTime moves only when its status changes."""
    status = "Unknown" if ok is None else "True" if ok else "False"
    since = iso(now)
    for old in previous:
        if old.type == ctype and old.status == status and old.last_transition_time:
            since = old.last_transition_time
    return Condition(type=ctype, status=status, reason=reason, message=message, last_transition_time=since)


def unit_progress(sync: StatusResponse | None, unit: str, job: str = "") -> dict[str, int]:
    """Step, tokens and staleness of the unit's learners, as the synchronizer reports them.

    With ``job``, only learners named ``<job>-<unit>-<ordinal>`` count: an external synchronizer
    also serves the units of other regions, which may use the same unit names.
    """
    if sync is None:
        return {}
    prefix = f"{job}-{unit}-" if job else ""
    mine = [s for s in sync.learners if s.unit == unit and s.learner_id.startswith(prefix)]
    if not mine:
        return {}
    return {
        "step": max(s.step for s in mine),
        "tokens": sum(s.tokens for s in mine),
        "staleness": max(s.staleness for s in mine),
        "alive_learners": sum(1 for s in mine if s.alive),
        "dead_learners": sum(1 for s in mine if s.state == "dead"),
    }


def learners_dead(progress: Mapping[str, int]) -> bool:
    """The synchronizer knows the unit's learners, none is alive and at least one is dead."""
    return bool(progress) and progress["alive_learners"] == 0 and progress["dead_learners"] > 0


def unit_status(
    spec_unit_replicas: int,
    seen: UnitObserved,
    old: UnitStatus | None,
    sync: StatusResponse | None,
    now: datetime,
    job: str = "",
) -> UnitStatus:
    pods_ready = seen.exists and spec_unit_replicas > 0 and seen.ready_replicas >= spec_unit_replicas
    progress = unit_progress(sync, seen.name, job)
    dead = learners_dead(progress)
    ready = pods_ready and not dead
    since: dict[str, Any] = {}
    if not ready:
        since["not_ready_since"] = (old.not_ready_since if old else None) or iso(now)
    reason: UnitReason = (
        "Ready"
        if ready
        else "LearnersDead"
        if dead
        else "Unschedulable"
        if seen.unschedulable
        else "PodsNotReady"
    )
    if reason == "Unschedulable":
        since["message"] = seen.unschedulable
    return UnitStatus(
        name=seen.name,
        replicas=spec_unit_replicas,
        ready_replicas=seen.ready_replicas if seen.exists else 0,
        ready=ready,
        state="Ready" if ready else "NotReady",
        reason=reason,
        ever_ready=bool(ready or (old is not None and old.ever_ready)),
        **since,
        **progress,
    )


UNIT_STATES = {"Ready": "ready", "NotReady": "not_ready", "Lost": "lost"}


def unit_state_counts(status: JobStatus) -> dict[str, int]:
    """How many of the job's units are in each state, keyed as the metric labels them."""
    counts = dict.fromkeys(UNIT_STATES.values(), 0)
    for u in status.units:
        counts[UNIT_STATES[u.state]] += 1
    return counts


def budget_reached(spec: DiLoCoJobSpec, sync: StatusResponse | None) -> bool:
    if sync is None:
        return False
    if spec.budget.tokens is not None and sync.tokens >= spec.budget.tokens:
        return True
    steps = spec.budget.steps
    return steps is not None and bool(sync.learners) and all(s.step >= steps for s in sync.learners)


def choose_phase(spec: DiLoCoJobSpec, obs: Observed, ready_units: int, old_phase: str | None) -> Phase:
    if old_phase == "Succeeded" or budget_reached(spec, obs.sync):
        return "Succeeded"
    if spec.suspend:
        return "Suspended"
    if obs.sync_ready and ready_units >= spec.diloco.quorum:
        return "Running"
    if old_phase in ACTIVE_PHASES:
        return "Degraded"
    return "Pending"


def gone_units(units: Sequence[UnitStatus], now: datetime, lost_after: float) -> list[str]:
    """Units that were ready once and have been down for longer than ``lost_after`` seconds."""
    out = []
    for u in units:
        since = u.not_ready_since
        if u.ever_ready and since and (now - parse_iso(since)).total_seconds() > lost_after:
            out.append(u.name)
    return out


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
    phase = choose_phase(spec, obs, ready, old.phase)
    prev = old.conditions
    gone = [] if phase in STOPPED_PHASES else gone_units(units, now, spec.unit_lost_after_seconds)
    units = [u.model_copy(update={"state": "Lost"}) if u.name in gone else u for u in units]
    quorum = spec.diloco.quorum
    conditions = [
        condition(prev, "SpecValid", True, "Valid", "the spec is valid", now),
        sync_condition(prev, obs, now),
        condition(
            prev,
            "QuorumMet",
            ready >= quorum,
            "Quorum" if ready >= quorum else "BelowQuorum",
            f"{ready} of {len(units)} units ready, quorum {quorum}",
            now,
        ),
        condition(
            prev,
            "UnitsHealthy",
            not gone,
            "UnitGone" if gone else "AllUnitsPresent",
            f"units down for more than {spec.unit_lost_after_seconds:g}s: {', '.join(gone)}"
            if gone
            else "no unit is gone",
            now,
        ),
        learners_condition(prev, obs.sync, units, now),
        scheduled_condition(prev, units, obs.sync_unschedulable, now),
        condition(prev, "Ready", phase == "Running", phase, f"job is {phase}", now),
    ]
    optional: dict[str, Any] = {"observed_generation": generation} if generation is not None else {}
    return JobStatus(
        phase=phase,
        conditions=tuple(conditions),
        units=tuple(units),
        ready_units=ready,
        total_units=len(units),
        units_ready=f"{ready}/{len(units)}",
        chaos=ChaosStatus(kills=obs.chaos_kills, down_until=dict(obs.down_until)),
        **optional,
        **sync_summary(obs.sync),
    )


def sync_condition(prev: Sequence[Condition], obs: Observed, now: datetime) -> Condition:
    if obs.sync_problem:
        return condition(prev, "SynchronizerReady", False, "WrongJob", obs.sync_problem, now)
    return condition(
        prev,
        "SynchronizerReady",
        obs.sync_ready,
        "Available" if obs.sync_ready else "NotAvailable",
        "synchronizer available" if obs.sync_ready else "synchronizer not available",
        now,
    )


def learners_condition(
    prev: Sequence[Condition], sync: StatusResponse | None, units: Sequence[UnitStatus], now: datetime
) -> Condition:
    """Whether the synchronizer hears from every unit it knows (Unknown without its status)."""
    if sync is None:
        return condition(
            prev,
            "LearnersAlive",
            None,
            "NoSynchronizerStatus",
            "the synchronizer's status is not available",
            now,
        )
    dead = [u.name for u in units if u.reason == "LearnersDead"]
    if dead:
        return condition(
            prev,
            "LearnersAlive",
            False,
            "LearnersDead",
            f"the synchronizer reports the learners of units {', '.join(dead)} dead",
            now,
        )
    return condition(prev, "LearnersAlive", True, "Alive", "no unit's learners are dead", now)


def scheduled_condition(
    prev: Sequence[Condition], units: Sequence[UnitStatus], sync_unschedulable: str, now: datetime
) -> Condition:
    """Whether every pod of the job found a node; False names each unit (and the synchronizer) the
    scheduler cannot place, with its message ("0/4 nodes are available: ...")."""
    waiting = [f"unit {u.name}: {u.message}" for u in units if u.reason == "Unschedulable"]
    if sync_unschedulable:
        waiting.append(f"synchronizer: {sync_unschedulable}")
    if waiting:
        return condition(prev, "PodsScheduled", False, "Unschedulable", "; ".join(waiting), now)
    return condition(prev, "PodsScheduled", True, "Scheduled", "no pod of the job waits for a node", now)


def sync_summary(sync: StatusResponse | None) -> dict[str, Any]:
    """The job-wide progress fields of the status (none without the synchronizer's status: the
    stored ones stay)."""
    if sync is None:
        return {}
    out: dict[str, Any] = {
        "rounds": sync.rounds,
        "tokens": sync.tokens,
        "version": max((f.version for f in sync.fragments), default=-1),
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


def diff_events(old: JobStatus, new: JobStatus) -> list[Event]:
    """Events for what changed between two statuses: quorum lost and regained, units gone, pods the
    scheduler cannot place, phase.

    A job that Succeeded or is Suspended has its units scaled down on purpose: no warning for that.

    Units lost and rejoined are reported as they happen by ``pods.PodWatch`` (a pod replaced within
    a second may never show in a status).
    """
    events: list[Event] = []
    was, now = _cond(old, "QuorumMet"), _cond(new, "QuorumMet")
    stopped = new.phase in STOPPED_PHASES  # its units are scaled down on purpose
    if was == "True" and now == "False" and not stopped:
        events.append(Event("Warning", "QuorumLost", _msg(new, "QuorumMet")))
    elif was == "False" and now == "True" and old.phase in ACTIVE_PHASES:
        events.append(Event("Normal", "QuorumRegained", _msg(new, "QuorumMet")))
    if _cond(old, "UnitsHealthy") != "False" and _cond(new, "UnitsHealthy") == "False":
        events.append(Event("Warning", "UnitGone", _msg(new, "UnitsHealthy")))
    newly_dead = [u for u in _dead_units(new) if u not in _dead_units(old)]
    if newly_dead and not stopped:
        events.append(
            Event(
                "Warning",
                "LearnersDead",
                f"the synchronizer reports the learners of units {', '.join(newly_dead)} dead",
            )
        )
    events += unschedulable_events(old, new)
    if old.phase != new.phase and new.phase in ("Succeeded", "Suspended", "Running"):
        events.append(Event("Normal", str(new.phase), f"job is {new.phase}"))
    return events


def unschedulable_events(old: JobStatus, new: JobStatus) -> list[Event]:
    """A Warning when pods of the job cannot be placed: once when it starts, and again for each unit
    that joins the ones waiting (never on every status refresh)."""
    if _cond(new, "PodsScheduled") != "False":
        return []
    if _cond(old, "PodsScheduled") != "False":
        return [Event("Warning", "Unschedulable", _msg(new, "PodsScheduled"))]
    before = {u.name for u in old.units if u.reason == "Unschedulable"}
    newly = [u for u in new.units if u.reason == "Unschedulable" and u.name not in before]
    if newly:
        return [Event("Warning", "Unschedulable", "; ".join(f"unit {u.name}: {u.message}" for u in newly))]
    return []


def _dead_units(status: JobStatus) -> list[str]:
    return [u.name for u in status.units if u.reason == "LearnersDead"]


def _cond(status: JobStatus, ctype: str) -> str | None:
    c = status.condition(ctype)
    return c.status if c else None


def _msg(status: JobStatus, ctype: str) -> str:
    c = status.condition(ctype)
    return c.message if c else ""
