"""The job's conditions and progress fields as a user reads them: a finished or suspended job, no
version yet, units whose learners are not running, an external synchronizer that does not answer."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from diloco_core.ownership import conflict_message, new_marker
from diloco_core.protocol import FragmentStatus, LearnerState, LearnerStatus, StatusResponse
from diloco_operator.builders.names import JobRef
from diloco_operator.runtime.passes import observation, read_synchronizer
from diloco_operator.runtime.syncstatus import redacted_url
from diloco_operator.schema.spec import DiLoCoJobSpec, parse_spec
from diloco_operator.schema.status import ChaosStatus, Condition, JobStatus
from diloco_operator.status.events import diff_events
from diloco_operator.status.job import Observed, compute_status
from diloco_operator.status.pods import observe_pod
from diloco_operator.status.units import UnitObserved

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
JOB = JobRef("j", "ns", "uid-1")
NO_NODE = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
# reasons that tell a user something is wrong
WARNINGS = {
    "BelowQuorum",
    "LearnersDead",
    "NotAvailable",
    "StorageOwnedByAnotherJob",
    "Unreachable",
    "UnitGone",
    "Unschedulable",
}


def spec(units: int = 3, quorum: int = 2, **extra: Any) -> DiLoCoJobSpec:
    return parse_spec(
        {
            "images": {"worker": "w", "synchronizer": "s"},
            "storage": {"bucket": "bkt"},
            "diloco": {"quorum": quorum},
            "learnerUnits": [{"name": f"u{i}", "replicas": 2} for i in range(units)],
            **extra,
        }
    )


def learner(unit: str, state: LearnerState = "training", step: int = 10) -> LearnerStatus:
    alive = state not in ("dead", "left")
    return LearnerStatus(
        learner_id=f"j-{unit}-0",
        unit=unit,
        state=state,
        alive=alive,
        step=step,
        tokens=100 * step,
        step_time_s=0.1,
        staleness=0,
        last_seen_s=0.5 if alive else 30.0,
    )


def sync(*learners: LearnerStatus, versions: tuple[int, ...] = (5, 4)) -> StatusResponse:
    return StatusResponse(
        job_id="j",
        shard=0,
        num_shards=1,
        learners=list(learners),
        fragments=[
            FragmentStatus(fragment=p, version=v, pending=0, rounds=max(v, 0)) for p, v in enumerate(versions)
        ],
        rounds=0,
        recent_rounds=[],
        bytes_in=0,
        bytes_out=0,
        tokens=sum(lr.tokens for lr in learners),
    )


def observed(
    ready: tuple[int, ...], status: StatusResponse | None, sync_ready: bool = True, **extra: Any
) -> Observed:
    units = [UnitObserved(f"u{i}", 2, r) for i, r in enumerate(ready)]
    return Observed(units, sync_ready, status, job="j", **extra)


def conditions(status: JobStatus) -> dict[str, Condition]:
    return {c.type: c for c in status.conditions}


def reason(status: JobStatus, ctype: str) -> tuple[str, str]:
    c = conditions(status)[ctype]
    return c.status, c.reason


HEALTHY = sync(learner("u0"), learner("u1"), learner("u2"))


@pytest.mark.parametrize(("phase", "why"), [("Succeeded", "JobSucceeded"), ("Suspended", "JobSuspended")])
def test_a_finished_or_suspended_job_says_why_its_learners_are_down(phase: str, why: str) -> None:
    extra: dict[str, Any] = {"suspend": True} if phase == "Suspended" else {"budget": {"steps": 10}}
    job = spec(unitLostAfterSeconds=60, **extra)
    done = sync(learner("u0", "left"), learner("u1", "left"), learner("u2", "left"))
    running = compute_status(spec(), observed((2, 2, 2), HEALTHY), JobStatus(), NOW)
    stopping = compute_status(job, observed((2, 2, 2), done), running, NOW)
    finished = phase == "Succeeded"  # a finished job keeps its synchronizer: it serves the final model
    down = compute_status(job, observed((0, 0, 0), done if finished else None), stopping, NOW)
    later = compute_status(
        job, observed((0, 0, 0), done if finished else None, finished), down, NOW + timedelta(hours=1)
    )
    for status in (down, later):
        assert status.phase == phase
        assert reason(status, "QuorumMet") == ("False", why)
        assert "0 of 3 units ready, quorum 2" in conditions(status)["QuorumMet"].message
        assert reason(status, "LearnersAlive") == ("False", why)
        assert f"the job is {phase}" in conditions(status)["LearnersAlive"].message
        assert not {c.reason for c in status.conditions} & WARNINGS, status.conditions
    assert reason(later, "SynchronizerReady") == (
        ("True", "Available") if finished else ("False", "JobSuspended")
    )
    gone = compute_status(job, observed((0, 0, 0), None, False), later, NOW + timedelta(hours=2))
    assert reason(gone, "SynchronizerReady") == ("False", "JobSuspended" if not finished else "NotAvailable")
    events = [*diff_events(running, stopping), *diff_events(stopping, down), *diff_events(down, later)]
    assert [(e.type, e.reason) for e in events] == [("Normal", phase)]


def test_quorum_lost_while_running_is_still_below_quorum() -> None:
    running = compute_status(spec(), observed((2, 2, 2), HEALTHY), JobStatus(), NOW)
    degraded = compute_status(spec(), observed((2, 0, 0), HEALTHY), running, NOW)
    assert reason(degraded, "QuorumMet") == ("False", "BelowQuorum")
    assert [e.reason for e in diff_events(running, degraded)][:1] == ["QuorumLost"]


def test_no_version_before_the_first_parameters() -> None:
    """The synchronizer says -1 for "no parameters yet": the status has no version then (the
    Version column stays empty) and removes one stored earlier."""
    none_yet = compute_status(spec(), observed((2, 2, 2), sync(versions=(-1, -1))), JobStatus(), NOW)
    assert none_yet.version is None
    patch = none_yet.to_patch()
    assert patch["version"] is None  # null: a stored -1 is removed
    assert JobStatus(version=-1).merged(patch).version is None
    initial = compute_status(spec(), observed((2, 2, 2), sync(versions=(0, -1))), JobStatus(), NOW)
    assert initial.version == 0  # the initial parameters
    merged = compute_status(spec(), observed((2, 2, 2), sync(versions=(3, 2))), JobStatus(), NOW)
    assert merged.version == 3
    no_answer = compute_status(spec(), observed((2, 2, 2), None), JobStatus(version=3), NOW)
    assert "version" not in no_answer.to_patch()  # without an answer the stored one stays


def test_learners_of_a_unit_that_cannot_be_placed_are_not_alive() -> None:
    obs = Observed([UnitObserved("u0", 2, 0, unschedulable=NO_NODE)], True, sync(), job="j")
    s = compute_status(spec(units=1, quorum=1), obs, JobStatus(), NOW)
    alive = conditions(s)["LearnersAlive"]
    assert (alive.status, alive.reason) == ("False", "Unschedulable")
    assert "u0" in alive.message
    no_sync = Observed([UnitObserved("u0", 2, 0, unschedulable=NO_NODE)], False, None, job="j")
    assert reason(compute_status(spec(units=1, quorum=1), no_sync, JobStatus(), NOW), "LearnersAlive") == (
        "False",
        "Unschedulable",
    )  # no pod runs: nothing to ask the synchronizer about


@pytest.mark.parametrize(
    ("ready", "status", "expected"),
    [
        ((2, 2, 2), HEALTHY, ("True", "Alive")),
        ((2, 2, 2), None, ("Unknown", "NoSynchronizerStatus")),
        ((2, 2, 0), None, ("False", "NotRunning")),  # u2 has no ready pod: its learners cannot run
        ((2, 2, 0), HEALTHY, ("False", "NotRunning")),  # the synchronizer has not noticed yet
        ((2, 2, 2), sync(learner("u0"), learner("u1")), ("False", "NotHeardFrom")),
        ((2, 2, 2), sync(learner("u0"), learner("u1"), learner("u2", "left")), ("True", "Alive")),
        ((2, 2, 2), sync(learner("u0"), learner("u1"), learner("u2", "dead")), ("False", "LearnersDead")),
        ((2, 2, 0), sync(learner("u0"), learner("u1", "dead")), ("False", "LearnersDead")),
    ],
)
def test_learners_alive_means_running_and_heard_from(
    ready: tuple[int, ...], status: StatusResponse | None, expected: tuple[str, str]
) -> None:
    s = compute_status(spec(), observed(ready, status), JobStatus(), NOW)
    assert reason(s, "LearnersAlive") == expected


def test_learners_alive_names_every_unit_and_why() -> None:
    obs = Observed(
        [UnitObserved("u0", 2, 2), UnitObserved("u1", 2, 0, unschedulable=NO_NODE), UnitObserved("u2", 2, 0)],
        True,
        sync(learner("u0", "dead")),
        job="j",
    )
    alive = conditions(compute_status(spec(), obs, JobStatus(), NOW))["LearnersAlive"]
    assert (alive.status, alive.reason) == ("False", "LearnersDead")  # the worst first
    assert alive.message == (
        "the synchronizer reports the learners of units u0 dead; "
        "the scheduler cannot place the pods of units u1; "
        "no pod of units u2 is ready"
    )


def test_a_unit_scaled_to_zero_is_left_out_of_learners_alive_and_named() -> None:
    units = [{"name": "u0", "replicas": 2}, {"name": "u1", "replicas": 0}]
    parked = parse_spec(
        {"images": {"worker": "w", "synchronizer": "s"}, "storage": {"bucket": "bkt"}, "learnerUnits": units}
    )
    obs = Observed(
        [UnitObserved("u0", 2, 2), UnitObserved("u1", 0, 0, exists=False)], True, sync(learner("u0")), job="j"
    )
    s = compute_status(parked, obs, JobStatus(), NOW)
    alive = conditions(s)["LearnersAlive"]
    assert (alive.status, alive.reason) == ("True", "Alive")
    assert alive.message.endswith("units u1 are scaled to zero (replicas 0)")
    assert reason(s, "QuorumMet") == ("True", "Quorum")


def external(url: str) -> DiLoCoJobSpec:
    ext = {"url": url, "tokenSecretRef": {"name": "t", "key": "k"}, "jobId": "home"}
    return spec(synchronizer={"external": ext})


def test_an_external_synchronizer_that_does_not_answer_is_named() -> None:
    url = "https://sync.a.example.com:8443/diloco"
    view = read_synchronizer(lambda u, ca: None, None, JOB, external(url), sync_ready=False, ca_pem=None)
    assert (view.status, view.ready, view.unreachable) == (None, False, url)
    obs = observation(external(url), "j", [], view, ChaosStatus())
    ready = conditions(compute_status(external(url), obs, JobStatus(), NOW))["SynchronizerReady"]
    assert (ready.status, ready.reason) == ("False", "Unreachable")
    assert url in ready.message
    answered = read_synchronizer(
        lambda u, ca: sync(), None, JOB, external(url), sync_ready=False, ca_pem=None
    )
    assert answered.unreachable == ""
    in_cluster = read_synchronizer(lambda u, ca: None, None, JOB, spec(), sync_ready=True, ca_pem=None)
    assert (in_cluster.ready, in_cluster.unreachable) == (None, "")  # its pods decide


def test_the_url_in_a_message_carries_no_credentials() -> None:
    url = "https://user:s3cret@sync.a.example.com:8443/diloco?token=abc#frag"
    assert redacted_url(url) == "https://sync.a.example.com:8443/diloco"
    view = read_synchronizer(lambda u, ca: None, None, JOB, external(url), sync_ready=False, ca_pem=None)
    assert view.unreachable == "https://sync.a.example.com:8443/diloco"
    wrong = StatusResponse.model_validate({**sync().model_dump(), "job_id": "other"})
    view = read_synchronizer(lambda u, ca: wrong, None, JOB, external(url), sync_ready=False, ca_pem=None)
    assert view.problem is not None
    assert "s3cret" not in view.problem
    assert "abc" not in view.problem
    assert "https://sync.a.example.com:8443/diloco" in view.problem


def sync_pod(ready: bool, container: dict[str, Any]) -> dict[str, Any]:
    """A synchronizer pod of job ``j`` as the watch shows it (``container``: its container's status)."""
    labels = {"diloco.dev/job": "j", "app.kubernetes.io/component": "synchronizer", "diloco.dev/shard": "0"}
    return {
        "metadata": {"name": "j-sync-0-abc", "namespace": "ns", "uid": "u", "labels": labels},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [container],
        },
    }


