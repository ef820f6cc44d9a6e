"""The job's pod settings in every pod template it builds: learner units, synchronizer shards and
the export Job; nothing added without them; the operator's labels and annotations kept."""

from __future__ import annotations

from typing import Any

from diloco_operator.builders.export import build_export_job
from diloco_operator.builders.learners import build_statefulset
from diloco_operator.builders.names import JOB_LABEL, TEMPLATE_HASH_ANNOTATION, JobRef
from diloco_operator.builders.synchronizer import build_sync_deployment
from diloco_operator.schema.spec import parse_spec

JOB = JobRef("llm", "team", "uid-1")
BASE: dict[str, Any] = {
    "images": {"worker": "w", "synchronizer": "s"},
    "storage": {"bucket": "bkt"},
    "learnerUnits": [{"name": "a"}],
}
SETTINGS = {
    "priorityClassName": "training",
    "schedulerName": "volcano",
    "serviceAccountName": "trainer",
    "labels": {"team": "llm"},
    "annotations": {"cost.example.com/center": "42"},
    "imagePullSecrets": [{"name": "registry"}],
}


def _templates(spec: dict[str, Any]) -> list[dict[str, Any]]:
    parsed = parse_spec(spec)
    unit = build_statefulset(JOB, parsed, parsed.learner_units[0], "digest", stopped=False)
    sync = build_sync_deployment(JOB, parsed, 0, "digest")
    export = build_export_job(JOB, parsed)
    return [obj["spec"]["template"] for obj in (unit, sync, export)]


def test_every_pod_of_the_job_carries_the_settings() -> None:
    for template in _templates({**BASE, "pods": SETTINGS}):
        spec, meta = template["spec"], template["metadata"]
        assert spec["priorityClassName"] == "training"
        assert spec["schedulerName"] == "volcano"
        assert spec["serviceAccountName"] == "trainer"
        assert spec["automountServiceAccountToken"] is False  # the account's API token stays out
        assert spec["imagePullSecrets"] == [{"name": "registry"}]
        assert meta["labels"]["team"] == "llm"
        assert meta["labels"][JOB_LABEL] == "llm"  # the operator's selectors are kept
        assert meta["annotations"]["cost.example.com/center"] == "42"


def test_without_settings_nothing_is_added() -> None:
    for template in _templates(BASE):
        assert not {"priorityClassName", "schedulerName", "serviceAccountName", "imagePullSecrets"} & set(
            template["spec"]
        )


def test_a_units_own_settings_change_its_template_hash_so_its_pods_restart() -> None:
    before = parse_spec(BASE)
    after = parse_spec({**BASE, "learnerUnits": [{"name": "a", "pods": {"priorityClassName": "urgent"}}]})
    old = build_statefulset(JOB, before, before.learner_units[0], "d", stopped=False)["spec"]["template"]
    new = build_statefulset(JOB, after, after.learner_units[0], "d", stopped=False)["spec"]["template"]
    assert new["spec"]["priorityClassName"] == "urgent"
    key = TEMPLATE_HASH_ANNOTATION
    assert old["metadata"]["annotations"][key] != new["metadata"]["annotations"][key]
