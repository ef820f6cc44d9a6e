"""The operator reading a real synchronizer's ``GET /v1/status`` while it reconciles a job on kwok.

A real synchronizer process serves the job; learners named like the job's pods
(``<job>-<unit>-0``, rank 0 of each unit) register with tokens derived from the job secret,
upload the initial fragments, contribute one round and keep sending heartbeats. The operator's
status must show what the synchronizer reports, and a unit whose learners stop reporting must
count as down (its kwok pods stay Running and Ready throughout).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from diloco_core.protocol import StatusResponse
from diloco_testbed.ports import free_port
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.operator.kubejobs import (
    create_job,
    events,
    get_job,
    job_manifest,
    learner_pods,
    phase_is,
    running_on_kwok,
    start_operator,
    unit,
)
from tests.synchronizer.helpers import (
    Learner,
    SyncProcess,
    encode_grad,
    initial_params,
    outer_grad,
    tiny_plan,
)

pytestmark = [pytest.mark.integration, pytest.mark.kwok]

JOB = "prog"
UNITS = ("a", "b", "c")
STEPS = {"a": 40, "b": 30, "c": 20}
SYNC_ARGS = [
    "--job-id",
    JOB,
    "--fragments",
    "2",
    "--inner-steps",
    "4",
    "--overlap",
    "1",
    "--quorum",
    "3",
    "--heartbeat-timeout-s",
    "3",
    "--heartbeat-interval-s",
    "0.5",
]


class UnitLearner(Learner):
    """Rank 0 of a unit, registering under its pod's name and its unit's name."""

    def __init__(self, base_url: str, unit_name: str) -> None:
        super().__init__(base_url, f"{JOB}-{unit_name}-0", tiny_plan(), tokens_per_step=16)
        self.unit = unit_name

    def register(self) -> httpx.Response:
        body = {
            "learner_id": self.id,
            "unit": self.unit,
            "plan": self.plan.to_dict(),
            "plan_hash": self.plan.hash(),
            "tokens_per_step": self.tokens_per_step,
        }
        return self.client.post("/v1/learners/register", json=body)


class Heartbeats:
    """Heartbeats of the units in ``alive`` every 0.3 s, from a thread, at a fixed step each."""

    def __init__(self, learners: dict[str, UnitLearner]) -> None:
        self.learners = learners
        self.alive = set(learners)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            for name in sorted(self.alive):
                try:
                    r = self._beat(name)
                except Exception as exc:  # a dead thread would silence every unit
                    self.errors.append(f"{name}: {exc!r}")
                    continue
                if r.status_code != 200:
                    self.errors.append(f"{name}: {r.status_code} {r.text}")

    def _beat(self, name: str) -> httpx.Response:
        """One heartbeat; a connection the server closed while the unit was silent is opened again once."""
        try:
            return self.learners[name].heartbeat(STEPS[name])
        except httpx.TransportError:
            return self.learners[name].heartbeat(STEPS[name])

    def __enter__(self) -> Heartbeats:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture
def synchronizer(test_logs_dir: Path, tmp_path: Path) -> Iterator[SyncProcess]:
    proc = SyncProcess(test_logs_dir / "operator-sync", f"file://{tmp_path / 'store'}", SYNC_ARGS)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def start_training(sync_url: str) -> dict[str, UnitLearner]:
    """Register the three units' learners, upload the initial fragments, merge one round of fragment 0."""
    learners = {u: UnitLearner(sync_url, u) for u in UNITS}
    for learner in learners.values():
        r = learner.register()
        assert r.status_code == 200, r.text
    first = learners["a"]
    for p in (0, 1):
        r = first.init(p, initial_params(first.plan, p))
        assert r.status_code == 200, r.text
    for i, learner in enumerate(learners.values()):
        blob = encode_grad(outer_grad(learner.plan, 0, seed=i), 0, 0)
        r = learner.contribute(0, 0, blob, steps=4, tokens=64)
        assert r.status_code == 202, r.text
    return learners


def sync_status(url: str) -> StatusResponse:
    r = httpx.get(f"{url}/v1/status", timeout=10)
    r.raise_for_status()
    return StatusResponse.model_validate_json(r.content)


def status_of(api: k8s.ApiClient, ns: str) -> dict[str, Any]:
    return dict(get_job(api, ns, JOB).get("status") or {})


def units_of(api: k8s.ApiClient, ns: str) -> dict[str, dict[str, Any]]:
    return {u["name"]: u for u in status_of(api, ns).get("units") or []}


def conditions_of(api: k8s.ApiClient, ns: str) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status_of(api, ns).get("conditions") or []}