def test_a_synchronizer_refusing_another_jobs_storage_says_so_in_the_status() -> None:
    refusal = conflict_message(new_marker("other/j", "j", 0.0), "ns/j", "s3://bkt/job.json")
    log_tail = f"INFO shutting down\ndiloco synchronizer: cannot start: {refusal}\n"
    crashing = {  # restarted by its Deployment: what it said as it exited is its last state's
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": log_tail}},
    }
    view = read_synchronizer(lambda u, ca: None, None, JOB, spec(), sync_ready=False, ca_pem=None)
    obs = observation(spec(), "j", [observe_pod(sync_pod(False, crashing))], view, ChaosStatus())
    running = compute_status(spec(), observed((2, 2, 2), HEALTHY), JobStatus(), NOW)
    status = compute_status(spec(), obs, running, NOW)
    ready = conditions(status)["SynchronizerReady"]
    assert (ready.status, ready.reason, ready.message) == ("False", "StorageOwnedByAnotherJob", refusal)
    assert status.message == refusal
    told = [
        (e.type, e.message) for e in diff_events(running, status) if e.reason == "StorageOwnedByAnotherJob"
    ]
    assert told == [("Warning", refusal)]
    assert diff_events(status, compute_status(spec(), obs, status, NOW)) == []  # told once

    # the prefix given back: the synchronizer starts, and its last exit no longer counts once ready
    back = observation(
        spec(),
        "j",
        [observe_pod(sync_pod(True, {**crashing, "state": {"running": {}}}))],
        view,
        ChaosStatus(),
    )
    fixed = compute_status(spec(), back, status, NOW)
    assert reason(fixed, "SynchronizerReady") == ("True", "Available")
    assert fixed.message is None
    assert back.sync_conflict == ""  # its last exit is still on the pod, but a ready pod refuses nothing
