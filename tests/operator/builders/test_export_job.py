"""The export Job a job gets when it Succeeded, and what its pod's termination message puts in the
status (the Job running for real, on a real node, is in tests/e2e/test_user_model.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from diloco_operator.builders.children import build_children
from diloco_operator.builders.export import BACKOFF_LIMIT, build_export_job, eval_batch_size
from diloco_operator.builders.names import JobRef
from diloco_operator.schema.spec import parse_spec
from diloco_operator.schema.status import JobStatus
from diloco_operator.status.export import (
    MAX_MESSAGE,
    export_events,
    export_state,
    export_status,
    job_export,
    summary_status,
)
from diloco_operator.status.pods import PodObserved, observe_pod

JOB = JobRef("j", "ns", "uid-1")
SUMMARY = {"job_id": "j", "versions": {"0": 7, "1": 6}, "rounds": 13, "held_out_loss": 4.25,
           "location": "s3://bkt/j/export", "parameters": 1000}  # fmt: skip


def raw(**extra: Any) -> dict[str, Any]:
    return {
        "images": {"worker": "w:1", "synchronizer": "s:1"},
        "storage": {"bucket": "bkt", "prefix": "j"},
        "learnerUnits": [{"name": "a", "batchSize": 4, "replicas": 2}, {"name": "b", "batchSize": 8}],
        **extra,
    }


def pod(name: str, phase: str, message: str = "", component: str = "export") -> PodObserved:
    return PodObserved(name, f"uid-{name}", component, "", "", phase, False, False, "", "", message)


def test_the_export_job_runs_diloco_export_of_the_global_model_into_storage_with_its_held_out_loss() -> None:
    storage = {"bucket": "bkt", "prefix": "j", "endpoint": "http://s3.local:8333",
               "credentialsSecretRef": {"name": "s3"}}  # fmt: skip
    spec = parse_spec(raw(storage=storage, learners={
        "env": [{"name": "HF_HOME", "value": "/tmp/hf"}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }, export={"resources": {"limits": {"memory": "8Gi"}}}))  # fmt: skip
    job = build_export_job(JOB, spec)
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert job["spec"]["backoffLimit"] == BACKOFF_LIMIT
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    (c,) = pod_spec["containers"]
    assert c["image"] == "w:1"
    cmd = c["command"]
    args = {
        flag: cmd[i + 1] for i, flag in enumerate(cmd[:-1]) if flag.startswith("--") and flag != "--evaluate"
    }
    assert c["command"][:2] == ["diloco", "export"]
    assert "--evaluate" in c["command"]
    assert args["--storage"] == spec.storage.url
    assert args["--out"] == f"{spec.storage.url}/export"
    assert args["--job-config"] == "/etc/diloco/job.json"
    assert args["--job-id"] == "j"
    # the held-out batches diloco run and diloco export -f evaluate on: unit a's 2 pods x 4
    assert args["--batch-size"] == "8" == str(eval_batch_size(spec))
    assert args["--summary-file"] == c["terminationMessagePath"] == "/dev/termination-log"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = {e["name"]: e for e in c["env"]}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"} <= set(
        env
    )  # the learners' storage
    assert env["HF_HOME"]["value"] == "/tmp/hf"
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/etc/diloco", "/tmp", "/data"}
    assert {v["name"] for v in pod_spec["volumes"]} >= {"config", "tmp", "data"}
    assert c["resources"] == {"limits": {"memory": "8Gi"}, "requests": {"cpu": "1"}}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_its_name_fits_kubernetes_for_the_longest_job_name_and_changes_with_its_content() -> None:
    longest = JobRef("x" * 48, "ns", "uid-1")  # with a one-letter unit: 50, the longest a job allows
    name = build_export_job(longest, parse_spec(raw()))["metadata"]["name"]
    assert len(name) <= 63
    assert name.startswith(f"{'x' * 48}-export-")
    one = build_export_job(JOB, parse_spec(raw()))["metadata"]["name"]
    other = build_export_job(JOB, parse_spec(raw(images={"worker": "w:2", "synchronizer": "s:1"})))
    assert one != other["metadata"]["name"]


def test_a_job_has_its_export_job_only_once_it_succeeded_and_unless_it_is_turned_off() -> None:
    def jobs(spec: dict[str, Any], stopped: bool) -> list[str]:
        children = build_children(JOB, parse_spec(spec), learners_stopped=stopped)
        return [c["metadata"]["name"] for c in children if c["kind"] == "Job"]

    assert jobs(raw(), stopped=False) == []
    assert len(jobs(raw(), stopped=True)) == 1
    assert jobs(raw(export={"enabled": False}), stopped=True) == []
    assert jobs(raw(suspend=True), stopped=True) == []


def test_the_status_shows_what_the_export_pod_said_as_it_ended() -> None:
    spec = parse_spec(raw())
    where = f"{spec.storage.url}/export"
    assert export_status(spec, [pod("j-a-0", "Running", component="learner")]) is None
    assert export_status(spec, [pod("e-1", "Pending")]) == export_state("Running", where)
    done = export_status(spec, [pod("e-1", "Failed", "boom"), pod("e-2", "Succeeded", json.dumps(SUMMARY))])
    assert done == export_state("Succeeded", "s3://bkt/j/export", versions={"0": 7, "1": 6}, rounds=13,
                                held_out_loss=4.25)  # fmt: skip
    # retries left: still running; all spent: Failed, with the end of the log
    failed = [pod(f"e-{i}", "Failed", "x" * 5000 + f" error {i}") for i in range(BACKOFF_LIMIT)]
    assert export_status(spec, failed) == export_state("Running", where)
    failed.append(pod("e-9", "Failed", "x" * 5000 + " ValueError: no held-out batches"))
    gave_up = export_status(spec, failed)
    assert gave_up is not None
    assert gave_up.state == "Failed"
    assert gave_up.message is not None
    assert gave_up.message.endswith("no held-out batches")
    assert len(gave_up.message) == MAX_MESSAGE
    unreadable = export_status(spec, [pod("e-1", "Succeeded", "not json")])
    assert unreadable is not None
    assert unreadable.state == "Succeeded"
    assert "cannot be read" in str(unreadable.message)


@pytest.mark.parametrize("versions", [["0", 7], "v7", 7])
def test_a_summary_whose_versions_are_no_object_says_it_cannot_be_read(versions: Any) -> None:
    status = summary_status(json.dumps({**SUMMARY, "versions": versions}), "s3://bkt/j/export")
    assert (status.state, status.location, status.versions) == ("Succeeded", "s3://bkt/j/export", None)
    assert "the export's summary cannot be read: versions is a" in str(status.message)


def test_the_export_is_in_the_status_only_while_the_job_is_succeeded() -> None:
    spec = parse_spec(raw())
    pods = [pod("e-1", "Succeeded", json.dumps(SUMMARY))]
    assert job_export(spec, JobStatus(phase="Running"), pods) is None
    assert job_export(spec, JobStatus(phase="Succeeded"), []) == export_state(
        "Pending", f"{spec.storage.url}/export"
    )
    got = job_export(spec, JobStatus(phase="Succeeded"), pods)
    assert got is not None
    assert got.held_out_loss == 4.25
    assert job_export(parse_spec(raw(export={"enabled": False})), JobStatus(phase="Succeeded"), pods) is None


def test_a_new_export_removes_what_the_last_one_said_from_the_stored_status() -> None:
    stored = JobStatus(phase="Succeeded", export=export_state("Succeeded", "s3://b/e", versions={"0": 3},
                                                              rounds=3, held_out_loss=4.0))  # fmt: skip
    running = JobStatus(phase="Succeeded", export=export_state("Running", "s3://b/e"))
    after = stored.merged(running.to_patch())
    assert after.export == export_state("Running", "s3://b/e")
    gone = stored.merged(JobStatus(phase="Running", export=None).to_patch())
    assert gone.export is None


def test_an_event_says_where_the_model_went_and_its_loss_or_why_the_export_failed() -> None:
    ok = export_state("Succeeded", "s3://b/e", versions={"0": 7, "1": 6}, rounds=13, held_out_loss=4.25)
    (ev,) = export_events(export_state("Running", "s3://b/e"), ok)
    assert (ev.type, ev.reason) == ("Normal", "Exported")
    assert ev.message == "the global model (0: v7, 1: v6) is in s3://b/e, held-out loss 4.2500"
    assert export_events(ok, ok) == []
    (bad,) = export_events(None, export_state("Failed", "s3://b/e", message="no data"))
    assert (bad.type, bad.reason, bad.message) == (
        "Warning",
        "ExportFailed",
        "the export to s3://b/e failed: no data",
    )


def test_the_pod_watch_keeps_the_termination_message_of_a_pod_that_ended() -> None:
    obj = {
        "metadata": {"name": "e-1", "uid": "u", "labels": {"app.kubernetes.io/component": "export",
                                                            "diloco.dev/job": "j"}},
        "status": {"phase": "Succeeded", "containerStatuses": [
            {"name": "export", "state": {"terminated": {"exitCode": 0, "message": '{"rounds": 1}\n'}}}]},
    }  # fmt: skip
    seen = observe_pod(obj)
    assert (seen.component, seen.phase, seen.message) == ("export", "Succeeded", '{"rounds": 1}\n')
    assert observe_pod({"metadata": {"name": "p"}, "status": {"phase": "Running"}}).message == ""