def units_gauge(metrics_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith("diloco_operator_learner_units{") and f'job="{JOB}"' in line:
            state = line.split('state="', 1)[1].split('"', 1)[0]
            out[state] = float(line.rsplit(" ", 1)[1])
    return out


def test_status_shows_the_synchronizers_progress_and_dead_learners(
    api: k8s.ApiClient, namespace: str, synchronizer: SyncProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics_port = free_port()
    monkeypatch.setenv("DILOCO_OPERATOR_SYNC_URL", synchronizer.url)
    monkeypatch.setenv("DILOCO_OPERATOR_METRICS_PORT", str(metrics_port))
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    learners = start_training(synchronizer.url)
    with Heartbeats(learners) as beats, start_operator() as runner:
        create_job(api, namespace, job_manifest(JOB, [unit(u) for u in UNITS], diloco={"quorum": 2}))
        wait_for(
            lambda: running_on_kwok(learner_pods(api, namespace, JOB), 3), timeout=90, what="3 pods Running"
        )
        wait_for(
            lambda: phase_is(api, namespace, JOB, "Running", "3/3")
            and all(units_of(api, namespace)[u].get("step") == STEPS[u] for u in UNITS),
            timeout=60,
            what="Running with the synchronizer's steps",
            describe=lambda: str(status_of(api, namespace)),
        )

        truth = sync_status(synchronizer.url)
        assert truth.job_id == JOB
        status = status_of(api, namespace)
        assert (status["version"], status["rounds"], status["tokens"]) == (
            max(f.version for f in truth.fragments),
            truth.rounds,
            truth.tokens,
        )
        assert status["version"] == 1  # the round the three learners contributed to
        assert status["tokens"] > 0
        units = units_of(api, namespace)
        for learner in truth.learners:
            seen = units[learner.unit]
            assert (seen["step"], seen["tokens"], seen["staleness"], seen["aliveLearners"]) == (
                learner.step,
                learner.tokens,
                learner.staleness,
                1,
            ), learner.learner_id
            assert (seen["state"], seen["reason"]) == ("Ready", "Ready")
        assert conditions_of(api, namespace)["LearnersAlive"]["status"] == "True"
        wait_for(
            lambda: units_gauge(metrics_url) == {"ready": 3.0, "not_ready": 0.0, "lost": 0.0},
            timeout=30,
            what="units gauge: 3 ready",
            describe=lambda: str(units_gauge(metrics_url)),
        )

        # Units b and c stop reporting: the synchronizer declares their learners dead, their pods
        # stay Ready, and the job drops below its quorum of 2.
        beats.alive -= {"b", "c"}
        wait_for(
            lambda: phase_is(api, namespace, JOB, "Degraded", "1/3"),
            timeout=60,
            what="Degraded 1/3",
            describe=lambda: str(status_of(api, namespace)),
        )
        units = units_of(api, namespace)
        assert [(units[u]["state"], units[u]["reason"]) for u in UNITS] == [
            ("Ready", "Ready"),
            ("NotReady", "LearnersDead"),
            ("NotReady", "LearnersDead"),
        ]
        assert (units["b"]["readyReplicas"], units["b"]["aliveLearners"], units["b"]["deadLearners"]) == (
            1,
            0,
            1,
        )
        assert {lr.learner_id for lr in sync_status(synchronizer.url).learners if lr.state == "dead"} == {
            f"{JOB}-b-0",
            f"{JOB}-c-0",
        }
        conds = conditions_of(api, namespace)
        assert (conds["QuorumMet"]["status"], conds["QuorumMet"]["reason"]) == ("False", "BelowQuorum")
        assert (conds["LearnersAlive"]["status"], conds["LearnersAlive"]["reason"]) == (
            "False",
            "LearnersDead",
        )
        assert "b, c" in conds["LearnersAlive"]["message"]
        assert running_on_kwok(learner_pods(api, namespace, JOB), 3)  # Kubernetes sees nothing wrong
        wait_for(
            lambda: {"QuorumLost", "LearnersDead"} <= set(events(api, namespace, JOB)),
            timeout=30,
            what="QuorumLost and LearnersDead events",
            describe=lambda: str(events(api, namespace, JOB)),
        )
        wait_for(
            lambda: units_gauge(metrics_url) == {"ready": 1.0, "not_ready": 2.0, "lost": 0.0},
            timeout=30,
            what="units gauge: 1 ready, 2 not ready",
            describe=lambda: str(units_gauge(metrics_url)),
        )

        # Unit b reports again: back to quorum.
        beats.alive.add("b")
        wait_for(
            lambda: phase_is(api, namespace, JOB, "Running", "2/3"),
            timeout=60,
            what="Running 2/3 again",
            describe=lambda: str(status_of(api, namespace)),
        )
        assert units_of(api, namespace)["c"]["reason"] == "LearnersDead"
        assert beats.errors == []
    assert runner.exception is None, runner.output
