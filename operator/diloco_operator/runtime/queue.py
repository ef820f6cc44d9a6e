"""Learner units under a Kueue queue: what Kueue does not let change in place.

Kueue keeps one Workload per unit's StatefulSet, sized and shaped like it (its pod count, each
container's requests and ports, node selector, affinity, tolerations ...): it refuses to change
those on a StatefulSet whose pods it may have admitted, except by scaling to zero and back. So a
unit whose size or shape changes under a queue is deleted and created anew (its checkpoints are in
object storage: it resumes from them, see ``diloco_worker.resume``) and queued again as the new
workload it is; a new image or environment changes in place (a rolling restart, as without a queue).
Pure: the caller deletes.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from diloco_operator.builders.names import (
    PREFERRED_TOPOLOGY_ANNOTATION,
    QUEUE_LABEL,
    REQUIRED_TOPOLOGY_ANNOTATION,
)
from diloco_operator.kube import is_subset
from diloco_operator.schema.spec import DiLoCoJobSpec

_PLACEMENT = ("nodeSelector", "affinity", "tolerations", "runtimeClassName", "topologySpreadConstraints")


def _requests(container: Mapping[str, Any]) -> dict[str, Decimal]:
    requests = (container.get("resources") or {}).get("requests") or {}
    return {str(k): parse_quantity(v) for k, v in requests.items()}


def _ports(container: Mapping[str, Any]) -> list[tuple[str, int]]:
    return [(str(p.get("name", "")), int(p.get("containerPort", 0))) for p in container.get("ports") or []]


def _containers(pod: Mapping[str, Any]) -> list[tuple[dict[str, Decimal], list[tuple[str, int]]]]:
    return [(_requests(c), _ports(c)) for c in pod.get("containers") or []]


def with_job_queue(spec: DiLoCoJobSpec, job_meta: Mapping[str, Any]) -> DiLoCoJobSpec:
    """``spec`` with the job's own ``kueue.x-k8s.io/queue-name`` label as its queue when
    ``spec.queueName`` names none (the label Kueue's users put on every object they queue)."""
    label = (job_meta.get("labels") or {}).get(QUEUE_LABEL)
    if spec.queue_name or not label:
        return spec
    return spec.model_copy(update={"queue_name": str(label)})


def queue_problem(spec: DiLoCoJobSpec) -> str | None:
    """What in the spec needs a queue it does not have: a unit's topology is Kueue's to place."""
    placed = [u.name for u in spec.learner_units if u.topology is not None]
    if placed and not spec.queue_name:
        return (
            f"learnerUnits {', '.join(placed)} set a topology, which Kueue's topology-aware scheduling "
            "places: set spec.queueName (or the job's kueue.x-k8s.io/queue-name label)"
        )
    return None


def queue_locked_change(desired: Mapping[str, Any], current: Mapping[str, Any] | None) -> str | None:
    """What Kueue would refuse to change in place on the unit's StatefulSet ``current`` to make it
    ``desired`` (None: nothing, or the unit is not under a queue, or has no pods to admit)."""
    if current is None:
        return None
    labels = desired["metadata"].get("labels") or {}
    queue = labels.get(QUEUE_LABEL)
    old_queue = (current["metadata"].get("labels") or {}).get(QUEUE_LABEL)
    if queue is None and old_queue is None:
        return None
    want, have = int(desired["spec"].get("replicas") or 0), int(current["spec"].get("replicas") or 0)
    if want == 0 or have == 0:
        return None  # scaling to or from zero is allowed
    if queue != old_queue:
        return f"its queue ({old_queue or 'none'} -> {queue or 'none'})"
    if want != have:
        return f"its size ({have} -> {want} pods)"
    topology = (REQUIRED_TOPOLOGY_ANNOTATION, PREFERRED_TOPOLOGY_ANNOTATION)
    notes = desired["spec"]["template"]["metadata"].get("annotations") or {}
    old_notes = current["spec"]["template"]["metadata"].get("annotations") or {}
    if any(notes.get(k) != old_notes.get(k) for k in topology):
        return "its topology"
    pod, old_pod = desired["spec"]["template"]["spec"], current["spec"]["template"]["spec"]
    if _containers(pod) != _containers(old_pod):
        return "its containers' resource requests or ports"
    for field in _PLACEMENT:
        if not is_subset(pod.get(field), old_pod.get(field)) and (pod.get(field) or old_pod.get(field)):
            return f"its pods' {field}"
    return None
