"""Pure computation of a job's status (phase, conditions, per-unit progress) and of its events.

Inputs are what the handler observed (StatefulSets, synchronizer Deployments, the synchronizer's
``GET /v1/status``) and the previous status; time is a parameter.

Phases: ``Pending`` (not yet enough units ready), ``Running`` (synchronizer ready and at least
``quorum`` units fully ready), ``Degraded`` (was running, now below quorum or without its
synchronizer), ``Suspended``, ``Succeeded`` (budget reached), ``Failed`` (the spec can never work).

A unit is ready when all its pods are ready and the synchronizer does not report its learners dead
(pods can be ready while their learner cannot reach the synchronizer, across regions say). Each
unit's ``state`` is ``Ready``, ``NotReady`` or ``Lost`` (it was ready once and has been down for
longer than ``unitLostAfterSeconds``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from diloco_core.protocol import StatusResponse

from diloco_operator.models import DiLoCoJobSpec

ACTIVE_PHASES = ("Running", "Degraded")


@dataclass(frozen=True)
class UnitObserved:
    """A learner unit's StatefulSet as observed (absent: ``exists`` False)."""

    name: str
    replicas: int
    ready_replicas: int
    exists: bool = True


@dataclass(frozen=True)
class Observed:
    units: Sequence[UnitObserved]
    sync_ready: bool
    sync: StatusResponse | None = None
    chaos_kills: int = 0
    down_until: Mapping[str, float] = field(default_factory=dict)
    job: str = ""  # the job's name: its learners are its pods, ``<job>-<unit>-<ordinal>``
    sync_problem: str | None = None  # why the synchronizer's answer was not used (a wrong job, say)


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
        "regarding": {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": meta["name"],
                      "namespace": meta["namespace"], "uid": meta.get("uid", "")},
    }


def parse_iso(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def condition(
    previous: Sequence[Mapping[str, Any]], ctype: str, ok: bool | None, reason: str, message: str, now: datetime
) -> dict[str, Any]:
    """A condition (``ok`` None: Unknown); its lastTransitionTime moves only when its status changes."""
    status = "Unknown" if ok is None else "True" if ok else "False"
    since = iso(now)
    for old in previous:
        if old.get("type") == ctype and old.get("status") == status and old.get("lastTransitionTime"):
            since = str(old["lastTransitionTime"])
    return {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}


def unit_progress(sync: StatusResponse | None, unit: str, job: str = "") -> dict[str, Any]:
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
        "aliveLearners": sum(1 for s in mine if s.alive),
        "deadLearners": sum(1 for s in mine if s.state == "dead"),
    }


def learners_dead(progress: Mapping[str, Any]) -> bool:
    """The synchronizer knows the unit's learners, none is alive and at least one is dead."""
    return bool(progress) and progress["aliveLearners"] == 0 and progress["deadLearners"] > 0


def unit_status(
    spec_unit_replicas: int, seen: UnitObserved, old: Mapping[str, Any], sync: StatusResponse | None, now: datetime,
    job: str = "",
) -> dict[str, Any]:
    pods_ready = seen.exists and spec_unit_replicas > 0 and seen.ready_replicas >= spec_unit_replicas
    progress = unit_progress(sync, seen.name, job)
    dead = learners_dead(progress)
    ready = pods_ready and not dead
    out: dict[str, Any] = {
        "name": seen.name,
        "replicas": spec_unit_replicas,
        "readyReplicas": seen.ready_replicas if seen.exists else 0,
        "ready": ready,
        "state": "Ready" if ready else "NotReady",
        "reason": "Ready" if ready else "LearnersDead" if dead else "PodsNotReady",
        "everReady": bool(ready or old.get("everReady", False)),
    }
    if not ready:
        out["notReadySince"] = old.get("notReadySince") or iso(now)
    out.update(progress)
    return out


UNIT_STATES = {"Ready": "ready", "NotReady": "not_ready", "Lost": "lost"}


def unit_state_counts(status: Mapping[str, Any]) -> dict[str, int]:
    """How many of the job's units are in each state, keyed as the metric labels them."""
    counts = dict.fromkeys(UNIT_STATES.values(), 0)
    for u in status.get("units") or []:
        label = UNIT_STATES.get(str(u.get("state")))
        if label is not None:
            counts[label] += 1
    return counts


