"""What Kueue does not let change in place on a queued unit's StatefulSet, and the job's queue label."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from diloco_operator.builders.learners import build_statefulset
from diloco_operator.builders.names import PRIORITY_LABEL, QUEUE_LABEL, JobRef
from diloco_operator.runtime.queue import queue_locked_change, queue_problem, with_job_queue
from diloco_operator.schema.spec import SpecError, parse_spec

JOB = JobRef("llm", "team", "uid")
BASE: dict[str, Any] = {
    "images": {"worker": "w:1", "synchronizer": "s"},
    "storage": {"bucket": "bkt"},
    "queueName": "team-queue",
    "workloadPriorityClassName": "research",
    "learnerUnits": [
        {"name": "a", "replicas": 2, "resources": {"requests": {"cpu": "1000m", "memory": "2Gi"}}}
    ],
}


def _sts(**changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(BASE)
    body["learnerUnits"][0].update(changes.pop("unit", {}))
    body.update(changes)
    spec = parse_spec(body)
    return build_statefulset(JOB, spec, spec.learner_units[0], "digest", stopped=False)


def _as_stored(sts: dict[str, Any]) -> dict[str, Any]:
    """What the apiserver gives back: quantities in canonical form, defaults added."""
    stored = copy.deepcopy(sts)
    container = stored["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["requests"]["cpu"] = "1"
    for port in container["ports"]:
        port["protocol"] = "TCP"
    stored["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
    return stored


def test_each_unit_is_labelled_with_the_queue_and_priority() -> None:
    labels = _sts()["metadata"]["labels"]
    assert (labels[QUEUE_LABEL], labels[PRIORITY_LABEL]) == ("team-queue", "research")
    assert QUEUE_LABEL not in _sts(queueName=None)["metadata"]["labels"]


def test_an_image_change_or_the_same_object_as_stored_changes_in_place() -> None:
    current = _as_stored(_sts())
    assert queue_locked_change(_sts(), current) is None
    assert queue_locked_change(_sts(images={"worker": "w:2", "synchronizer": "s"}), current) is None
    assert queue_locked_change(_sts(), None) is None


def test_a_new_size_shape_or_queue_makes_the_unit_anew() -> None:
    current = _as_stored(_sts())
    assert "size (2 -> 3 pods)" in str(queue_locked_change(_sts(unit={"replicas": 3}), current))
    more = {"resources": {"requests": {"cpu": "2", "memory": "2Gi"}}}
    assert "resource requests" in str(queue_locked_change(_sts(unit=more), current))
    placed = {"nodeSelector": {"pool": "h100"}}
    assert "nodeSelector" in str(queue_locked_change(_sts(unit=placed), current))
    tolerated = _as_stored(_sts(unit={"tolerations": [{"key": "gpu", "operator": "Exists"}]}))
    assert "tolerations" in str(queue_locked_change(_sts(), tolerated))  # one removed
    assert "queue" in str(queue_locked_change(_sts(queueName="other"), current))


def test_scaling_to_or_from_zero_and_a_job_without_a_queue_change_in_place() -> None:
    current = _as_stored(_sts())
    assert queue_locked_change(_sts(unit={"replicas": 0}), current) is None
    assert queue_locked_change(_sts(unit={"replicas": 3}), _as_stored(_sts(unit={"replicas": 0}))) is None
    plain = _as_stored(_sts(queueName=None))
    assert queue_locked_change(_sts(queueName=None, unit={"replicas": 3}), plain) is None


def test_the_jobs_own_queue_label_names_the_queue_when_the_spec_does_not() -> None:
    spec = parse_spec({**BASE, "queueName": None})
    assert with_job_queue(spec, {"labels": {QUEUE_LABEL: "from-label"}}).queue_name == "from-label"
    assert (
        with_job_queue(parse_spec(BASE), {"labels": {QUEUE_LABEL: "from-label"}}).queue_name == "team-queue"
    )
    assert with_job_queue(spec, {}).queue_name is None


def test_a_units_topology_is_kueues_annotation_and_needs_a_queue() -> None:
    region = {"topology": {"required": "topology.kubernetes.io/region"}}
    template = _sts(unit=region)["spec"]["template"]
    assert template["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == (
        "topology.kubernetes.io/region"
    )
    preferred = _sts(unit={"topology": {"preferred": "kubernetes.io/hostname"}})["spec"]["template"]
    assert (
        preferred["metadata"]["annotations"]["kueue.x-k8s.io/podset-preferred-topology"]
        == "kubernetes.io/hostname"
    )
    assert "its topology" in str(queue_locked_change(_sts(unit=region), _as_stored(_sts())))
    body = copy.deepcopy(BASE)
    body["learnerUnits"][0].update(region)
    assert queue_problem(parse_spec(body)) is None
    body["queueName"] = None
    assert "set spec.queueName" in str(queue_problem(parse_spec(body)))
    for bad in ({}, {"required": "a", "preferred": "b"}, {"required": "not a label"}):
        body["learnerUnits"][0]["topology"] = bad
        with pytest.raises(SpecError):
            parse_spec(body)
