"""A job under Kueue (built from the Go module proxy, webhooks included) on a real apiserver,
controller-manager, scheduler and kwok: each learner unit is a workload of its own, admitted as the
quota allows while the others train, queued with Kueue's reason, preempted by a higher-priority
workload and admitted again; resizing a queued unit makes it a new workload."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diloco_testbed.kube import Cluster
from diloco_testbed.kueue import Kueue
from diloco_testbed.kueue_objects import API, cpu_quota, kueue_object, queued_pod, set_quota, team_queue
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
    """A LocalQueue ``team`` in ``namespace`` (labelled for Kueue), its ClusterQueue of 2 CPUs and
    flavor, low and high priority classes."""
    with team_queue(api, namespace, cpu_quota(2)) as names:
        yield names


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

    set_quota(api, queue, cpu_quota(5))
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
    core = k8s.CoreV1Api(api)
    core.create_namespaced_pod(namespace, queued_pod("urgent", queue["high"]))

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


def test_twenty_units_under_a_quota_of_eight(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner, queue: dict[str, str]
) -> None:
    set_quota(api, queue, cpu_quota(8))
    units = [one_cpu_unit(f"u{i:02d}") for i in range(20)]
    create_job(api, namespace, job_manifest("wide", units, queueName="team", diloco={"quorum": 4}))

    def counted() -> dict[str | None, int]:
        states = [s for s, _ in admissions(api, namespace, "wide").values()]
        return {s: states.count(s) for s in set(states)}

    wait_for(
        lambda: counted() == {"Admitted": 8, "Queued": 12} and len(running(api, namespace, "wide")) == 8,
        timeout=180,
        what="8 units admitted and running, 12 queued",
        describe=lambda: f"{counted()} running {len(running(api, namespace, 'wide'))}",
    )
    assert get_job(api, namespace, "wide")["status"]["phase"] == "Running"
    set_quota(api, queue, cpu_quota(20))
    wait_for(
        lambda: counted() == {"Admitted": 20} and len(running(api, namespace, "wide")) == 20,
        timeout=180,
        what="all 20 units admitted and running",
        describe=lambda: f"{counted()} running {len(running(api, namespace, 'wide'))}",
    )


def test_a_flavors_nodes_and_gpus_reach_the_units_pods(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner, queue: dict[str, str]
) -> None:
    """A ResourceFlavor's node labels place an admitted unit's pods (Kueue adds them to the pods'
    node selector), and the GPUs a unit asks for are counted against the flavor's quota."""
    custom = k8s.CustomObjectsApi(api)
    region_b = {
        "metadata": {"name": queue["flavor"]},
        "spec": {"nodeLabels": {"topology.kubernetes.io/region": "region-b"}},
    }
    custom.patch_cluster_custom_object(*API, "resourceflavors", queue["flavor"], region_b)
    set_quota(api, queue, cpu_quota(8) | {"nvidia.com/gpu": "4"})
    g = unit("g", 2, gpus=2, resources={"requests": {"cpu": "1", "memory": "16Mi"}})
    create_job(api, namespace, job_manifest("placed", [g], queueName="team"))

    def placed() -> bool:
        pods = [p for p in learner_pods(api, namespace, "placed") if p.status.phase == "Running"]
        return len(pods) == 2 and all((p.spec.node_name or "").startswith("kwok-b-") for p in pods)

    wait_for(placed, timeout=120, what="unit g's 2 pods running on region-b nodes",
             describe=lambda: str(admissions(api, namespace, "placed")))  # fmt: skip
    patch_spec(api, namespace, "placed", {"learnerUnits": [g, unit("h", 1, gpus=2)]})

    # 4 GPUs in the quota, g holds them all: h waits, and Kueue says for what
    def h_waits_for_gpus() -> bool:
        units = {u["name"]: u for u in get_job(api, namespace, "placed").get("status", {}).get("units") or []}
        h = units.get("h", {})
        return (
            units.get("g", {}).get("admission") == "Admitted"
            and h.get("admission") == "Queued"
            and ("nvidia.com/gpu" in h.get("message", ""))
        )

    wait_for(h_waits_for_gpus, timeout=60, what="g admitted, h queued for GPUs",
             describe=lambda: str(get_job(api, namespace, "placed").get("status", {}).get("units")))  # fmt: skip
    (pod, *_) = learner_pods(api, namespace, "placed", "g")
    assert pod.spec.node_selector["topology.kubernetes.io/region"] == "region-b"


