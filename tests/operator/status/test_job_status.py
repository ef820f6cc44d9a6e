"""Pure status computation: phases, conditions, per-unit progress and events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from diloco_core.protocol import FragmentStatus, LearnerStatus, StatusResponse
from diloco_operator.schema.spec import DiLoCoJobSpec, parse_spec
from diloco_operator.schema.status import ChaosStatus, JobStatus, merge_patch
from diloco_operator.status.events import EVENT_NOTE_LIMIT, Event, diff_events, event_object
from diloco_operator.status.job import Observed, compute_status, invalid_status
from diloco_operator.status.units import UnitObserved, unit_state_counts

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def spec(quorum: int = 2, units: int = 3, **extra: Any) -> DiLoCoJobSpec:
    return parse_spec(
        {
            "images": {"worker": "w", "synchronizer": "s"},
            "storage": {"bucket": "bkt"},
            "diloco": {"quorum": quorum},
            "learnerUnits": [{"name": f"u{i}", "replicas": 2} for i in range(units)],
            **extra,
        }
    )


def observed(ready: list[int], sync_ready: bool = True, sync: StatusResponse | None = None) -> Observed:
    return Observed([UnitObserved(f"u{i}", 2, r) for i, r in enumerate(ready)], sync_ready, sync)


def learner(lid: str, unit: str, step: int, tokens: int, staleness: int) -> LearnerStatus:
    return LearnerStatus(
        learner_id=lid,
        unit=unit,
        state="training",
        alive=True,
        step=step,
        tokens=tokens,
        step_time_s=0.1,
        staleness=staleness,
        last_seen_s=0.5,
    )


def sync_status(tokens: int = 1000, steps: int = 10) -> StatusResponse:
    return StatusResponse(
        job_id="j",
        shard=0,
        num_shards=1,
        learners=[
            learner("j-u0-0", "u0", steps, tokens // 2, 1),
            learner("j-u1-0", "u1", steps + 2, tokens // 2, 0),
        ],
        fragments=[
            FragmentStatus(fragment=0, version=7, pending=0, rounds=7),
            FragmentStatus(fragment=1, version=6, pending=1, rounds=6),
        ],
        rounds=13,
        recent_rounds=[],
        bytes_in=0,
        bytes_out=0,
        tokens=tokens,
        goodput=0.97,
    )


@pytest.mark.parametrize(
    ("ready", "sync_ready", "old_phase", "suspend", "phase"),
    [
        ([0, 0, 0], False, None, False, "Pending"),
        ([2, 2, 0], False, None, False, "Pending"),
        ([2, 2, 0], True, None, False, "Running"),
        ([2, 1, 0], True, None, False, "Pending"),
        ([2, 1, 0], True, "Running", False, "Degraded"),
        ([2, 2, 2], False, "Running", False, "Degraded"),
        ([2, 2, 2], True, "Degraded", False, "Running"),
        ([2, 2, 2], True, "Running", True, "Suspended"),
        ([0, 0, 0], True, "Succeeded", False, "Succeeded"),
    ],
)
def test_phase(ready: list[int], sync_ready: bool, old_phase: str | None, suspend: bool, phase: str) -> None:
    old = JobStatus(phase=old_phase) if old_phase else JobStatus()
    s = compute_status(spec(suspend=suspend), observed(ready, sync_ready), old, NOW)
    assert s.phase == phase
    assert s.units_ready == f"{sum(1 for r in ready if r == 2)}/3"
    ready_cond = next(c for c in s.conditions if c.type == "Ready")
    assert ready_cond.status == ("True" if phase == "Running" else "False")


def test_budget_in_tokens_means_succeeded() -> None:
    s = compute_status(
        spec(budget={"tokens": 1000}), observed([2, 2, 2], sync=sync_status(tokens=1000)), JobStatus(), NOW
    )
    assert s.phase == "Succeeded"
    s = compute_status(
        spec(budget={"tokens": 1001}), observed([2, 2, 2], sync=sync_status(tokens=1000)), JobStatus(), NOW
    )
    assert s.phase == "Running"


def test_budget_in_steps_needs_every_learner() -> None:
    s = compute_status(
        spec(budget={"steps": 12}), observed([2, 2, 2], sync=sync_status(steps=10)), JobStatus(), NOW
    )
    assert s.phase == "Running"
    s = compute_status(
        spec(budget={"steps": 10}), observed([2, 2, 2], sync=sync_status(steps=10)), JobStatus(), NOW
    )
    assert s.phase == "Succeeded"


def test_progress_from_the_synchronizer() -> None:
    s = compute_status(spec(), observed([2, 2, 2], sync=sync_status()), JobStatus(), NOW, generation=3)
    assert (s.rounds, s.tokens, s.version, s.goodput) == (13, 1000, 7, 0.97)
    assert s.observed_generation == 3
    u0, u1, u2 = s.units
    assert (u0.step, u0.tokens, u0.staleness, u0.alive_learners) == (10, 500, 1, 1)
    assert u1.step == 12
    assert u2.step is None


def test_condition_transition_time_moves_only_on_change() -> None:
    first = compute_status(spec(), observed([2, 2, 2]), JobStatus(), NOW)
    later = NOW + timedelta(minutes=5)
    same = compute_status(spec(), observed([2, 2, 2]), first, later)
    assert same.conditions == first.conditions
    changed = compute_status(spec(), observed([0, 0, 2]), first, later)
    quorum = next(c for c in changed.conditions if c.type == "QuorumMet")
    assert quorum.status == "False"
    assert quorum.last_transition_time == "2026-01-01T12:05:00Z"


def test_events_quorum_lost_then_regained() -> None:
    running = compute_status(spec(), observed([2, 2, 2]), JobStatus(), NOW)
    degraded = compute_status(spec(), observed([2, 1, 0]), running, NOW)
    events = diff_events(running, degraded)
    assert [e.reason for e in events] == ["QuorumLost"]
    assert "1 of 3 units ready, quorum 2" in events[0].message
    assert degraded.phase == "Degraded"
    back = compute_status(spec(), observed([2, 2, 0]), degraded, NOW)
    assert [e.reason for e in diff_events(degraded, back)] == ["QuorumRegained", "Running"]


def test_unit_gone_for_too_long_is_reported_once() -> None:
    s = spec(unitLostAfterSeconds=60)
    running = compute_status(s, observed([2, 2, 2]), JobStatus(), NOW)
    lost = compute_status(s, observed([2, 2, 0]), running, NOW + timedelta(seconds=10))
    assert lost.units[2].not_ready_since == "2026-01-01T12:00:10Z"
    gone = compute_status(s, observed([2, 2, 0]), lost, NOW + timedelta(seconds=80))
    assert [e.reason for e in diff_events(lost, gone)] == ["UnitGone"]
    healthy = next(c for c in gone.conditions if c.type == "UnitsHealthy")
    assert healthy.status == "False"
    assert "u2" in healthy.message
    still = compute_status(s, observed([2, 2, 0]), gone, NOW + timedelta(seconds=90))
    assert diff_events(gone, still) == []


def test_never_ready_unit_is_not_reported_gone() -> None:
    s = spec(unitLostAfterSeconds=60)
    first = compute_status(s, observed([2, 2, 0]), JobStatus(), NOW)
    later = compute_status(s, observed([2, 2, 0]), first, NOW + timedelta(hours=1))
    assert next(c for c in later.conditions if c.type == "UnitsHealthy").status == "True"


def test_invalid_status() -> None:
    s = invalid_status("spec.diloco.quorum (5) exceeds ...", JobStatus(), NOW, 2)
    assert s.phase == "Failed"
    valid = next(c for c in s.conditions if c.type == "SpecValid")
    assert (valid.status, valid.reason) == ("False", "InvalidSpec")
    assert "quorum" in valid.message


def test_event_object_regards_the_job_and_bounds_the_note() -> None:
    job = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u-1"},
    }
    obj = event_object(job, Event("Warning", "QuorumLost", "x" * 5000), NOW, "op-0")
    assert obj["regarding"] == {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "name": "j",
        "namespace": "ns",
        "uid": "u-1",
    }
    assert obj["metadata"] == {"generateName": "j-", "namespace": "ns"}
    assert (obj["type"], obj["reason"], obj["reportingInstance"]) == ("Warning", "QuorumLost", "op-0")
    assert len(obj["note"]) == EVENT_NOTE_LIMIT
    assert obj["note"].endswith("...")
    assert obj["eventTime"] == "2026-01-01T12:00:00.000000Z"


def test_the_status_is_a_merge_patch_in_the_crds_names() -> None:
    running = compute_status(spec(), observed([2, 2, 0], sync=sync_status()), JobStatus(), NOW, generation=3)
    patch = running.to_patch()
    assert set(patch) == {
        "phase",
        "message",  # null: removes what an earlier status said
        "conditions",
        "units",
        "readyUnits",
        "totalUnits",
        "unitsReady",
        "chaos",
        "observedGeneration",
        "rounds",
        "tokens",
        "version",
        "goodput",
    }
    assert patch["units"][2] == {
        "name": "u2",
        "replicas": 2,
        "readyReplicas": 0,
        "ready": False,
        "state": "NotReady",
        "reason": "PodsNotReady",
        "everReady": False,
        "notReadySince": "2026-01-01T12:00:00Z",
    }
    assert "notReadySince" not in patch["units"][0]
    assert patch["conditions"][0] == {
        "type": "SpecValid",
        "status": "True",
        "reason": "Valid",
        "message": "the spec is valid",
        "lastTransitionTime": "2026-01-01T12:00:00Z",
    }
    assert patch["chaos"] == {"kills": 0, "downUntil": {}}
    # without the synchronizer's status the stored progress stays: it is not in the patch
    assert "rounds" not in compute_status(spec(), observed([2, 2, 2]), JobStatus(), NOW).to_patch()
    # a field set to None is in the patch as null, which removes it
    assert running.model_copy(update={"message": None}).to_patch()["message"] is None
    assert JobStatus.read(patch) == running


def test_a_stored_status_that_does_not_parse_is_rebuilt() -> None:
    assert JobStatus.read({"phase": "Exploded", "units": "many"}) == JobStatus()
    assert JobStatus.read({"phase": "Running", "addedByAnotherVersion": 1}).phase == "Running"


@pytest.mark.parametrize("phase", ["Succeeded", "Suspended"])
def test_units_scaled_down_on_purpose_raise_no_warning(phase: str) -> None:
    """A finished or suspended job's units go down because the operator scales them to zero."""
    extra: dict[str, Any] = {"suspend": True} if phase == "Suspended" else {"budget": {"steps": 10}}
    job = spec(unitLostAfterSeconds=60, **extra)
    running = compute_status(spec(), observed([2, 2, 2], sync=sync_status(steps=5)), JobStatus(), NOW)
    stopping = compute_status(job, observed([2, 2, 2], sync=sync_status(steps=10)), running, NOW)
    down = compute_status(job, observed([0, 0, 0], sync=sync_status(steps=10)), stopping, NOW)
    much_later = compute_status(
        job, observed([0, 0, 0], sync=sync_status(steps=10)), down, NOW + timedelta(hours=1)
    )
    assert [s.phase for s in (stopping, down, much_later)] == [phase] * 3
    events = [*diff_events(running, stopping), *diff_events(stopping, down), *diff_events(down, much_later)]
    assert [(e.type, e.reason) for e in events] == [("Normal", phase)]
    assert {u.state for u in much_later.units} == {"NotReady"}  # not Lost