def budget_reached(spec: DiLoCoJobSpec, sync: StatusResponse | None) -> bool:
    if sync is None:
        return False
    if spec.budget.tokens is not None and sync.tokens >= spec.budget.tokens:
        return True
    steps = spec.budget.steps
    return steps is not None and bool(sync.learners) and all(s.step >= steps for s in sync.learners)


def choose_phase(spec: DiLoCoJobSpec, obs: Observed, ready_units: int, old_phase: str | None) -> str:
    if old_phase == "Succeeded" or budget_reached(spec, obs.sync):
        return "Succeeded"
    if spec.suspend:
        return "Suspended"
    if obs.sync_ready and ready_units >= spec.diloco.quorum:
        return "Running"
    if old_phase in ACTIVE_PHASES:
        return "Degraded"
    return "Pending"


def gone_units(units: Sequence[Mapping[str, Any]], now: datetime, lost_after: float) -> list[str]:
    """Units that were ready once and have been down for longer than ``lost_after`` seconds."""
    out = []
    for u in units:
        since = u.get("notReadySince")
        if u.get("everReady") and since and (now - parse_iso(since)).total_seconds() > lost_after:
            out.append(str(u["name"]))
    return out


def compute_status(
    spec: DiLoCoJobSpec, obs: Observed, old: Mapping[str, Any], now: datetime, generation: int | None = None
) -> dict[str, Any]:
    """The job's whole status for a valid spec."""
    old_units = {u.get("name"): u for u in old.get("units") or []}
    seen = {u.name: u for u in obs.units}
    units = []
    for unit in spec.learner_units:
        observed = seen.get(unit.name, UnitObserved(unit.name, 0, 0, exists=False))
        units.append(unit_status(unit.replicas, observed, old_units.get(unit.name, {}), obs.sync, now, obs.job))
    ready = sum(1 for u in units if u["ready"])
    phase = choose_phase(spec, obs, ready, old.get("phase"))
    prev = old.get("conditions") or []
    gone = gone_units(units, now, spec.unit_lost_after_seconds)
    for u in units:
        if u["name"] in gone:
            u["state"] = "Lost"
    quorum = spec.diloco.quorum
    conditions = [
        condition(prev, "SpecValid", True, "Valid", "the spec is valid", now),
        sync_condition(prev, obs, now),
        condition(prev, "QuorumMet", ready >= quorum, "Quorum" if ready >= quorum else "BelowQuorum",
                  f"{ready} of {len(units)} units ready, quorum {quorum}", now),
        condition(prev, "UnitsHealthy", not gone, "UnitGone" if gone else "AllUnitsPresent",
                  f"units down for more than {spec.unit_lost_after_seconds:g}s: {', '.join(gone)}" if gone
                  else "no unit is gone", now),
        learners_condition(prev, obs.sync, units, now),
        condition(prev, "Ready", phase == "Running", phase, f"job is {phase}", now),
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "units": units,
        "readyUnits": ready,
        "totalUnits": len(units),
        "unitsReady": f"{ready}/{len(units)}",
        "chaos": {"kills": obs.chaos_kills, "downUntil": dict(obs.down_until)},
    }
    if generation is not None:
        status["observedGeneration"] = generation
    status.update(sync_summary(obs.sync))
    return status


def sync_condition(prev: Sequence[Mapping[str, Any]], obs: Observed, now: datetime) -> dict[str, Any]:
    if obs.sync_problem:
        return condition(prev, "SynchronizerReady", False, "WrongJob", obs.sync_problem, now)
    return condition(prev, "SynchronizerReady", obs.sync_ready, "Available" if obs.sync_ready else "NotAvailable",
                     "synchronizer available" if obs.sync_ready else "synchronizer not available", now)


