"""A job's pod settings (spec.pods, a unit's own) on a real apiserver, controller-manager, scheduler
and kwok: admitted as written, the operator's keys refused at admission, a missing ServiceAccount or
PriorityClass named in the job's status, and the pods created with them once they exist (the
apiserver's own Priority admission resolves the class)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from diloco_testbed.waiting import wait_for
from kopf.testing import KopfRunner
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.operator.kubejobs import (
    GROUP,
    PLURAL,
    VERSION,
    create_job,
    get_job,
    job_manifest,
    learner_pods,
    phase_is,
    running_on_kwok,
    unit,
)

pytestmark = [pytest.mark.integration, pytest.mark.kwok]


def _spec_valid(api: k8s.ApiClient, ns: str, name: str) -> dict[str, Any]:
    status = get_job(api, ns, name).get("status") or {}
    return dict({c["type"]: c for c in status.get("conditions", [])}.get("SpecValid", {}))


def test_the_operators_own_label_keys_are_refused_at_admission(api: k8s.ApiClient, namespace: str) -> None:
    ok = job_manifest("fine", [unit("a", pods={"labels": {"team": "llm"}})], pods={"annotations": {"a": "b"}})
    created = k8s.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, ok, dry_run="All"
    )
    assert created["spec"]["learnerUnits"][0]["pods"]["labels"] == {"team": "llm"}
    bad = job_manifest("owned", [unit("a")], pods={"labels": {"diloco.dev/unit": "b"}})
    with pytest.raises(ApiException) as refused:
        create_job(api, namespace, bad)
    assert refused.value.status == 422
    assert "the operator's own; choose another key" in refused.value.body


def test_pods_get_the_settings_once_what_they_name_exists(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    priority = f"diloco-test-{uuid.uuid4().hex[:8]}"
    pods = {
        "serviceAccountName": "trainer",
        "priorityClassName": priority,
        "labels": {"team": "llm"},
        "annotations": {"cost.example.com/center": "42"},
        "imagePullSecrets": [{"name": "registry"}],
    }
    own = {"labels": {"tier": "spot"}}
    create_job(api, namespace, job_manifest("placed", [unit("a", 2, pods=own)], pods=pods))

    def names(word: str) -> bool:
        valid = _spec_valid(api, namespace, "placed")
        return valid.get("reason") == "InvalidSpec" and word in valid.get("message", "")

    wait_for(lambda: names("ServiceAccount 'trainer'"), timeout=30, what="the missing ServiceAccount named")
    assert learner_pods(api, namespace, "placed") == []
    k8s.CoreV1Api(api).create_namespaced_service_account(namespace, {"metadata": {"name": "trainer"}})
    wait_for(lambda: names(f"PriorityClass '{priority}'"), timeout=60, what="the missing PriorityClass named")
    scheduling = k8s.SchedulingV1Api(api)
    scheduling.create_priority_class({"metadata": {"name": priority}, "value": 1000})
    try:
        wait_for(
            lambda: running_on_kwok(learner_pods(api, namespace, "placed"), 2),
            timeout=90,
            what="2 learner pods Running",
        )
        for pod in learner_pods(api, namespace, "placed"):
            assert pod.spec.service_account_name == "trainer"
            assert pod.spec.priority_class_name == priority
            assert pod.spec.priority == 1000  # resolved by the apiserver's Priority admission
            assert [s.name for s in pod.spec.image_pull_secrets] == ["registry"]
            assert pod.metadata.labels["team"] == "llm"
            assert pod.metadata.labels["tier"] == "spot"
            assert pod.metadata.annotations["cost.example.com/center"] == "42"
        sync = (
            k8s.CoreV1Api(api)
            .list_namespaced_pod(
                namespace, label_selector="diloco.dev/job=placed,app.kubernetes.io/component=synchronizer"
            )
            .items
        )
        assert sync
        assert all(p.spec.priority == 1000 and "tier" not in p.metadata.labels for p in sync)
        wait_for(lambda: phase_is(api, namespace, "placed", "Running"), timeout=60, what="phase Running")
    finally:
        scheduling.delete_priority_class(priority)
