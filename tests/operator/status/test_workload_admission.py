"""A unit's admission from the conditions Kueue writes on its Workload."""

from __future__ import annotations

from typing import Any

from diloco_operator.status.admission import OWNER_NAME_ANNOTATION, unit_admissions, workload_admission


def _workload(
    owner: str, *conditions: tuple[str, str, str, str], created: str = "2026-01-01T00:00:00Z", **meta: Any
) -> dict[str, Any]:
    return {
        "metadata": {"annotations": {OWNER_NAME_ANNOTATION: owner}, "creationTimestamp": created, **meta},
        "status": {
            "conditions": [{"type": t, "status": s, "reason": r, "message": m} for t, s, r, m in conditions]
        },
    }


PENDING = (
    "QuotaReserved",
    "False",
    "Pending",
    "couldn't assign flavors to pod set main: insufficient quota for cpu",
)
ADMITTED = ("Admitted", "True", "Admitted", "The workload is admitted")
PREEMPTED = (
    "Evicted",
    "True",
    "Preempted",
    "Preempted to accommodate a workload (UID: 1) due to prioritization",
)


def test_a_workload_waiting_for_quota_is_queued_with_kueues_words() -> None:
    got = workload_admission(_workload("llm-a", PENDING))
    assert (got.state, got.reason) == ("Queued", "Pending")
    assert "insufficient quota for cpu" in got.message
    assert workload_admission({"metadata": {}}).state == "Queued"  # no condition yet


def test_admitted_and_preempted() -> None:
    assert (
        workload_admission(_workload("llm-a", ("QuotaReserved", "True", "QuotaReserved", ""), ADMITTED)).state
        == "Admitted"
    )
    evicted = workload_admission(_workload("llm-a", ADMITTED, PREEMPTED))
    assert (evicted.state, evicted.reason) == ("Preempted", "Preempted")
    assert "prioritization" in evicted.message
    requeued = workload_admission(
        _workload("llm-a", PENDING, ("Preempted", "True", "InClusterQueue", "preempted"))
    )
    assert requeued.state == "Preempted"


def test_each_unit_reads_the_newest_workload_of_its_statefulset() -> None:
    workloads = [
        _workload("llm-a", ADMITTED, created="2026-01-01T00:00:00Z"),
        _workload("llm-a", PENDING, created="2026-01-02T00:00:00Z"),  # the unit made anew: queued again
        _workload("llm-b", ADMITTED, deletionTimestamp="2026-01-02T00:00:00Z"),  # going away
        _workload("other-c", ADMITTED),
        {"metadata": {"name": "not-ours"}},
    ]
    got = unit_admissions(workloads, {"a": "llm-a", "b": "llm-b", "c": "llm-c"})
    assert {unit: a.state for unit, a in got.items()} == {"a": "Queued"}
