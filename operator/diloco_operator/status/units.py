"""Pure computation of each learner unit's status.

A unit is ready when all its pods are ready and the synchronizer does not report its learners dead
(pods can be ready while their learner cannot reach the synchronizer, across regions say). Each
unit's ``state`` is ``Ready``, ``NotReady`` or ``Lost`` (it was ready once and has been down for
longer than ``unitLostAfterSeconds``); a unit whose pods the scheduler cannot place says so
(reason ``Unschedulable``, with the scheduler's message), and so does the job's ``PodsScheduled``
condition; one whose pods cannot get their image says which image and why (``ImagePullFailed``).
Under a Kueue queue a unit not admitted says so (``Queued`` or ``Preempted``, with Kueue's reason
and message) and is never ``Lost``: it waits for quota, and Kueue brings it back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from diloco_core.protocol import StatusResponse

from diloco_operator.schema.status import JobStatus, UnitReason, UnitStatus, iso, parse_iso
from diloco_operator.status.admission import Admission


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
    image_problem: str = ""  # why one of its pods cannot get its image
    admission: Admission | None = None  # Kueue's admission of it (None: not under a queue, or not yet)


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
    waiting = seen.admission if seen.admission is not None and seen.admission.state != "Admitted" else None
    queued: UnitReason | None = None
    if waiting is not None:
        queued = "Queued" if waiting.state == "Queued" else "Preempted"
    reason: UnitReason = (
        "Ready"
        if ready
        else "LearnersDead"
        if dead
        else queued
        if queued is not None
        else "Unschedulable"
        if seen.unschedulable
        else "ImagePullFailed"
        if seen.image_problem
        else "PodsNotReady"
    )
    if waiting is not None and reason == queued:
        since["message"] = f"{waiting.reason}: {waiting.message}"
    if reason == "Unschedulable":
        since["message"] = seen.unschedulable
    if reason == "ImagePullFailed":
        since["message"] = seen.image_problem
    if seen.admission is not None:
        since["admission"] = seen.admission.state
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


def gone_units(units: Sequence[UnitStatus], now: datetime, lost_after: float) -> list[str]:
    """Units that were ready once and have been down for longer than ``lost_after`` seconds (one
    that waits in its queue, queued or preempted, is not lost: Kueue brings it back)."""
    out = []
    for u in units:
        since = u.not_ready_since
        if u.admission in ("Queued", "Preempted"):
            continue
        if u.ever_ready and since and (now - parse_iso(since)).total_seconds() > lost_after:
            out.append(u.name)
    return out