def test_a_unit_the_scheduler_cannot_place_says_why_once() -> None:
    msg = "0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector."
    placed = Observed([UnitObserved(f"u{i}", 2, 2) for i in range(3)], True)
    stuck = Observed(
        [UnitObserved("u0", 2, 2), UnitObserved("u1", 2, 0, unschedulable=msg), UnitObserved("u2", 2, 2)],
        True,
    )
    running = compute_status(spec(), placed, JobStatus(), NOW)
    scheduled = next(c for c in running.conditions if c.type == "PodsScheduled")
    assert (scheduled.status, scheduled.reason) == ("True", "Scheduled")
    waiting = compute_status(spec(), stuck, running, NOW)
    u1 = waiting.units[1]
    assert (u1.state, u1.reason, u1.message) == ("NotReady", "Unschedulable", msg)
    cond = next(c for c in waiting.conditions if c.type == "PodsScheduled")
    assert (cond.status, cond.reason, cond.message) == ("False", "Unschedulable", f"unit u1: {msg}")
    assert [(e.type, e.reason, e.message) for e in diff_events(running, waiting)] == [
        ("Warning", "Unschedulable", f"unit u1: {msg}")
    ]
    assert diff_events(waiting, compute_status(spec(), stuck, waiting, NOW)) == []  # once, not per pass
    both = Observed(
        [
            UnitObserved("u0", 2, 2),
            UnitObserved("u1", 2, 0, unschedulable=msg),
            UnitObserved("u2", 2, 0, unschedulable=msg),
        ],
        True,
        sync_unschedulable="no room",
    )
    worse = compute_status(spec(), both, waiting, NOW)
    assert [(e.reason, e.message) for e in diff_events(waiting, worse)] == [
        ("QuorumLost", "1 of 3 units ready, quorum 2"),
        ("Unschedulable", f"unit u2: {msg}"),
    ]  # the newcomer only
    assert next(c for c in worse.conditions if c.type == "PodsScheduled").message.endswith(
        "; synchronizer: no room"
    )
    assert unit_state_counts(worse)["not_ready"] == 2


