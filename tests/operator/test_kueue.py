"""A job under Kueue (built from the Go module proxy, webhooks included) on a real apiserver,
controller-manager, scheduler and kwok: each learner unit is a workload of its own, admitted as the
quota allows while the others train, queued with Kueue's reason, preempted by a higher-priority
workload and admitted again; resizing a queued unit makes it a new workload."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diloco_testbed.kube import Cluster
from diloco_testbed.kueue import API, NAMESPACE_LABEL, Kueue
from diloco_testbed.waiting import wait_for
from kopf.testing import KopfRunner
from kubernetes import client as k8s

from tests.operator.kubejobs import create_job, get_job, job_manifest, learner_pods, patch_spec, unit

pytestmark = [pytest.mark.integration, pytest.mark.kwok]


@pytest.fixture(scope="module")
def kueue(kube: Cluster, test_logs_dir: Path) -> Iterator[Kueue]:
    runner = Kueue(kube, test_logs_dir / "kueue")
    runner.start()
    try:
        yield runner
    finally:
        runner.stop()


@pytest.fixture
def queue(api: k8s.ApiClient, namespace: str, kueue: Kueue) -> Iterator[dict[str, str]]:
    """A LocalQueue ``team`` in ``namespace`` (labelled for Kueue), its ClusterQueue and flavor."""
    k8s.CoreV1Api(api).patch_namespace(namespace, {"metadata": {"labels": {NAMESPACE_LABEL: "true"}}})
    custom = k8s.CustomObjectsApi(api)
    tag = uuid.uuid4().hex[:8]
    names = {
        "flavor": f"flavor-{tag}",
        "cluster_queue": f"cq-{tag}",
        "low": f"low-{tag}",
        "high": f"high-{tag}",
    }
    custom.create_cluster_custom_object(
        *API, "resourceflavors", kueue_object("ResourceFlavor", names["flavor"])
    )
    custom.create_cluster_custom_object(*API, "clusterqueues", cluster_queue(names, cpu=2))
    for name, value in ((names["low"], 10), (names["high"], 1000)):
        priority = kueue_object("WorkloadPriorityClass", name, value=value, description="test")
        custom.create_cluster_custom_object(*API, "workloadpriorityclasses", priority)
    local = kueue_object("LocalQueue", "team", spec={"clusterQueue": names["cluster_queue"]})
    custom.create_namespaced_custom_object(*API, namespace, "localqueues", local)
    yield names
    for plural, name in (
        ("clusterqueues", names["cluster_queue"]),
        ("resourceflavors", names["flavor"]),
        ("workloadpriorityclasses", names["low"]),
        ("workloadpriorityclasses", names["high"]),
    ):
        custom.delete_cluster_custom_object(*API, plural, name)


def kueue_object(kind: str, name: str, **fields: Any) -> dict[str, Any]:
    return {"apiVersion": "/".join(API), "kind": kind, "metadata": {"name": name}, **fields}


def cluster_queue(names: dict[str, str], cpu: int) -> dict[str, Any]:
    return kueue_object(
        "ClusterQueue",
        names["cluster_queue"],
        spec={
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [
                        {
                            "name": names["flavor"],
                            "resources": [
                                {"name": "cpu", "nominalQuota": str(cpu)},
                                {"name": "memory", "nominalQuota": "64Gi"},
                            ],
                        }
                    ],
                }
            ],
        },
    )


def set_quota(api: k8s.ApiClient, names: dict[str, str], cpu: int) -> None:
    k8s.CustomObjectsApi(api).patch_cluster_custom_object(
        *API, "clusterqueues", names["cluster_queue"], {"spec": cluster_queue(names, cpu)["spec"]}
    )


def one_cpu_unit(name: str, replicas: int = 1) -> dict[str, Any]:
    return unit(name, replicas, resources={"requests": {"cpu": "1", "memory": "16Mi"}})


def admissions(api: k8s.ApiClient, ns: str, job: str) -> dict[str, tuple[str | None, str]]:
    status = get_job(api, ns, job).get("status") or {}
    return {u["name"]: (u.get("admission"), u.get("reason", "")) for u in status.get("units") or []}


def running(api: k8s.ApiClient, ns: str, job: str) -> list[str]:
    return sorted(
        p.metadata.labels["diloco.dev/unit"]
        for p in learner_pods(api, ns, job)
        if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
    )


def test_units_are_admitted_as_the_quota_allows_and_resized_as_new_workloads(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner, queue: dict[str, str]
) -> None:
    units = [one_cpu_unit(n) for n in ("a", "b", "c", "d")]
    create_job(
        api, namespace, job_manifest("queued", units, queueName="team", diloco={"quorum": 2, "fragments": 4})
    )

    def two_admitted_two_queued() -> bool:
        got = admissions(api, namespace, "queued")
        states = sorted(state for state, _ in got.values())
        return (
            states == ["Admitted", "Admitted", "Queued", "Queued"]
            and len(running(api, namespace, "queued")) == 2
        )

    wait_for(two_admitted_two_queued, timeout=120, what="2 units admitted and running, 2 queued",
             describe=lambda: f"{admissions(api, namespace, 'queued')} running {running(api, namespace, 'queued')}")  # fmt: skip
    status = get_job(api, namespace, "queued")["status"]
    assert status["phase"] == "Running"  # the quorum trains; the job is not Degraded
    queued = [u for u in status["units"] if u.get("admission") == "Queued"]
    assert all(
        u["reason"] == "Queued" and "insufficient unused quota for cpu" in u.get("message", "")
        for u in queued
    ), queued
    gated = [p for p in learner_pods(api, namespace, "queued") if p.spec.scheduling_gates]
    assert len(gated) == 2  # Kueue holds their pods back

    set_quota(api, queue, cpu=5)
    wait_for(lambda: len(running(api, namespace, "queued")) == 4, timeout=120, what="all 4 units running")
    wait_for(
        lambda: {s for s, _ in admissions(api, namespace, "queued").values()} == {"Admitted"},
        timeout=60,
        what="all 4 units admitted",
    )

    # a unit's size is part of its workload: it is made anew, queued and admitted again
    apps = k8s.AppsV1Api(api)
    before = apps.read_namespaced_stateful_set("queued-a", namespace).metadata.uid
    patch_spec(api, namespace, "queued", {"learnerUnits": [one_cpu_unit("a", 2), *units[1:]]})
    wait_for(
        lambda: running(api, namespace, "queued").count("a") == 2,
        timeout=120,
        what="unit a running with 2 pods",
        describe=lambda: f"{admissions(api, namespace, 'queued')} running {running(api, namespace, 'queued')}",
    )
    assert apps.read_namespaced_stateful_set("queued-a", namespace).metadata.uid != before


def test_a_preempted_unit_waits_while_the_others_train_and_comes_back(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner, queue: dict[str, str]
) -> None:
    units = [one_cpu_unit("a"), one_cpu_unit("b")]
    manifest = job_manifest("spot", units, queueName="team", workloadPriorityClassName=queue["low"])
    create_job(api, namespace, manifest)  # quorum 1 (job_manifest)
    wait_for(lambda: running(api, namespace, "spot") == ["a", "b"], timeout=120, what="both units running")

    # a higher-priority workload: a plain Pod in the same queue (on kwok a Job's pods end at once)
    urgent = {
        "metadata": {
            "name": "urgent",
            "labels": {"kueue.x-k8s.io/queue-name": "team", "kueue.x-k8s.io/priority-class": queue["high"]},
        },
        "spec": {
            "containers": [
                {"name": "work", "image": "example.invalid/work", "resources": {"requests": {"cpu": "1"}}}
            ],
        },
    }
    core = k8s.CoreV1Api(api)
    core.create_namespaced_pod(namespace, urgent)

    def one_preempted() -> bool:
        states = admissions(api, namespace, "spot")
        return sorted(s for s, _ in states.values()) == ["Admitted", "Preempted"]

    wait_for(one_preempted, timeout=120, what="one unit preempted by the urgent pod",
             describe=lambda: str(admissions(api, namespace, "spot")))  # fmt: skip
    status = get_job(api, namespace, "spot")["status"]
    (preempted,) = [u for u in status["units"] if u.get("admission") == "Preempted"]
    assert preempted["reason"] == "Preempted"
    assert preempted["state"] == "NotReady"
    assert status["phase"] == "Running"  # the other unit keeps the quorum of 1
    wait_for(
        lambda: len(running(api, namespace, "spot")) == 1, timeout=60, what="the preempted unit's pod gone"
    )

    core.delete_namespaced_pod("urgent", namespace, grace_period_seconds=0)
    wait_for(
        lambda: running(api, namespace, "spot") == ["a", "b"], timeout=120, what="the unit admitted again"
    )
    wait_for(
        lambda: {s for s, _ in admissions(api, namespace, "spot").values()} == {"Admitted"},
        timeout=60,
        what="both units admitted",
    )
