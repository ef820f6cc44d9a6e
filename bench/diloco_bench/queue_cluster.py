"""What `diloco bench queue` puts on the test control plane: the two shapes of the same 4-learner job
(4 one-pod units, or one unit of 4 pods that Kueue can only admit whole), and reading which
learners' pods run. The Kueue objects are ``diloco_testbed.kueue_objects``'."""

from __future__ import annotations

from typing import Any

from diloco_testbed.kueue_objects import TEAM_QUEUE

from diloco_bench.operator_cluster import bench_job

LEARNERS = 4
UNITS = ("a", "b", "c", "d")  # the elastic job's units, one per learner
WHOLE_UNIT = "all"  # the whole job's one unit of LEARNERS pods


def job_manifest(name: str, mode: str, priority_class: str) -> dict[str, Any]:
    """The job in ``mode``: ``elastic`` (each learner a unit, admitted on its own) or ``whole`` (one
    unit of all the learners' pods: one Kueue workload, admitted only when all of them fit, as a
    data-parallel job is)."""
    resources = {"requests": {"cpu": "1", "memory": "16Mi"}}
    if mode == "elastic":
        units = [{"name": u, "replicas": 1, "resources": resources} for u in UNITS[:LEARNERS]]
    elif mode == "whole":
        units = [{"name": WHOLE_UNIT, "replicas": LEARNERS, "resources": resources}]
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return bench_job(name, units, queueName=TEAM_QUEUE, workloadPriorityClassName=priority_class)


def learner_of(pod: dict[str, Any]) -> int | None:
    """The learner a job's pod runs: its unit's place in ``UNITS``, or for the whole job's unit the
    pod's ordinal."""
    meta = pod.get("metadata") or {}
    unit = (meta.get("labels") or {}).get("diloco.dev/unit", "")
    if unit == WHOLE_UNIT:
        ordinal = str(meta.get("name", "")).rsplit("-", 1)[-1]
        return int(ordinal) if ordinal.isdigit() else None
    return UNITS.index(unit) if unit in UNITS else None


def running_learners(pods: list[dict[str, Any]]) -> set[int]:
    """The learners whose pod runs now (Running, not being deleted): on kwok, where a pod is only
    its object, the pods Kueue let through."""
    running = set()
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (pod.get("status") or {}).get("phase") != "Running" or meta.get("deletionTimestamp"):
            continue
        learner = learner_of(pod)
        if learner is not None:
            running.add(learner)
    return running