def test_an_image_that_cannot_be_pulled_is_named_in_the_unit_the_synchronizer_and_one_event() -> None:
    said = "image 'reg.example/worker:typo' (learner): ImagePullBackOff: Back-off pulling image"
    placed = Observed([UnitObserved(f"u{i}", 2, 2) for i in range(3)], True)
    pulling = Observed(
        [UnitObserved("u0", 2, 2), UnitObserved("u1", 2, 0, image_problem=said), UnitObserved("u2", 2, 2)],
        False,
        sync_image="image 'reg.example/sync:typo' (synchronizer): ErrImagePull",
    )
    running = compute_status(spec(), placed, JobStatus(), NOW)
    failing = compute_status(spec(), pulling, running, NOW)
    u1 = failing.units[1]
    assert (u1.state, u1.reason, u1.message) == ("NotReady", "ImagePullFailed", said)
    sync = next(c for c in failing.conditions if c.type == "SynchronizerReady")
    assert (sync.status, sync.reason) == ("False", "ImagePullFailed")
    assert sync.message == "synchronizer: image 'reg.example/sync:typo' (synchronizer): ErrImagePull"
    warned = [(e.reason, e.message) for e in diff_events(running, failing) if e.reason == "ImagePullFailed"]
    assert warned == [("ImagePullFailed", f"unit u1: {said}"), ("ImagePullFailed", sync.message)]
    again = compute_status(spec(), pulling, failing, NOW)
    assert [
        e for e in diff_events(failing, again) if e.reason == "ImagePullFailed"
    ] == []  # once, not per pass
    # a pod the scheduler cannot place pulls nothing: that is what the unit says
    both = Observed([UnitObserved("u0", 2, 0, unschedulable="0/4 nodes", image_problem=said)], True)
    assert compute_status(spec(units=1, quorum=1), both, JobStatus(), NOW).units[0].reason == "Unschedulable"


