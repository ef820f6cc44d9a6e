"""A learner unit's admission by Kueue, read from the Workload that Kueue keeps for its StatefulSet.

Under a queue (``spec.queueName``) each unit's StatefulSet is a Kueue workload of its own: Kueue
admits all its pods or none (a gang), and until then they wait behind a scheduling gate. A unit is
``Admitted`` (its pods may run), ``Queued`` (waiting for quota: Kueue's message says what is
missing) or ``Preempted`` (evicted for a higher-priority workload, back in the queue). Pure: the
Workloads are listed by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

WORKLOAD_API = "kueue.x-k8s.io/v1beta2"
# Kueue's annotation on a Workload naming the object it stands for (the unit's StatefulSet)
OWNER_NAME_ANNOTATION = "kueue.x-k8s.io/job-owner-name"

AdmissionState = Literal["Admitted", "Queued", "Preempted"]


@dataclass(frozen=True)
class Admission:
    state: AdmissionState
    reason: str
    message: str


def _conditions(workload: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("type")): c for c in (workload.get("status") or {}).get("conditions") or []}


def _true(conditions: Mapping[str, Mapping[str, Any]], kind: str) -> bool:
    return conditions.get(kind, {}).get("status") == "True"


def workload_admission(workload: Mapping[str, Any]) -> Admission:
    """What a Workload's conditions say of its admission."""
    conditions = _conditions(workload)
    evicted = next((conditions[k] for k in ("Evicted", "Preempted") if _true(conditions, k)), None)
    if _true(conditions, "Admitted") and evicted is None:
        admitted = conditions["Admitted"]
        return Admission(
            "Admitted", str(admitted.get("reason") or "Admitted"), str(admitted.get("message") or "")
        )
    if evicted is not None:
        return Admission(
            "Preempted",
            str(evicted.get("reason") or "Preempted"),
            str(evicted.get("message") or "evicted by Kueue; waiting to be admitted again"),
        )
    pending = conditions.get("QuotaReserved", {})
    return Admission(
        "Queued",
        str(pending.get("reason") or "Pending"),
        str(pending.get("message") or "waiting in its queue for quota"),
    )


def unit_admissions(
    workloads: Iterable[Mapping[str, Any]], statefulsets: Mapping[str, str]
) -> dict[str, Admission]:
    """Each unit's admission (``statefulsets``: unit name -> its StatefulSet's name), from the newest
    Workload that is not being deleted; a unit without one has none yet (Kueue creates it)."""
    by_owner: dict[str, Mapping[str, Any]] = {}
    for wl in workloads:
        meta = wl.get("metadata") or {}
        owner = (meta.get("annotations") or {}).get(OWNER_NAME_ANNOTATION)
        if not owner or meta.get("deletionTimestamp"):
            continue
        seen = by_owner.get(owner)
        if seen is None or str(meta.get("creationTimestamp", "")) >= str(
            (seen.get("metadata") or {}).get("creationTimestamp", "")
        ):
            by_owner[owner] = wl
    return {
        unit: workload_admission(by_owner[name]) for unit, name in statefulsets.items() if name in by_owner
    }
