"""Units as the synchronizer sees them: learners reported dead, unit states, the units gauge, job ids."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from diloco_core.protocol import FragmentStatus, LearnerState, LearnerStatus, StatusResponse
from diloco_operator.builders.children import build_children
from diloco_operator.builders.names import JobRef, job_id
from diloco_operator.runtime.metrics import OperatorMetrics
from diloco_operator.runtime.passes import read_synchronizer
from diloco_operator.runtime.reconcile import wrong_job
from diloco_operator.schema.spec import DiLoCoJobSpec, parse_spec
from diloco_operator.schema.status import Condition, JobStatus
from diloco_operator.status.admission import Admission
from diloco_operator.status.events import diff_events
from diloco_operator.status.job import Observed, compute_status
from diloco_operator.status.units import UnitObserved, unit_state_counts

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
JOB = JobRef("j", "ns", "uid-1")


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


def learner(lid: str, unit: str, *, state: LearnerState = "training", step: int = 10) -> LearnerStatus:
    alive = state not in ("dead", "left")
    return LearnerStatus(
        learner_id=lid,
        unit=unit,
        state=state,
        alive=alive,
        step=step,
        tokens=100 * step,
        step_time_s=0.1,
        staleness=1,
        last_seen_s=0.5 if alive else 30.0,
    )


def sync(*learners: LearnerStatus, job: str = "j") -> StatusResponse:
    return StatusResponse(
        job_id=job,
        shard=0,
        num_shards=1,
        learners=list(learners),
        fragments=[FragmentStatus(fragment=0, version=5, pending=0, rounds=5)],
        rounds=5,
        recent_rounds=[],
        bytes_in=0,
        bytes_out=0,
        tokens=3000,
    )


def observed(status: StatusResponse | None, ready: tuple[int, ...] = (2, 2, 2)) -> Observed:
    return Observed([UnitObserved(f"u{i}", 2, r) for i, r in enumerate(ready)], True, status, job="j")


def conditions(status: JobStatus) -> dict[str, Condition]:
    return {c.type: c for c in status.conditions}


def test_learners_reported_dead_make_the_unit_not_ready_and_the_job_degraded() -> None:
    healthy = sync(learner("j-u0-0", "u0"), learner("j-u1-0", "u1"), learner("j-u2-0", "u2"))
    running = compute_status(spec(), observed(healthy), JobStatus(), NOW)
    assert running.phase == "Running"
    assert conditions(running)["LearnersAlive"].status == "True"
    two_dead = sync(
        learner("j-u0-0", "u0"), learner("j-u1-0", "u1", state="dead"), learner("j-u2-0", "u2", state="dead")
    )
    degraded = compute_status(spec(), observed(two_dead), running, NOW + timedelta(seconds=5))
    assert degraded.phase == "Degraded"
    u0, u1, u2 = degraded.units
    assert (u0.state, u0.reason, u0.ready) == ("Ready", "Ready", True)
    assert (u1.state, u1.reason, u1.ready, u1.ready_replicas) == ("NotReady", "LearnersDead", False, 2)
    assert (u1.alive_learners, u1.dead_learners) == (0, 1)
    alive = conditions(degraded)["LearnersAlive"]
    assert (alive.status, alive.reason) == ("False", "LearnersDead")
    assert "u1, u2" in alive.message
    assert conditions(degraded)["QuorumMet"].message == "1 of 3 units ready, quorum 2"
    assert [e.reason for e in diff_events(running, degraded)] == ["QuorumLost", "LearnersDead"]
    still = compute_status(spec(), observed(two_dead), degraded, NOW + timedelta(seconds=7))
    assert diff_events(degraded, still) == []
    u1_back = sync(learner("j-u0-0", "u0"), learner("j-u1-0", "u1"), learner("j-u2-0", "u2", state="dead"))
    partly = compute_status(spec(), observed(u1_back), still, NOW + timedelta(seconds=8))
    assert [e.reason for e in diff_events(still, partly)] == ["QuorumRegained", "Running"]
    assert "u2" in conditions(partly)["LearnersAlive"].message
    back = compute_status(spec(), observed(healthy), partly, NOW + timedelta(seconds=10))
    assert back.phase == "Running"
    assert diff_events(partly, back) == []
    assert conditions(back)["LearnersAlive"].status == "True"


def test_a_unit_with_one_live_learner_or_a_clean_leave_is_not_dead() -> None:
    status = sync(
        learner("j-u0-0", "u0", state="dead"),
        learner("j-u0-1", "u0"),
        learner("j-u1-0", "u1", state="left"),
        learner("j-u2-0", "u2"),
    )
    s = compute_status(spec(), observed(status), JobStatus(), NOW)
    assert [u.reason for u in s.units] == ["Ready", "Ready", "Ready"]
    assert conditions(s)["LearnersAlive"].status == "True"


def test_without_synchronizer_status_learners_alive_is_unknown() -> None:
    s = compute_status(spec(), observed(None), JobStatus(), NOW)
    assert (conditions(s)["LearnersAlive"].status, conditions(s)["LearnersAlive"].reason) == (
        "Unknown",
        "NoSynchronizerStatus",
    )
    assert s.phase == "Running"  # pods ready, nothing says otherwise


def test_only_this_jobs_learners_count_for_its_units() -> None:
    """An external synchronizer serves other regions too; their units may share names with ours."""
    status = sync(learner("other-u0-0", "u0", state="dead", step=99), learner("j-u0-0", "u0", step=7))
    u0 = compute_status(spec(), observed(status), JobStatus(), NOW).units[0]
    assert (u0.step, u0.alive_learners, u0.dead_learners, u0.reason) == (7, 1, 0, "Ready")


def test_unit_states_and_their_counts() -> None:
    s = spec(unitLostAfterSeconds=60)
    running = compute_status(s, observed(None), JobStatus(), NOW)
    assert unit_state_counts(running) == {"ready": 3, "not_ready": 0, "lost": 0}
    down = compute_status(s, observed(None, (2, 1, 0)), running, NOW + timedelta(seconds=1))
    assert unit_state_counts(down) == {"ready": 1, "not_ready": 2, "lost": 0}
    gone = compute_status(s, observed(None, (2, 2, 0)), down, NOW + timedelta(seconds=90))
    assert [u.state for u in gone.units] == ["Ready", "Ready", "Lost"]
    assert unit_state_counts(gone) == {"ready": 2, "not_ready": 0, "lost": 1}
    assert unit_state_counts(JobStatus(phase="Failed")) == {"ready": 0, "not_ready": 0, "lost": 0}


def test_units_gauge() -> None:
    metrics = OperatorMetrics()
    metrics.set_units("ns", "j", {"ready": 2, "not_ready": 0, "lost": 1})

    def value(state: str) -> float | None:
        found = metrics.registry.get_sample_value(
            "diloco_operator_learner_units", {"namespace": "ns", "job": "j", "state": state}
        )
        return None if found is None else float(found)

    assert (value("ready"), value("not_ready"), value("lost")) == (2.0, 0.0, 1.0)
    metrics.set_units("ns", "j", {"ready": 3, "not_ready": 0, "lost": 0})
    assert (value("ready"), value("lost")) == (3.0, 0.0)
    metrics.forget("ns", "j")
    assert value("ready") is None


def external(**extra: Any) -> DiLoCoJobSpec:
    ext = {"url": "https://sync.a.example.com", "tokenSecretRef": {"name": "t", "key": "k"}, **extra}
    return spec(synchronizer={"external": ext})


def test_job_id_of_the_learners() -> None:
    assert job_id(JOB, spec()) == "j"
    assert job_id(JOB, external()) == "j"
    ext = external(jobId="llm-a")
    assert job_id(JOB, ext) == "llm-a"
    config, sts = (
        next(c for c in build_children(JOB, ext) if c["kind"] == "ConfigMap"),
        next(c for c in build_children(JOB, ext) if c["kind"] == "StatefulSet"),
    )
    assert '"job_id": "llm-a"' in config["data"]["job.json"]
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DILOCO_JOB_ID"] == "llm-a"


def test_status_of_another_job_is_refused() -> None:
    url = "http://sync"
    assert wrong_job(sync(job="j"), JOB, spec(), url) is None
    assert wrong_job(None, JOB, spec(), url) is None
    assert (
        wrong_job(sync(job="x"), JOB, spec(), url)
        == "the synchronizer at http://sync serves job 'x', not 'j'"
    )
    assert wrong_job(sync(job="llm-a"), JOB, external(jobId="llm-a"), url) is None
    assert "not 'llm-a'" in str(wrong_job(sync(job="llm-b"), JOB, external(jobId="llm-a"), url))
    assert wrong_job(sync(job="anything"), JOB, external(), url) is None  # no jobId: not checked


def test_wrong_job_condition() -> None:
    obs = Observed(
        [UnitObserved(f"u{i}", 2, 2) for i in range(3)],
        False,
        None,
        job="j",
        sync_problem="the synchronizer at http://sync serves job 'x', not 'j'",
    )
    s = compute_status(spec(), obs, JobStatus(), NOW)
    ready = conditions(s)["SynchronizerReady"]
    assert (ready.status, ready.reason) == ("False", "WrongJob")
    assert "serves job 'x'" in ready.message
    assert s.phase == "Pending"


def test_the_synchronizer_is_read_from_its_service_or_from_the_sync_url_given() -> None:
    asked: list[tuple[str, str | None]] = []

    def fetch(url: str, ca_pem: str | None) -> StatusResponse | None:
        asked.append((url, ca_pem))
        return sync(job="j")

    assert (
        read_synchronizer(fetch, None, JOB, spec(), sync_ready=False, ca_pem=None).status is None
    )  # not asked
    assert read_synchronizer(fetch, None, JOB, spec(), sync_ready=True, ca_pem="PEM").status is not None
    proxy = "http://127.0.0.1:8001/api/v1/namespaces/{namespace}/services/{name}-sync:http/proxy"
    view = read_synchronizer(
        fetch, proxy, JOB, spec(), sync_ready=False, ca_pem=None
    )  # from outside: always asked
    assert asked == [
        ("http://j-sync.ns.svc:8080", "PEM"),
        ("http://127.0.0.1:8001/api/v1/namespaces/ns/services/j-sync:http/proxy", None),
    ]
    assert (view.status is not None, view.problem, view.ready) == (True, None, None)
    wrong = read_synchronizer(lambda url, ca: sync(job="x"), None, JOB, spec(), sync_ready=True, ca_pem=None)
    assert (wrong.status, wrong.ready) == (None, False)
    assert "serves job 'x'" in str(wrong.problem)


def test_under_a_queue_units_waiting_for_kueue_say_so_and_are_never_lost() -> None:
    s = spec(unitLostAfterSeconds=60, queueName="team")
    admitted = Admission("Admitted", "Admitted", "")
    queued = Admission("Queued", "Pending", "insufficient quota for cpu in flavor default")
    preempted = Admission("Preempted", "Preempted", "Preempted to accommodate a higher priority workload")

    def seen(u2: Admission, ready: tuple[int, int, int] = (2, 2, 0)) -> Observed:
        admissions = (admitted, admitted, u2)
        units = [
            UnitObserved(f"u{i}", 2, r, admission=a)
            for i, (r, a) in enumerate(zip(ready, admissions, strict=True))
        ]
        return Observed(units, True, None, job="j")

    first = compute_status(s, seen(queued), JobStatus(), NOW)
    assert first.phase == "Running"  # the quorum (2) is admitted and ready: not Degraded
    u0, _, u2 = first.units
    assert (u0.admission, u0.reason) == ("Admitted", "Ready")
    assert (u2.admission, u2.reason, u2.state) == ("Queued", "Queued", "NotReady")
    assert u2.message == "Pending: insufficient quota for cpu in flavor default"
    ran = compute_status(s, seen(admitted, (2, 2, 2)), first, NOW + timedelta(seconds=1))
    assert ran.units[2].ever_ready
    out = compute_status(s, seen(preempted), ran, NOW + timedelta(seconds=2))
    later = compute_status(s, seen(preempted), out, NOW + timedelta(seconds=300))
    assert later.phase == "Running"
    assert (later.units[2].state, later.units[2].reason) == ("NotReady", "Preempted")  # not Lost
    assert "higher priority" in str(later.units[2].message)
    assert "UnitLost" not in [e.reason for e in diff_events(out, later)]