def learners_condition(
    prev: Sequence[Mapping[str, Any]], sync: StatusResponse | None, units: Sequence[Mapping[str, Any]], now: datetime
) -> dict[str, Any]:
    """Whether the synchronizer hears from every unit it knows (Unknown without its status)."""
    if sync is None:
        return condition(prev, "LearnersAlive", None, "NoSynchronizerStatus",
                         "the synchronizer's status is not available", now)
    dead = [str(u["name"]) for u in units if u.get("reason") == "LearnersDead"]
    if dead:
        return condition(prev, "LearnersAlive", False, "LearnersDead",
                         f"the synchronizer reports the learners of units {', '.join(dead)} dead", now)
    return condition(prev, "LearnersAlive", True, "Alive", "no unit's learners are dead", now)


def sync_summary(sync: StatusResponse | None) -> dict[str, Any]:
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


def invalid_status(message: str, old: Mapping[str, Any], now: datetime, generation: int | None) -> dict[str, Any]:
    prev = old.get("conditions") or []
    status: dict[str, Any] = {
        "phase": "Failed",
        "message": message,
        "conditions": [
            condition(prev, "SpecValid", False, "InvalidSpec", message, now),
            condition(prev, "Ready", False, "Failed", message, now),
        ],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def diff_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
    """Events for what changed between two statuses: quorum lost and regained, units gone, phase.

    Units lost and rejoined are reported as they happen by ``PodWatch`` (status refreshes are
    periodic and would miss a pod that is replaced within seconds).
    """
    events: list[Event] = []
    was, now = _cond(old, "QuorumMet"), _cond(new, "QuorumMet")
    if was == "True" and now == "False":
        events.append(Event("Warning", "QuorumLost", _msg(new, "QuorumMet")))
    elif was == "False" and now == "True" and old.get("phase") in ACTIVE_PHASES:
        events.append(Event("Normal", "QuorumRegained", _msg(new, "QuorumMet")))
    if _cond(old, "UnitsHealthy") != "False" and _cond(new, "UnitsHealthy") == "False":
        events.append(Event("Warning", "UnitGone", _msg(new, "UnitsHealthy")))
    newly_dead = [u for u in _dead_units(new) if u not in _dead_units(old)]
    if newly_dead:
        events.append(Event("Warning", "LearnersDead",
                            f"the synchronizer reports the learners of units {', '.join(newly_dead)} dead"))
    if old.get("phase") != new.get("phase") and new.get("phase") in ("Succeeded", "Suspended", "Running"):
        events.append(Event("Normal", str(new["phase"]), f"job is {new['phase']}"))
    return events


def _dead_units(status: Mapping[str, Any]) -> list[str]:
    return [str(u.get("name")) for u in status.get("units") or [] if u.get("reason") == "LearnersDead"]


def _cond(status: Mapping[str, Any], ctype: str) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == ctype:
            return str(c.get("status"))
    return None


def _msg(status: Mapping[str, Any], ctype: str) -> str:
    for c in status.get("conditions") or []:
        if c.get("type") == ctype:
            return str(c.get("message", ""))
    return ""


class PodWatch:
    """Reports a learner unit losing a pod (failed or no longer ready) and the replacement rejoining.

    Fed with every learner pod event, so a pod that is replaced within a second is still seen.
    A StatefulSet's replacement pod has the same name, which ties the two reports together.
    Deleting a healthy pod (scaling, suspend) is not a loss. The memory is per operator process.
    """

    def __init__(self) -> None:
        self._pods: dict[str, tuple[bool, bool]] = {}  # ready, lost

    def observe(self, key: str, unit: str, *, phase: str, ready: bool, deleted: bool) -> Event | None:
        was_ready, lost = self._pods.get(key, (False, False))
        pod = key.rsplit("/", 1)[-1]
        event = None
        if not lost and (phase == "Failed" or (was_ready and not ready and not deleted)):
            lost = True
            why = "failed" if phase == "Failed" else "is no longer ready"
            event = Event("Warning", "UnitLost", f"learner unit {unit}: pod {pod} {why}")
        elif lost and ready and phase == "Running" and not deleted:
            lost = False
            event = Event("Normal", "UnitRejoined", f"learner unit {unit}: pod {pod} is back and ready")
        if deleted and not lost:
            self._pods.pop(key, None)
        else:
            self._pods[key] = (ready and not deleted, lost)
        return event
