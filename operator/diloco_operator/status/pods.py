"""A pod as the status sees it: what its latest watch event says (ready, placed, template, and
what its container said as it ended)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from diloco_operator.builders.names import (
    COMPONENT_LABEL,
    JOB_LABEL,
    SHARD_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    UNIT_LABEL,
)


@dataclass(frozen=True)
class PodObserved:
    """One pod of a job, as its latest watch event showed it."""

    name: str
    uid: str
    component: str  # "learner", "synchronizer" or "export"
    unit: str  # the learner unit ("" for a synchronizer pod)
    shard: str  # the synchronizer shard ("" for a learner pod)
    phase: str
    ready: bool
    deleting: bool
    unschedulable: str  # the scheduler's message when it cannot place the pod, else ""
    template: str  # the pod template's hash annotation ("" when it has none)
    message: str = ""  # the termination message of its (first) container, once it ended (or of its last run)
    image_problem: str = ""  # why a container of it cannot get its image (which image, the kubelet's words)
    crash_loop: str = ""  # a container of it restarting over and over: its last words


def observe_pod(obj: Mapping[str, Any]) -> PodObserved:
    meta: Mapping[str, Any] = obj.get("metadata") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    status: Mapping[str, Any] = obj.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    unschedulable = next(
        (
            str(c.get("message") or "the scheduler cannot place it")
            for c in conditions
            if c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ),
        "",
    )
    return PodObserved(
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        component=labels.get(COMPONENT_LABEL, ""),
        unit=labels.get(UNIT_LABEL, ""),
        shard=labels.get(SHARD_LABEL, ""),
        phase=str(status.get("phase") or ""),
        ready=ready,
        deleting=bool(meta.get("deletionTimestamp")),
        unschedulable=unschedulable,
        template=str((meta.get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION, "")),
        message=termination_message(status),
        image_problem=image_problem(status),
        crash_loop=crash_loop(status),
    )


IMAGE_WAITING = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")


def waiting_container(
    status: Mapping[str, Any], reasons: Collection[str]
) -> tuple[Mapping[str, Any], str, str]:
    """The first container of the pod (init containers first) that waits for one of ``reasons``: its
    status, the reason and the kubelet's message; ({}, "", "") when none does."""
    for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting: Mapping[str, Any] = (c.get("state") or {}).get("waiting") or {}
        reason = str(waiting.get("reason") or "")
        if reason in reasons:
            return c, reason, str(waiting.get("message") or "").strip()
    return {}, "", ""


def crash_loop(status: Mapping[str, Any]) -> str:
    """A container of the pod that the kubelet holds back after repeated crashes: which, and what it
    said as it last ended ("" when none is)."""
    c, reason, _ = waiting_container(status, ("CrashLoopBackOff",))
    if not reason:
        return ""
    last = str(((c.get("lastState") or {}).get("terminated") or {}).get("message") or "").strip()
    said = last.splitlines()[-1] if last else ""
    return f"{c.get('name', '')}: {reason}" + (f": {said}" if said else "")


def image_problem(status: Mapping[str, Any]) -> str:
    """Why a container of the pod waits for an image it cannot get: the image, the kubelet's reason
    and message ("" when none does)."""
    c, reason, said = waiting_container(status, IMAGE_WAITING)
    if not reason:
        return ""
    return f"image {c.get('image', '')!r} ({c.get('name', '')}): {reason}" + (f": {said}" if said else "")


def termination_message(status: Mapping[str, Any]) -> str:
    """What the pod's first container said as it ended; while it runs again or waits to (a
    restarted container), what it said as its last run ended ("" when it never ended)."""
    containers = status.get("containerStatuses") or []
    first: Mapping[str, Any] = containers[0] if containers else {}
    for state in ("state", "lastState"):
        terminated = (first.get(state) or {}).get("terminated") or {}
        if terminated:
            return str(terminated.get("message") or "")
    return ""


def pod_job(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, job name) of a pod the operator manages; None for a pod of no job."""
    meta: Mapping[str, Any] = obj.get("metadata") or {}
    job = (meta.get("labels") or {}).get(JOB_LABEL)
    return (str(meta.get("namespace")), str(job)) if job else None