def test_a_merge_patch_is_what_the_apiserver_stores() -> None:
    stored = JobStatus(phase="Running", message="x", chaos=ChaosStatus(kills=1, down_until={"a": 5.0}))
    after = stored.merged(
        {"message": None, "chaos": {"downUntil": {"a": None, "b": 9.0}}, "phase": "Degraded"}
    )
    assert after == JobStatus(phase="Degraded", chaos=ChaosStatus(kills=1, down_until={"b": 9.0}))
    assert merge_patch({"a": {"b": 1}}, {"a": {"c": None, "d": {"e": None}}}) == {"a": {"b": 1, "d": {}}}


def restarting(ready: list[int], units: frozenset[str]) -> Observed:
    return Observed([UnitObserved(f"u{i}", 2, r) for i, r in enumerate(ready)], True, restarting=units)


def test_units_the_operator_restarts_raise_no_warning_and_keep_the_job_running() -> None:
    """A new pod template (a new worker image, say): the operator deletes the units' outdated pods,
    which drops the job below quorum until the replacements are ready. That is no loss."""
    job = spec(quorum=2, unitLostAfterSeconds=60)
    running = compute_status(job, observed([2, 2, 2]), JobStatus(), NOW)
    down = compute_status(job, restarting([0, 0, 2], frozenset({"u0", "u1"})), running, NOW)
    assert down.phase == "Running"
    quorum = next(c for c in down.conditions if c.type == "QuorumMet")
    assert (quorum.status, quorum.reason) == ("False", "UnitsRestarting")
    assert "u0, u1" in quorum.message
    later = NOW + timedelta(seconds=13)
    back = compute_status(job, observed([2, 2, 2]), down, later)
    assert back.phase == "Running"
    assert [*diff_events(running, down), *diff_events(down, back)] == []


def test_a_restart_that_does_not_come_back_is_a_loss_once_its_grace_is_over() -> None:
    job = spec(quorum=2, unitLostAfterSeconds=60)
    running = compute_status(job, observed([2, 2, 2]), JobStatus(), NOW)
    down = compute_status(job, restarting([0, 0, 2], frozenset({"u0", "u1"})), running, NOW)
    # past unitLostAfterSeconds the runtime no longer counts the restart (pods.restarts_under_way)
    over = compute_status(job, observed([0, 0, 2]), down, NOW + timedelta(seconds=61))
    assert over.phase == "Degraded"
    assert [(e.type, e.reason) for e in diff_events(down, over)] == [
        ("Warning", "QuorumLost"),
        ("Warning", "UnitGone"),
    ]
    back = compute_status(job, observed([2, 2, 2]), over, NOW + timedelta(seconds=70))
    assert [e.reason for e in diff_events(over, back)] == ["QuorumRegained", "Running"]


def test_a_unit_lost_during_a_restart_is_still_a_loss() -> None:
    job = spec(quorum=2)
    running = compute_status(job, observed([2, 2, 2]), JobStatus(), NOW)
    down = compute_status(job, restarting([0, 2, 0], frozenset({"u0"})), running, NOW)
    assert down.phase == "Running"
    lost = compute_status(job, restarting([0, 1, 0], frozenset({"u0"})), down, NOW)
    assert lost.phase == "Degraded"
    assert [(e.type, e.reason) for e in diff_events(down, lost)] == [("Warning", "QuorumLost")]
