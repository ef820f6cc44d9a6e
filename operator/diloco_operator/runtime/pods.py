"""What the pod watch tells about a job's pods: which are ready, which the scheduler cannot place,
which pod template each was made from, which units the operator's restart has not yet brought back,
and learner units losing a pod and getting it back.

The operator watches the pods it manages (label ``app.kubernetes.io/managed-by``), and every event
lands in :class:`PodCache`; the job's status is computed from it (``unit_observations``,
``sync_observation``), so the status follows the pods as the watch delivers them, in order, and
needs no LIST. A synchronizer that exits because another job owns its storage prefix says so in
its termination message (``sync_storage_conflict``). The decisions here are pure; the cache only keeps the latest view of each pod.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from diloco_core.ownership import find_conflict

from diloco_operator.schema.spec import DiLoCoJobSpec
from diloco_operator.status.admission import Admission
from diloco_operator.status.events import Event
from diloco_operator.status.pods import PodObserved, observe_pod, pod_job
from diloco_operator.status.units import UnitObserved


class PodCache:
    """The latest view of every pod of every job, by (namespace, job) and pod name.

    Written by the watch (kopf's event loop), read by the status passes (worker threads): a lock
    keeps each read a consistent copy.
    """

    def __init__(self) -> None:
        self._pods: dict[tuple[str, str], dict[str, PodObserved]] = {}
        self._lock = threading.Lock()

    def update(self, obj: Mapping[str, Any], *, deleted: bool) -> tuple[str, str] | None:
        """Record one watch event; returns the pod's job (namespace, name), None for no job."""
        key = pod_job(obj)
        if key is None:
            return None
        pod = observe_pod(obj)
        with self._lock:
            pods = self._pods.setdefault(key, {})
            current = pods.get(pod.name)
            if deleted:
                if current is not None and current.uid == pod.uid:  # not its replacement
                    del pods[pod.name]
            else:
                pods[pod.name] = pod
        return key

    def pods(self, namespace: str, job: str) -> list[PodObserved]:
        with self._lock:
            return sorted((self._pods.get((namespace, job)) or {}).values(), key=lambda p: p.name)

    def forget(self, namespace: str, job: str) -> None:
        with self._lock:
            self._pods.pop((namespace, job), None)


def unit_observations(
    spec: DiLoCoJobSpec, pods: Iterable[PodObserved], admissions: Mapping[str, Admission] | None = None
) -> list[UnitObserved]:
    """Each learner unit as its pods show it: pods ready (a deleted pod no longer counts), the
    scheduler's message about one it cannot place, and its admission by Kueue (under a queue)."""
    by_unit: dict[str, list[PodObserved]] = {}
    for pod in pods:
        if pod.component == "learner":
            by_unit.setdefault(pod.unit, []).append(pod)
    out = []
    for unit in spec.learner_units:
        mine = by_unit.get(unit.name, [])
        live = [p for p in mine if not p.deleting]
        out.append(
            UnitObserved(
                unit.name,
                len(live),
                sum(1 for p in live if p.ready),
                exists=bool(mine),
                unschedulable=next((p.unschedulable for p in live if p.unschedulable), ""),
                image_problem=next((p.image_problem for p in live if p.image_problem), ""),
                admission=(admissions or {}).get(unit.name),
            )
        )
    return out


def live_sync_pods(pods: Iterable[PodObserved]) -> list[PodObserved]:
    """The job's synchronizer pods that are not being deleted."""
    return [p for p in pods if p.component == "synchronizer" and not p.deleting]


def sync_observation(spec: DiLoCoJobSpec, pods: Iterable[PodObserved]) -> tuple[bool, str]:
    """Whether every synchronizer shard has a ready pod, and the scheduler's message about a
    synchronizer pod it cannot place ("" when none)."""
    live = live_sync_pods(pods)
    ready_shards = {p.shard for p in live if p.ready}
    ready = all(str(i) in ready_shards for i in range(spec.synchronizer.shards))
    return ready, next((p.unschedulable for p in live if p.unschedulable), "")


def sync_image_problem(pods: Iterable[PodObserved]) -> str:
    """Why a synchronizer pod cannot get its image ("" when none waits for one)."""
    return next((p.image_problem for p in live_sync_pods(pods) if p.image_problem), "")


def sync_storage_conflict(pods: Iterable[PodObserved]) -> str:
    """Why a synchronizer pod that is not ready refuses its storage: the prefix belongs to another
    job (``diloco_core.ownership``), as its container told when it last exited ("" when none did)."""
    told = (find_conflict(p.message) for p in live_sync_pods(pods) if not p.ready)
    return next((conflict for conflict in told if conflict), "")


def outdated_pods(pods: Iterable[PodObserved], templates: Mapping[str, str]) -> dict[str, list[PodObserved]]:
    """Per learner unit, its pods made from another pod template than the unit's current one
    (``templates``: unit -> template hash); pods already being deleted are left alone."""
    out: dict[str, list[PodObserved]] = {}
    for pod in pods:
        want = templates.get(pod.unit)
        if pod.component == "learner" and want and not pod.deleting and pod.template != want:
            out.setdefault(pod.unit, []).append(pod)
    return out


@dataclass(frozen=True)
class Restart:
    """The operator's restart of a learner unit: when it deleted the unit's outdated pods (epoch
    seconds) and the pod template it restarted them into."""

    since: float
    template: str


def restarts_under_way(
    spec: DiLoCoJobSpec,
    pods: Iterable[PodObserved],
    started: Mapping[str, Restart],
    now: float,
) -> dict[str, Restart]:
    """The operator's restarts of learner units that are still under way: younger than
    ``unitLostAfterSeconds``, and the unit not yet back (as many live pods as its replicas, each
    ready and made from the template it was restarted into). A unit no longer in the spec is back."""
    replicas = {u.name: u.replicas for u in spec.learner_units}
    live: dict[str, list[PodObserved]] = {}
    for pod in pods:
        if pod.component == "learner" and not pod.deleting:
            live.setdefault(pod.unit, []).append(pod)
    out = {}
    for unit, restart in started.items():
        if unit not in replicas:
            continue
        mine = live.get(unit, [])
        back = len(mine) >= replicas[unit] and all(p.ready and p.template == restart.template for p in mine)
        if not back and now - restart.since <= spec.unit_lost_after_seconds:
            out[unit] = restart
    return out


def restarting_into(restarts: Mapping[str, Restart], templates: Mapping[str, str]) -> set[str]:
    """The units restarting into their current pod template (``templates``). One restarted into a
    template it no longer has (the image corrected while its pods could not pull the wrong one) is
    outdated again: the rollout restarts it anew, and first, as it is not ready. Its restart still
    counts as the operator's doing (no loss) until then."""
    return {unit for unit, restart in restarts.items() if restart.template == templates.get(unit)}


class PodWatch:
    """Reports a learner unit losing a pod (failed or no longer ready) and the replacement rejoining.

    Fed with every learner pod event, so a pod that is replaced within a second is still seen.
    A StatefulSet's replacement pod has the same name, which ties the two reports together.
    Deleting a pod (scaling, suspend, a restart for a new template) is not a loss, nor is the
    ``Failed`` phase the kubelet gives a pod seen being deleted before it failed (its containers
    ended on SIGTERM). A pod seen ``Failed`` first, even as its StatefulSet deletes it, is a loss.
    The memory is per operator process.
    """

    def __init__(self) -> None:
        self._pods: dict[str, tuple[bool, bool, bool]] = {}  # ready, lost, deleted before it failed

    def observe(
        self, key: str, unit: str, *, phase: str, ready: bool, deleted: bool, gone: bool = False
    ) -> Event | None:
        """``deleted``: the pod is being deleted or gone; ``gone``: its last event (a replacement of
        the same name starts afresh)."""
        was_ready, lost, stopping = self._pods.get(key, (False, False, False))
        stopping = stopping or (deleted and phase != "Failed")
        pod = key.rsplit("/", 1)[-1]
        event = None
        failed = phase == "Failed" and not stopping
        if not lost and (failed or (was_ready and not ready and not deleted)):
            lost = True
            why = "failed" if phase == "Failed" else "is no longer ready"
            event = Event("Warning", "UnitLost", f"learner unit {unit}: pod {pod} {why}")
        elif lost and ready and phase == "Running" and not deleted:
            lost = False
            event = Event("Normal", "UnitRejoined", f"learner unit {unit}: pod {pod} is back and ready")
        if gone and not lost:
            self._pods.pop(key, None)
        else:
            self._pods[key] = (ready and not deleted, lost, stopping)
        return event
