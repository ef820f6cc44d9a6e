"""A worker image that cannot be pulled, as pods on the real node: the job says which image and why."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_testbed.storage import BUCKET, ENDPOINT
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import Synchronizer, job_status

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
        wait_for(  # its own image is there
            lambda: {c["type"]: c for c in job_status(api, ns, JOB)["conditions"]}["SynchronizerReady"][
                "status"
            ]
            == "True",
            timeout=120,
            interval=3,
            what="the synchronizer ready",
        )

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


ROLLOUT = "rollout"


def _two_units(e2e: E2ECluster) -> dict[str, Any]:
    manifest = _manifest(e2e)
    manifest["metadata"]["name"] = ROLLOUT
    spec = manifest["spec"]
    spec["images"]["worker"] = e2e.images["worker"]
    spec["storage"]["prefix"] = f"jobs/{ROLLOUT}"
    spec["learnerUnits"] = [dict(spec["learnerUnits"][0], name=name) for name in ("a", "b")]
    # longer than the test's waits: the corrected image must go on at once, not when the failing
    # unit's restart runs out of time
    spec["unitLostAfterSeconds"] = 3600
    return manifest


@pytest.mark.timeout(900)
def test_a_wrong_worker_image_halts_at_the_first_unit_and_the_other_keeps_training(
    e2e: E2ECluster, api: k8s.ApiClient, storage_secret: str, jobs_namespace: str, operator: str
) -> None:
    """Two units, quorum 1: a new worker image reaches one unit at a time; when that unit cannot pull
    it, the other keeps its pod and trains on, and the job says why; the right image goes on."""
    ns, core, custom = jobs_namespace, k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    custom.create_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", _two_units(e2e))
    sync = Synchronizer(api, ns, ROLLOUT)

    def steps() -> dict[str, int]:
        try:
            return {x["learner_id"]: x["step"] for x in sync.status()["learners"]}
        except Exception:  # the synchronizer not serving yet
            return {}

    def pods() -> dict[str, Any]:
        items = core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={ROLLOUT},diloco.dev/unit").items
        return {p.metadata.name: p for p in items}

    def up_to_date() -> dict[str, Any]:
        return {c["type"]: c for c in job_status(api, ns, ROLLOUT).get("conditions") or []}["UnitsUpToDate"]

    def images(image: str) -> None:
        custom.patch_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", ROLLOUT,
                                              {"spec": {"images": {"worker": image}}})  # fmt: skip

    try:
        wait_for(lambda: min(steps().values(), default=0) >= 4 and len(steps()) == 2, timeout=400, interval=3,
                 what="both units train")  # fmt: skip
        before = {name: p.metadata.uid for name, p in pods().items()}
        images(MISSING)
        halted = wait_for(lambda: (c := up_to_date())["reason"] == "RolloutHalted" and c, timeout=300,
                          interval=3, what="the rollout halts")  # fmt: skip
        now = pods()
        replaced = sorted(name for name, p in now.items() if before.get(name) != p.metadata.uid)
        kept = sorted(name for name, p in now.items() if before.get(name) == p.metadata.uid)
        said = [(e.reason, e.message) for e in core.list_namespaced_event(ns).items if ROLLOUT in (e.message or "")
                or e.involved_object.name.startswith(ROLLOUT)]  # fmt: skip
        assert (len(replaced), len(kept)) == (1, 1), "\n".join(f"{r}: {m}" for r, m in said)
        assert f"unit {replaced[0].split('-')[1]}" in halted["message"], halted
        assert MISSING in halted["message"], halted
        kept_learner = kept[0]
        at = steps()[kept_learner]
        wait_for(lambda: steps().get(kept_learner, 0) >= at + 8, timeout=300, interval=3,
                 what="the unit that kept its pod trains on")  # fmt: skip
        assert pods()[kept_learner].metadata.uid == before[kept_learner]  # still not restarted
        reasons = [
            e.reason
            for e in core.list_namespaced_event(ns, field_selector=f"involvedObject.name={ROLLOUT}").items
        ]
        assert reasons.count("UnitRestart") == 1, reasons
        assert "RolloutHalted" in reasons, reasons

        images(e2e.images["worker"])  # the fix: the rollout goes on, the failing unit first
        wait_for(lambda: up_to_date()["reason"] == "UpToDate", timeout=400, interval=3, what="up to date")
        wait_for(lambda: len(steps()) == 2 and all(
            p.status.phase == "Running" for p in pods().values()), timeout=300, interval=3,
            what="both units running")  # fmt: skip
    finally:
        custom.delete_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", ROLLOUT)
        wait_for(lambda: not core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={ROLLOUT}").items,
                 timeout=180, what="the job's pods gone")  # fmt: skip
