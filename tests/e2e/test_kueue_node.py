"""A job under Kueue on the real node, learners training as real pods: two units admitted, one
preempted by a higher-priority Job and admitted again when that Job ends, the other unit training
throughout, and the preempted one resuming from its checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diloco_testbed.kueue import Kueue
from diloco_testbed.kueue_objects import team_queue
from diloco_testbed.pods import pod_logs
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import Synchronizer, job_status, tiny_job

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

JOB = "queued"
# a unit's pod asks for 250m of the queue's 500m CPU: two units fit, a third such workload must preempt
UNIT = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "2Gi"}}


@pytest.fixture(scope="module")
def queue(
    e2e: E2ECluster, api: k8s.ApiClient, jobs_namespace: str, test_logs_dir: Path
) -> Iterator[dict[str, str]]:
    """Kueue on the cluster, a ClusterQueue of 500m CPU and a LocalQueue ``team`` in the jobs' namespace."""
    kueue = Kueue(e2e.kube, test_logs_dir / "kueue-e2e")
    kueue.start()
    try:
        with team_queue(api, jobs_namespace, {"cpu": "500m", "memory": "16Gi"}) as names:
            yield names
    finally:
        kueue.stop()


def _manifest(e2e: E2ECluster, low: str) -> dict[str, Any]:
    return tiny_job(
        e2e,
        JOB,
        queueName="team",
        workloadPriorityClassName=low,
        train={"lr": 3e-3, "warmupSteps": 10, "checkpointEvery": 4},
        learnerUnits=[{"name": n, "replicas": 1, "batchSize": 8, "resources": UNIT} for n in ("a", "b")],
    )


def _urgent(e2e: E2ECluster, high: str) -> dict[str, Any]:
    """A higher-priority Job in the same queue: 250m CPU for 40 s."""
    return {
        "metadata": {"name": "urgent", "labels": {"kueue.x-k8s.io/queue-name": "team",
                                                  "kueue.x-k8s.io/priority-class": high}},
        "spec": {
            "suspend": True,
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "work", "image": e2e.images["worker"], "imagePullPolicy": "IfNotPresent",
                                "command": ["python", "-c", "import time; time.sleep(40)"], "resources": {"requests": {"cpu": "250m", "memory": "64Mi"}}}],
            }},
        },
    }  # fmt: skip


def _phase(api: k8s.ApiClient, ns: str) -> str:
    """The job's phase, its units' readiness and the conditions that are not met, for a message."""
    status = job_status(api, ns, JOB)
    units = [(u["name"], u.get("reason"), u.get("admission")) for u in status.get("units") or []]
    unmet = [
        (c["type"], c.get("reason"), c.get("message"))
        for c in status.get("conditions") or []
        if c["status"] != "True"
    ]
    return f"phase {status.get('phase')}; units {units}; unmet {unmet}"


def _wait_running(api: k8s.ApiClient, ns: str, what: str) -> None:
    """The phase follows the pods' readiness probes, which a loaded node can fail for a few periods
    (a unit or the synchronizer not ready for a moment is ``Degraded``, and says so): what is
    checked is that the job is ``Running`` within a minute and a half, not at one instant."""
    wait_for(lambda: job_status(api, ns, JOB)["phase"] == "Running", timeout=90, interval=2, what=what,
             describe=lambda: _phase(api, ns))  # fmt: skip


@pytest.mark.timeout(1500)
def test_a_preempted_unit_comes_back_while_the_other_trains_throughout(
    e2e: E2ECluster,
    api: k8s.ApiClient,
    storage_secret: str,
    jobs_namespace: str,
    operator: str,
    queue: dict[str, str],
) -> None:
    ns, core, batch = jobs_namespace, k8s.CoreV1Api(api), k8s.BatchV1Api(api)
    custom = k8s.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(
        "diloco.dev", "v1alpha1", ns, "dilocojobs", _manifest(e2e, queue["low"])
    )
    sync = Synchronizer(api, ns, JOB)

    def steps() -> dict[str, int]:
        try:
            return {x["learner_id"].rsplit("-", 2)[1]: x["step"] for x in sync.status()["learners"]}
        except Exception:  # the synchronizer's pod between two addresses
            return {}

    def admissions() -> dict[str, str | None]:
        return {u["name"]: u.get("admission") for u in job_status(api, ns, JOB).get("units") or []}

    try:
        wait_for(lambda: min(steps().get(u, 0) for u in ("a", "b")) >= 12, timeout=600, interval=3,
                 what="both units train 12 steps", describe=lambda: f"{steps()} {admissions()}")  # fmt: skip
        assert admissions() == {"a": "Admitted", "b": "Admitted"}
        batch.create_namespaced_job(ns, _urgent(e2e, queue["high"]))
        wait_for(lambda: sorted(admissions().values()) == ["Admitted", "Preempted"], timeout=120, interval=2,
                 what="one unit preempted", describe=lambda: str(admissions()))  # fmt: skip
        out = next(u for u, state in admissions().items() if state == "Preempted")
        kept = "a" if out == "b" else "b"
        _wait_running(api, ns, "the job runs on with one unit (quorum 1)")
        at_preemption = steps().get(kept, 0)
        wait_for(lambda: admissions().get(out) == "Admitted", timeout=300, interval=2,
                 what="the preempted unit admitted again after the urgent Job", describe=lambda: str(admissions()))  # fmt: skip
        assert steps().get(kept, 0) > at_preemption  # it trained while the other waited
        pod = f"{JOB}-{out}-0"
        resumed = wait_for(lambda: [ln for ln in pod_logs(core, ns, pod).splitlines() if "resumed from checkpoint" in ln],
                           timeout=300, interval=3, what=f"{pod} resumes from its checkpoint")  # fmt: skip
        assert resumed
        before = steps().get(out, 0)
        wait_for(
            lambda: steps().get(out, 0) > before, timeout=300, interval=3, what=f"unit {out} trains again"
        )
        _wait_running(api, ns, "the job runs with both units again")
    finally:
        custom.delete_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", JOB)
        batch.delete_namespaced_job("urgent", ns, propagation_policy="Background")
        wait_for(lambda: not core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={JOB}").items,
                 timeout=180, what="the job's pods gone")  # fmt: skip
