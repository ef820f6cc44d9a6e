"""A worker image that cannot be pulled, as pods on the real node: the job says which image and why."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_testbed.storage import BUCKET, ENDPOINT
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import job_status

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

JOB = "badimage"
MISSING = "127.0.0.1:9/diloco/worker:no-such-tag"  # a registry address where nothing listens


def _manifest(e2e: E2ECluster) -> dict[str, Any]:
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": JOB},
        "spec": {
            "images": {"worker": MISSING, "synchronizer": e2e.images["sync"], "pullPolicy": "IfNotPresent"},
            "model": {"nLayer": 2, "nHead": 2, "nEmbd": 64, "blockSize": 64},
            "storage": {"endpoint": ENDPOINT, "bucket": BUCKET, "prefix": f"jobs/{JOB}",
                        "credentialsSecretRef": {"name": "diloco-s3"}},
            "diloco": {"innerSteps": 8, "fragments": 2, "quorum": 1},
            "learnerUnits": [{"name": "solo", "replicas": 1, "batchSize": 8,
                              "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}],
            "synchronizer": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
        },
    }  # fmt: skip


@pytest.mark.timeout(600)
def test_a_worker_image_that_cannot_be_pulled_is_named_in_the_status_and_one_event(
    e2e: E2ECluster, api: k8s.ApiClient, storage_secret: str, jobs_namespace: str, operator: str
) -> None:
    ns, core, custom = jobs_namespace, k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    custom.create_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", _manifest(e2e))

    def solo() -> dict[str, Any] | None:
        units = job_status(api, ns, JOB).get("units") or []
        return next((u for u in units if u.get("reason") == "ImagePullFailed"), None)

    try:
        unit = wait_for(solo, timeout=300, interval=3, what="the unit says ImagePullFailed")
        assert MISSING in unit["message"], unit
        assert "(learner)" in unit["message"], unit
        conditions = {c["type"]: c for c in job_status(api, ns, JOB)["conditions"]}
        assert conditions["LearnersAlive"]["reason"] == "ImagePullFailed", conditions
        assert conditions["SynchronizerReady"]["status"] == "True", conditions  # its own image is there

        def warned() -> list[str]:
            items = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={JOB}").items
            return [e.message for e in items if e.reason == "ImagePullFailed"]

        notes = wait_for(warned, timeout=60, interval=3, what="the ImagePullFailed event")
        assert len(notes) == 1, notes
        assert MISSING in notes[0], notes
    finally:
        custom.delete_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", JOB)
        wait_for(lambda: not core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={JOB}").items,
                 timeout=180, what="the job's pods gone")  # fmt: skip
