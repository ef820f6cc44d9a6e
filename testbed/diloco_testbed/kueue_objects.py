"""The Kueue objects tests, benchmarks and ``make cluster`` create: a ClusterQueue over one flavor,
and a team's queue (flavor, ClusterQueue, a low and a high WorkloadPriorityClass, the LocalQueue
``team`` in a namespace labelled for Kueue's webhooks)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kubernetes import client as k8s

API = ("kueue.x-k8s.io", "v1beta2")
NAMESPACE_LABEL = "diloco-kueue"
TEAM_QUEUE = "team"
LOW, HIGH = 10, 1000


def kueue_object(kind: str, name: str, **fields: Any) -> dict[str, Any]:
    return {"apiVersion": "/".join(API), "kind": kind, "metadata": {"name": name}, **fields}


def cluster_queue(name: str, flavor: str, quota: Mapping[str, str]) -> dict[str, Any]:
    """A ClusterQueue with ``quota`` (resource name: nominal quota) of one flavor, in which a higher
    priority preempts a lower one."""
    return kueue_object(
        "ClusterQueue",
        name,
        spec={
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": list(quota),
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [{"name": r, "nominalQuota": q} for r, q in quota.items()],
                        }
                    ],
                }
            ],
        },
    )


def cpu_quota(cpu: int | str, memory: str = "64Gi") -> dict[str, str]:
    """A quota of ``cpu`` CPUs (and ``memory``, enough not to matter)."""
    return {"cpu": str(cpu), "memory": memory}


def queued_pod(name: str, priority_class: str, cpu: str = "1") -> dict[str, Any]:
    """A plain pod in the team queue at ``priority_class``: another workload that holds ``cpu`` of
    the quota for as long as it exists (on kwok it never ends), preempting lower priorities."""
    return {
        "metadata": {
            "name": name,
            "labels": {
                "kueue.x-k8s.io/queue-name": TEAM_QUEUE,
                "kueue.x-k8s.io/priority-class": priority_class,
            },
        },
        "spec": {
            "containers": [
                {"name": "work", "image": "example.invalid/work", "resources": {"requests": {"cpu": cpu}}}
            ]
        },
    }


def label_for_kueue(api: k8s.ApiClient, namespace: str, on: bool = True) -> None:
    """Let (or stop letting) Kueue's webhooks see ``namespace``."""
    value = "true" if on else None
    k8s.CoreV1Api(api).patch_namespace(namespace, {"metadata": {"labels": {NAMESPACE_LABEL: value}}})


@contextmanager
def team_queue(api: k8s.ApiClient, namespace: str, quota: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """A flavor, a ClusterQueue of ``quota``, WorkloadPriorityClasses of priority LOW and HIGH, and
    the LocalQueue ``team`` in ``namespace``; yields their names (``flavor``, ``cluster_queue``,
    ``low``, ``high``) and removes them, and the namespace's label, afterwards."""
    custom = k8s.CustomObjectsApi(api)
    tag = uuid.uuid4().hex[:8]
    names = {
        "flavor": f"flavor-{tag}",
        "cluster_queue": f"cq-{tag}",
        "low": f"low-{tag}",
        "high": f"high-{tag}",
    }
    made: list[tuple[str, str]] = []
    label_for_kueue(api, namespace)
    try:
        custom.create_cluster_custom_object(
            *API, "resourceflavors", kueue_object("ResourceFlavor", names["flavor"])
        )
        made.append(("resourceflavors", names["flavor"]))
        queue = cluster_queue(names["cluster_queue"], names["flavor"], quota)
        custom.create_cluster_custom_object(*API, "clusterqueues", queue)
        made.append(("clusterqueues", names["cluster_queue"]))
        for key, value in (("low", LOW), ("high", HIGH)):
            priority = kueue_object("WorkloadPriorityClass", names[key], value=value, description="test")
            custom.create_cluster_custom_object(*API, "workloadpriorityclasses", priority)
            made.append(("workloadpriorityclasses", names[key]))
        local = kueue_object("LocalQueue", TEAM_QUEUE, spec={"clusterQueue": names["cluster_queue"]})
        custom.create_namespaced_custom_object(*API, namespace, "localqueues", local)
        yield names
    finally:
        for plural, name in reversed(made):
            custom.delete_cluster_custom_object(*API, plural, name)
        label_for_kueue(api, namespace, on=False)


def set_quota(api: k8s.ApiClient, names: Mapping[str, str], quota: Mapping[str, str]) -> None:
    """Change the team queue's ClusterQueue quota (``team_queue``'s names)."""
    spec = cluster_queue(names["cluster_queue"], names["flavor"], quota)["spec"]
    k8s.CustomObjectsApi(api).patch_cluster_custom_object(
        *API, "clusterqueues", names["cluster_queue"], {"spec": spec}
    )
