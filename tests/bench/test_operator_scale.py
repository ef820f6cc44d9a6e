"""The operator benchmark's accounting: when counts are reached, lags, going back, its reality."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from diloco_bench.operator_cluster import job_manifest
from diloco_bench.operator_scale import victims
from diloco_bench.operator_watch import JobStatus, PodReality, Timeline, lags


def timeline(*points: tuple[float, int]) -> Timeline:
    t = Timeline()
    for time, count in points:
        t.add(time, count)
    return t


def test_a_timeline_keeps_changes_and_counts_the_times_it_went_back() -> None:
    t = timeline((0.0, 0), (1.0, 0), (2.0, 15), (3.0, 0), (4.0, 40), (9.0, 30), (10.0, 40))
    assert t.points == [(0.0, 0), (2.0, 15), (3.0, 0), (4.0, 40), (9.0, 30), (10.0, 40)]
    assert t.first_at_least(40) == 4.0
    assert t.first_at_least(40, after=5.0) == 10.0
    assert t.first_below(40, after=5.0) == 9.0
    assert t.backwards(until=4.0) == 1  # 15 -> 0 while the job was created
    assert t.backwards(until=10.0) == 2


def test_lag_is_per_count_reached() -> None:
    reality = timeline((0.0, 0), (1.0, 1), (2.0, 3))
    status = timeline((0.0, 0), (1.5, 2), (6.0, 3))
    assert lags(reality, status, 3) == [0.5, -0.5, 4.0]  # the status may show 2 before reality's event
    assert lags(reality, timeline((0.0, 0)), 3) == []


def pod(name: str, unit: str, ready: bool, deleting: bool = False) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {"diloco.dev/unit": unit},
            "deletionTimestamp": "now" if deleting else None,
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_reality_counts_units_whose_pods_are_all_ready() -> None:
    r = PodReality(pods_per_unit=2)
    r.on_event(0.1, pod("j-a-0", "a", True), "ADDED")
    r.on_event(0.2, pod("j-a-1", "a", True), "MODIFIED")
    r.on_event(0.3, pod("j-b-0", "b", True), "MODIFIED")
    r.on_event(0.4, pod("j-a-1", "a", True, deleting=True), "MODIFIED")
    r.on_event(0.5, pod("j-a-1", "a", False), "DELETED")
    r.on_event(0.6, pod("j-a-1", "a", True), "ADDED")
    assert r.timeline.points == [(0.1, 0), (0.2, 1), (0.4, 0), (0.6, 1)]


def test_the_job_has_the_units_and_pods_asked_for() -> None:
    spec = job_manifest(100, 8)["spec"]
    assert len(spec["learnerUnits"]) == 100
    assert {u["replicas"] for u in spec["learnerUnits"]} == {8}


def test_the_job_status_counts_the_events_that_carry_ready_units() -> None:
    s = JobStatus()
    s.on_event(0.1, {"status": {}}, "ADDED")
    s.on_event(0.2, {"status": {"readyUnits": 1}}, "MODIFIED")
    s.on_event(0.3, {"status": {"readyUnits": 1}}, "MODIFIED")
    assert (s.updates, s.timeline.points) == (2, [(0.2, 1)])


def test_the_victims_are_one_pod_of_each_of_the_first_units() -> None:
    def p(name: str, unit: str | None) -> SimpleNamespace:
        labels = {} if unit is None else {"diloco.dev/unit": unit}
        return SimpleNamespace(metadata=SimpleNamespace(name=name, labels=labels))

    pods = [p("j-b-0", "b"), p("j-a-1", "a"), p("sync", None), p("j-a-0", "a"), p("j-c-0", "c")]
    assert victims(pods, 2) == ["j-a-0", "j-b-0"]
