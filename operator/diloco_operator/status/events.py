"""The events a change of status posts on the job, and the Event objects that carry them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from diloco_operator.schema.status import ACTIVE_PHASES, STOPPED_PHASES, JobStatus
from diloco_operator.status.conditions import IMAGE_PULL, RESTARTING, ROLLOUT_HALTED, STORAGE_CONFLICT


@dataclass(frozen=True)
class Event:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


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


def diff_events(old: JobStatus, new: JobStatus) -> list[Event]:
    """Events for what changed between two statuses: quorum lost and regained, units gone, pods the
    scheduler cannot place, a synchronizer refusing a storage prefix of another job, phase.

    A job that Succeeded or is Suspended has its units scaled down on purpose: no warning for that.
    Nor for units the operator restarts for a new pod template (``QuorumMet`` False with the reason
    ``UnitsRestarting``, announced by the Normal event ``UnitRestart``): ``QuorumLost`` comes only
    if the job is still below quorum once the restart had ``unitLostAfterSeconds`` to come back, and
    no ``QuorumRegained`` follows a restart that came back in time.

    Units lost and rejoined are reported as they happen by ``pods.PodWatch`` (a pod replaced within
    a second may never show in a status).
    """
    events: list[Event] = []
    was, now = _cond(old, "QuorumMet"), _cond(new, "QuorumMet")
    stopped = new.phase in STOPPED_PHASES  # its units are scaled down on purpose
    restart_was = old.phase in ACTIVE_PHASES and _reason(old, "QuorumMet") == RESTARTING
    if (was == "True" or restart_was) and _reason(new, "QuorumMet") == "BelowQuorum" and not stopped:
        events.append(Event("Warning", "QuorumLost", _msg(new, "QuorumMet")))
    elif was == "False" and now == "True" and old.phase in ACTIVE_PHASES and not restart_was:
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
    events += image_pull_events(old, new)
    if _reason(new, "SynchronizerReady") == STORAGE_CONFLICT != _reason(old, "SynchronizerReady"):
        events.append(Event("Warning", STORAGE_CONFLICT, _msg(new, "SynchronizerReady")))
    if _reason(new, "UnitsUpToDate") == ROLLOUT_HALTED != _reason(old, "UnitsUpToDate"):
        events.append(Event("Warning", ROLLOUT_HALTED, _msg(new, "UnitsUpToDate")))
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


def image_pull_events(old: JobStatus, new: JobStatus) -> list[Event]:
    """A Warning naming the image, for each unit (and the synchronizer) that starts failing to get its
    image (never on every status refresh while it goes on failing)."""
    before = {u.name for u in old.units if u.reason == IMAGE_PULL}
    notes = [
        f"unit {u.name}: {u.message}" for u in new.units if u.reason == IMAGE_PULL and u.name not in before
    ]
    if _reason(new, "SynchronizerReady") == IMAGE_PULL != _reason(old, "SynchronizerReady"):
        notes.append(_msg(new, "SynchronizerReady"))
    return [Event("Warning", IMAGE_PULL, note) for note in notes]


def _dead_units(status: JobStatus) -> list[str]:
    return [u.name for u in status.units if u.reason == "LearnersDead"]


def _cond(status: JobStatus, ctype: str) -> str | None:
    c = status.condition(ctype)
    return c.status if c else None


def _reason(status: JobStatus, ctype: str) -> str | None:
    c = status.condition(ctype)
    return c.reason if c else None


def _msg(status: JobStatus, ctype: str) -> str:
    c = status.condition(ctype)
    return c.message if c else ""
