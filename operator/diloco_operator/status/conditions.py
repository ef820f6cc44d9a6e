"""Pure computation of the job's conditions, each from what was observed and the job's phase.

A condition's status says what holds (``QuorumMet`` is False while fewer units than the quorum are
ready, whatever the reason); its reason says why. A job that ``Succeeded`` or is ``Suspended`` has
its learner units (and, suspended, its synchronizer) scaled down on purpose: what is down for that
reason has the reason ``JobSucceeded`` or ``JobSuspended``, never a warning's reason such as
``BelowQuorum``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from diloco_core.protocol import API_PREFIX

from diloco_operator.schema.status import STOPPED_PHASES, Condition, Phase, UnitStatus, iso


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


def stopped_reason(phase: Phase) -> str | None:
    """The reason of what a stopped job scaled down on purpose (None: the job is not stopped)."""
    return f"Job{phase}" if phase in STOPPED_PHASES else None


def stopped_message(phase: Phase) -> str:
    return f"the job is {phase}: its learner units are scaled down on purpose"


ROLLOUT_HALTED = "RolloutHalted"  # UnitsUpToDate's reason: a unit's pods of the new template fail
IMAGE_PULL = "ImagePullFailed"  # a unit's and SynchronizerReady's reason: a pod cannot get its image
STORAGE_CONFLICT = "StorageOwnedByAnotherJob"  # SynchronizerReady's reason: its storage prefix is taken


def sync_condition(
    prev: Sequence[Condition],
    *,
    ready: bool,
    problem: str | None,
    unreachable: str,
    phase: Phase,
    now: datetime,
    conflict: str = "",
    image: str = "",
) -> Condition:
    """``SynchronizerReady``. ``unreachable``: the URL asked that gave no status (an external
    synchronizer, say), named in the message; ``conflict``: why the synchronizer refuses its storage
    prefix (another job owns it); ``image``: why a synchronizer pod cannot get its image. A suspended job's synchronizer is scaled down on purpose; a
    finished job keeps its own (it serves the final model), so that one down is no less a problem."""
    ctype = "SynchronizerReady"
    if problem:
        return condition(prev, ctype, False, "WrongJob", problem, now)
    if conflict and not ready:
        return condition(prev, ctype, False, STORAGE_CONFLICT, conflict, now)
    if image and not ready:
        return condition(prev, ctype, False, IMAGE_PULL, f"synchronizer: {image}", now)
    if ready:
        return condition(prev, ctype, True, "Available", "synchronizer available", now)
    if unreachable:
        message = f"the synchronizer at {unreachable} gives no status (GET {API_PREFIX}/status)"
        return condition(prev, ctype, False, "Unreachable", message, now)
    if phase == "Suspended":
        message = "the job is Suspended: its synchronizer is scaled down on purpose"
        return condition(prev, ctype, False, "JobSuspended", message, now)
    return condition(prev, ctype, False, "NotAvailable", "synchronizer not available", now)


RESTARTING = "UnitsRestarting"  # QuorumMet's reason while the operator's restart alone keeps it False


def quorum_condition(
    prev: Sequence[Condition],
    ready: int,
    total: int,
    quorum: int,
    phase: Phase,
    now: datetime,
    restarting: Sequence[str] = (),
) -> Condition:
    """``QuorumMet``: at least ``quorum`` units fully ready. ``restarting``: the units not ready
    because the operator restarts them for a new pod template; when they alone keep the job below
    quorum, the reason says so (``UnitsRestarting``), not ``BelowQuorum``."""
    counts = f"{ready} of {total} units ready, quorum {quorum}"
    if ready >= quorum:
        return condition(prev, "QuorumMet", True, "Quorum", counts, now)
    stopped = stopped_reason(phase)
    if stopped:
        return condition(prev, "QuorumMet", False, stopped, f"{counts}; {stopped_message(phase)}", now)
    if restarting and ready + len(restarting) >= quorum:
        message = f"{counts}; the operator restarts units {', '.join(restarting)} for their new pod template"
        return condition(prev, "QuorumMet", False, RESTARTING, message, now)
    return condition(prev, "QuorumMet", False, "BelowQuorum", counts, now)


def health_condition(
    prev: Sequence[Condition], gone: Sequence[str], lost_after: float, now: datetime
) -> Condition:
    """``UnitsHealthy``: no unit that was ready once has been down for longer than ``lost_after``."""
    if gone:
        message = f"units down for more than {lost_after:g}s: {', '.join(gone)}"
        return condition(prev, "UnitsHealthy", False, "UnitGone", message, now)
    return condition(prev, "UnitsHealthy", True, "AllUnitsPresent", "no unit is gone", now)


# why a unit's learners are not alive, the worst first, each with its message (units joined in)
NOT_ALIVE = {
    "LearnersDead": "the synchronizer reports the learners of units {} dead",
    "Unschedulable": "the scheduler cannot place the pods of units {}",
    "ImagePullFailed": "the pods of units {} cannot get their image (the units' messages say which and why)",
    "NotRunning": "no pod of units {} is ready",
    "NotHeardFrom": "the synchronizer has not heard from the learners of units {}",
}


def learner_liveness(unit: UnitStatus, has_sync: bool) -> str:
    """Whether a unit's learners are alive: ``Alive`` when one of its pods is ready and the
    synchronizer knows its learners and does not report them dead (a clean leave is no death),
    ``Unknown`` when its pods are ready but the synchronizer's status is not available, else a
    reason of ``NOT_ALIVE``."""
    running = unit.ready_replicas > 0
    if unit.reason == "LearnersDead":
        return "LearnersDead"
    if running and unit.alive_learners is not None:
        return "Alive"
    if running and not has_sync:
        return "Unknown"
    if unit.reason in ("Unschedulable", IMAGE_PULL):
        return unit.reason
    return "NotHeardFrom" if running else "NotRunning"


def learners_condition(
    prev: Sequence[Condition], units: Sequence[UnitStatus], has_sync: bool, phase: Phase, now: datetime
) -> Condition:
    """``LearnersAlive``: every unit's learners run and the synchronizer hears from them
    (``learner_liveness``). False names each unit that is not alive and why. A unit scaled to zero
    (replicas 0) has no learners to be alive: it is left out, and the message names it."""
    ctype = "LearnersAlive"
    liveness = {u.name: learner_liveness(u, has_sync) for u in units if u.replicas > 0}
    parked = [u.name for u in units if u.replicas == 0]
    why = [
        (reason, text.format(", ".join(name for name, seen in liveness.items() if seen == reason)))
        for reason, text in NOT_ALIVE.items()
        if reason in liveness.values()
    ]
    stopped = stopped_reason(phase)
    if stopped and (why or "Unknown" in liveness.values()):
        return condition(prev, ctype, False, stopped, stopped_message(phase), now)
    if why:
        return condition(prev, ctype, False, why[0][0], "; ".join(text for _, text in why), now)
    if "Unknown" in liveness.values():
        message = "the synchronizer's status is not available"
        return condition(prev, ctype, None, "NoSynchronizerStatus", message, now)
    message = "every unit has a ready pod and learners the synchronizer hears from"
    if parked:
        message = f"{message}; units {', '.join(parked)} are scaled to zero (replicas 0)"
    return condition(prev, ctype, True, "Alive", message, now)


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
