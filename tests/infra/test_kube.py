"""The test cluster is real: StatefulSets get Running, Ready pods on kwok nodes, and kwok's
failure stage fails a pod that the StatefulSet controller then replaces."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from diloco_testbed.kube import Cluster
from diloco_testbed.kwok import FAIL_LABEL
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s
from kubernetes import watch

pytestmark = pytest.mark.integration

DEADLINE = 180.0  # seconds; generous because the machine may be busy
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"  # preloaded on kind nodes; never pulled under kwok


@pytest.fixture
def core(kube: Cluster) -> Iterator[k8s.CoreV1Api]:
    with kube.api_client() as api:
        yield k8s.CoreV1Api(api)


@pytest.fixture
def apps(kube: Cluster) -> Iterator[k8s.AppsV1Api]:
    with kube.api_client() as api:
        yield k8s.AppsV1Api(api)


def _statefulset(name: str, replicas: int) -> k8s.V1StatefulSet:
    labels = {"app": name}
    container = k8s.V1Container(name="main", image=PAUSE_IMAGE)
    return k8s.V1StatefulSet(
        metadata=k8s.V1ObjectMeta(name=name),
        spec=k8s.V1StatefulSetSpec(
            replicas=replicas,
            service_name=name,
            pod_management_policy="Parallel",
            selector=k8s.V1LabelSelector(match_labels=labels),
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                spec=k8s.V1PodSpec(containers=[container], termination_grace_period_seconds=0),
            ),
        ),
    )


def _running_ready(pod: k8s.V1Pod) -> bool:
    conditions = pod.status.conditions or []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    return pod.status.phase == "Running" and ready and pod.metadata.deletion_timestamp is None


def _create_statefulset(
    apps: k8s.AppsV1Api, core: k8s.CoreV1Api, namespace: str, name: str, replicas: int
) -> None:
    service = k8s.V1Service(
        metadata=k8s.V1ObjectMeta(name=name),
        spec=k8s.V1ServiceSpec(cluster_ip="None", selector={"app": name}, ports=[k8s.V1ServicePort(port=80)]),
    )
    core.create_namespaced_service(namespace, service)
    apps.create_namespaced_stateful_set(namespace, _statefulset(name, replicas))


def _wait_running(core: k8s.CoreV1Api, namespace: str, name: str, replicas: int) -> list[k8s.V1Pod]:
    def pods() -> list[k8s.V1Pod]:
        return list(core.list_namespaced_pod(namespace, label_selector=f"app={name}").items)

    def all_running() -> list[k8s.V1Pod] | None:
        current = [p for p in pods() if _running_ready(p)]
        return current if len(current) == replicas else None

    def describe() -> str:
        return (
            ", ".join(f"{p.metadata.name}={p.status.phase}@{p.spec.node_name}" for p in pods()) or "no pods"
        )

    return wait_for(
        all_running, timeout=DEADLINE, what=f"{replicas} Running, Ready pods of {name}", describe=describe
    )


@pytest.mark.kwok
def test_statefulset_pods_run_on_kwok_nodes(
    kube: Cluster, core: k8s.CoreV1Api, apps: k8s.AppsV1Api, namespace: str
) -> None:
    _create_statefulset(apps, core, namespace, "trio", replicas=3)
    pods = _wait_running(core, namespace, "trio", replicas=3)

    assert sorted(p.metadata.name for p in pods) == ["trio-0", "trio-1", "trio-2"]
    assert all(p.spec.node_name in kube.node_names for p in pods)
    status = wait_for(
        lambda: (s := apps.read_namespaced_stateful_set_status("trio", namespace).status).ready_replicas == 3
        and s,
        timeout=DEADLINE,
        what="StatefulSet status readyReplicas=3",
    )
    assert status.replicas == 3


def test_control_plane_reports_its_version(kube: Cluster) -> None:
    if not kube.has_kwok:
        pytest.skip(
            "checks the control plane built by scripts/build-test-binaries.sh, not an existing cluster"
        )
    with kube.api_client() as api:
        assert k8s.VersionApi(api).get_code().git_version == "v1.34.3"
        nodes = k8s.CoreV1Api(api).list_node(label_selector="type=kwok").items
    regions = {n.metadata.labels["topology.kubernetes.io/region"] for n in nodes}
    assert len(nodes) >= 2
    assert len(regions) >= 2
    assert all(n.status.allocatable["nvidia.com/gpu"] == "8" for n in nodes)


def _watch_phases(
    core: k8s.CoreV1Api, namespace: str, pod: str, uid: str, since: str, seen: list[str]
) -> None:
    """Record every phase the pod with `uid` goes through, from resourceVersion `since` on."""
    stream = watch.Watch()
    for event in stream.stream(
        core.list_namespaced_pod,
        namespace,
        field_selector=f"metadata.name={pod}",
        resource_version=since,
        timeout_seconds=int(DEADLINE),
    ):
        obj = event["object"]
        if obj.metadata.uid == uid:
            seen.append(obj.status.phase)
            if obj.status.phase == "Failed" or event["type"] == "DELETED":
                stream.stop()


@pytest.mark.kwok  # kwok's failure stage exists only in the test control plane
def test_failed_pod_is_replaced(
    kube: Cluster, core: k8s.CoreV1Api, apps: k8s.AppsV1Api, namespace: str
) -> None:
    _create_statefulset(apps, core, namespace, "victim", replicas=2)
    _wait_running(core, namespace, "victim", replicas=2)
    old = core.read_namespaced_pod("victim-1", namespace)
    phases: list[str] = []
    watcher = threading.Thread(
        target=_watch_phases,
        args=(core, namespace, "victim-1", old.metadata.uid, old.metadata.resource_version, phases),
        daemon=True,
    )
    watcher.start()

    core.patch_namespaced_pod("victim-1", namespace, {"metadata": {"labels": {FAIL_LABEL: "true"}}})

    watcher.join(timeout=DEADLINE)
    assert "Failed" in phases, f"the labelled pod went through {phases}, never Failed"

    def replaced() -> k8s.V1Pod | None:
        pod = core.read_namespaced_pod("victim-1", namespace)
        return pod if pod.metadata.uid != old.metadata.uid and _running_ready(pod) else None

    new = wait_for(replaced, timeout=DEADLINE, what="a new Running, Ready victim-1")
    assert FAIL_LABEL not in (new.metadata.labels or {})
    survivor = core.read_namespaced_pod("victim-0", namespace)
    assert _running_ready(survivor)