def test_a_units_pods_are_placed_in_one_topology_domain(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner, queue: dict[str, str]
) -> None:
    """Kueue's topology-aware scheduling: a unit asking for one region gets both its pods there,
    though neither node of that region holds both (20 of each node's 32 CPUs per pod)."""
    custom = k8s.CustomObjectsApi(api)
    levels = [{"nodeLabel": "topology.kubernetes.io/region"}, {"nodeLabel": "kubernetes.io/hostname"}]
    topology = kueue_object("Topology", f"regions-{queue['flavor']}", spec={"levels": levels})
    custom.create_cluster_custom_object(*API, "topologies", topology)
    try:
        flavor = {"spec": {"nodeLabels": {"type": "kwok"}, "topologyName": topology["metadata"]["name"]}}
        custom.patch_cluster_custom_object(*API, "resourceflavors", queue["flavor"], flavor)
        set_quota(api, queue, cpu_quota(64))
        big = unit("r", 2, resources={"requests": {"cpu": "20", "memory": "16Mi"}})
        big["topology"] = {"required": "topology.kubernetes.io/region"}
        create_job(api, namespace, job_manifest("racked", [big], queueName="team"))

        def one_region() -> set[str] | None:
            pods = [p for p in learner_pods(api, namespace, "racked") if p.status.phase == "Running"]
            nodes = {p.spec.node_name for p in pods}
            return {n.rsplit("-", 1)[0] for n in nodes} if len(pods) == 2 and len(nodes) == 2 else None

        regions = wait_for(one_region, timeout=120, what="unit r's 2 pods running on 2 nodes",
                           describe=lambda: str(admissions(api, namespace, "racked")))  # fmt: skip
        assert regions is not None
        assert len(regions) == 1, regions  # kwok-a-* or kwok-b-*: one region
        (pod, *_) = learner_pods(api, namespace, "racked")
        annotations = pod.metadata.annotations
        assert annotations["kueue.x-k8s.io/podset-required-topology"] == "topology.kubernetes.io/region"
    finally:
        # (its flavor, which names it, goes with the queue fixture)
        custom.delete_cluster_custom_object(*API, "topologies", topology["metadata"]["name"])


def test_the_jobs_queue_label_queues_it_and_a_missing_queue_is_named(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner, queue: dict[str, str]
) -> None:
    labelled = job_manifest("labelled", [one_cpu_unit("a")])
    labelled["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
    create_job(api, namespace, labelled)
    wait_for(lambda: admissions(api, namespace, "labelled") == {"a": ("Admitted", "Ready")}, timeout=120,
             what="the labelled job's unit admitted", describe=lambda: str(admissions(api, namespace, "labelled")))  # fmt: skip
    sts = k8s.AppsV1Api(api).read_namespaced_stateful_set("labelled-a", namespace)
    assert sts.metadata.labels["kueue.x-k8s.io/queue-name"] == "team"

    create_job(api, namespace, job_manifest("lost", [one_cpu_unit("a")], queueName="nowhere"))

    def named() -> bool:
        status = get_job(api, namespace, "lost").get("status") or {}
        valid = {c["type"]: c for c in status.get("conditions", [])}.get("SpecValid", {})
        return valid.get("reason") == "InvalidSpec" and "LocalQueue 'nowhere'" in valid.get("message", "")

    wait_for(named, timeout=30, what="the missing LocalQueue named in the status")
    assert learner_pods(api, namespace, "lost") == []
