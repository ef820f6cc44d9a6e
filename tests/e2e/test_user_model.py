"""A user's model on the user's data, as pods: a `DiLoCoJob` trains a Hugging Face GPT-2 built from a
config (`examples/hf_gpt2.py`, in a worker image built as docs/user-models.md says) on a tokenized
dataset in the test's S3 server, writes TensorBoard events to the job's storage, survives a kill -9 of
a learner process with nothing trained twice and nothing skipped, and, when it Succeeded, the
operator's export Job writes the model and its held-out loss. `diloco export` run here on the same
job file gives a folder `transformers` loads, with the held-out loss the status reports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import yaml
from botocore.config import Config
from diloco_testbed.pods import pod_logs
from diloco_testbed.storage import BUCKET, ENDPOINT, S3Credentials
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import (
    Synchronizer,
    job_status,
    run_tool,
    seaweedfs_url,
)
from tests.support.hf_gpt2 import MODEL, example_env, held_out_loss, write_tokens
from tests.support.tensorboard_files import read_scalars

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

JOB = "gpt2"
STEPS = 240  # about 25 s of training per unit on a CPU: the kill lands well before the end
CHECKPOINT_EVERY = 5
KILL_AFTER = 20  # steps of unit a before its learner process is killed
SMALL = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "3Gi"}}
AUDIT = "/audit"


@pytest.fixture
def audit_dir() -> Iterator[Path]:
    """A folder of this machine that the learner pods (user 10001) append their sample log to."""
    path = Path(tempfile.mkdtemp(prefix="diloco-e2e-audit-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def job_manifest(e2e: E2ECluster, audit: Path) -> dict[str, Any]:
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": JOB},
        "spec": {
            "images": {"worker": e2e.images["worker-hf"], "synchronizer": e2e.images["sync"],
                       "pullPolicy": "IfNotPresent"},
            "model": MODEL,
            "data": {"corpus": f"s3://{BUCKET}/datasets/tokens", "format": "tokens", "sampleLog": f"{AUDIT}/samples.jsonl"},
            "train": {"lr": 0.003, "warmupSteps": 4, "checkpointEvery": CHECKPOINT_EVERY},
            "storage": {"endpoint": ENDPOINT, "bucket": BUCKET,
                        "prefix": f"jobs/{JOB}", "credentialsSecretRef": {"name": "diloco-s3"}},
            "diloco": {"innerSteps": 8, "fragments": 2, "quorum": 1},
            "learners": {
                "env": [{"name": "HF_HOME", "value": "/tmp/hf"}],  # the root filesystem is read-only
                "volumes": [{"name": "audit", "hostPath": {"path": str(audit), "type": "Directory"}}],
                "volumeMounts": [{"name": "audit", "mountPath": AUDIT}],
            },
            "learnerUnits": [{"name": "a", "batchSize": 4, "resources": SMALL},
                             {"name": "b", "batchSize": 4, "resources": SMALL}],
            "synchronizer": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
            "export": {"resources": SMALL},
            "budget": {"steps": STEPS},
        },
    }  # fmt: skip


def _s3(api: k8s.ApiClient, creds: S3Credentials) -> Any:
    return boto3.client("s3", endpoint_url=seaweedfs_url(api), aws_access_key_id=creds.access_key,
                        aws_secret_access_key=creds.secret_key, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))  # fmt: skip


def _learner_process(pod: str) -> int | None:
    """The host's process id of the learner of ``pod`` (the node runs its containers here)."""
    marker = f"DILOCO_LEARNER_ID={pod}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"worker" in cmdline and marker in environ.split(b"\0"):
            return int(entry.name)
    return None


def _steps(sync: Synchronizer) -> dict[str, int]:
    return {lr["learner_id"]: lr["step"] for lr in sync.status()["learners"]}


@pytest.mark.timeout(2400)
def test_a_hugging_face_gpt2_job_on_s3_tokens_tracks_survives_kill_9_and_is_exported(
    e2e: E2ECluster, api: k8s.ApiClient, s3_credentials: S3Credentials, storage_secret: str,
    jobs_namespace: str, operator: str, tmp_path: Path, audit_dir: Path,
) -> None:  # fmt: skip
    if "worker-hf" not in e2e.images:
        pytest.skip("needs the worker-hf image of scripts/build-test-images.sh (examples/Dockerfile.hf-gpt2)")
    ns, core = jobs_namespace, k8s.CoreV1Api(api)
    s3 = _s3(api, s3_credentials)
    data = tmp_path / "train.bin"
    write_tokens(data)
    s3.put_object(Bucket=BUCKET, Key="datasets/tokens/train.bin", Body=data.read_bytes())
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job_manifest(e2e, audit_dir)))
    run_tool("kubectl", "apply", "-n", ns, "-f", str(manifest), env=e2e.kube.env())
    sync = Synchronizer(api, ns, JOB)

    def describe() -> str:
        return f"status {job_status(api, ns, JOB)}; a: {pod_logs(core, ns, f'{JOB}-a-0')[-2000:]}"

    # kill -9 of unit a's learner process once it is past a checkpoint: the container restarts in
    # its pod and the learner resumes from its newest checkpoint, at the sample after it
    wait_for(lambda: _steps(sync).get(f"{JOB}-a-0", 0) >= KILL_AFTER, timeout=900, interval=3,
             what=f"unit a past step {KILL_AFTER}", describe=describe)  # fmt: skip
    pid = _learner_process(f"{JOB}-a-0")
    assert pid is not None, "the learner process of unit a is not on this machine"
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: "resumed from checkpoint" in pod_logs(core, ns, f"{JOB}-a-0"), timeout=600, interval=3,
             what="unit a resumed from its checkpoint", describe=describe)  # fmt: skip
    resumed = [ln for ln in pod_logs(core, ns, f"{JOB}-a-0").splitlines() if "resumed from checkpoint" in ln][
        -1
    ]
    c = int(resumed.split("step=")[1].split()[0])
    assert c >= KILL_AFTER - CHECKPOINT_EVERY
    assert c % CHECKPOINT_EVERY == 0

    # Succeeded, then exported by the operator's Job
    wait_for(lambda: job_status(api, ns, JOB).get("phase") == "Succeeded", timeout=1200, interval=5,
             what="the job Succeeded", describe=describe)  # fmt: skip
    wait_for(lambda: (job_status(api, ns, JOB).get("export") or {}).get("state") in ("Succeeded", "Failed"),
             timeout=600, interval=3, what="the export done", describe=lambda: str(job_status(api, ns, JOB)))  # fmt: skip
    status = job_status(api, ns, JOB)
    exported = status["export"]
    assert exported["state"] == "Succeeded", exported
    assert exported["location"] == f"s3://{BUCKET}/jobs/{JOB}/export"
    assert exported["versions"], exported
    assert all(v > 0 for v in exported["versions"].values())
    events = [e.reason for e in core.list_namespaced_event(ns).items if e.involved_object.name == JOB]
    assert "Exported" in events
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"jobs/{JOB}/export/")["Contents"]}
    assert {f"jobs/{JOB}/export/{k}" for k in ("model.safetensors", "export.json", "hf/config.json")} <= keys

    # TensorBoard: each learner's run in the job's storage, its loss up to the last step
    tb = tmp_path / "tensorboard"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"jobs/{JOB}/tensorboard/")
    for obj in (o for page in pages for o in page.get("Contents", [])):
        local = tb / obj["Key"].removeprefix(f"jobs/{JOB}/tensorboard/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read())
    runs = sorted(p.parent for p in tb.rglob("events.out.tfevents.*"))
    learner_runs = {p.name: read_scalars(p) for p in set(runs) if JOB in p.name}
    assert {f"{JOB}-a-0", f"{JOB}-b-0"} <= set(learner_runs), sorted(p.name for p in runs)
    for name in (f"{JOB}-a-0", f"{JOB}-b-0"):
        loss = learner_runs[name]["loss"]
        assert max(step for step, _ in loss) == STEPS, (name, loss[-3:])
        assert loss[-1][1] < np.log(512) - 2.0, (name, loss[-1])
    # unit b's whole curve; unit a's killed process lost what it had not flushed yet (every 10 s)
    b_loss = learner_runs[f"{JOB}-b-0"]["loss"]
    assert b_loss[0][0] <= 10, b_loss[:3]
    assert b_loss[-1][1] < b_loss[0][1] - 2.0, (b_loss[0], b_loss[-1])

    # the same job file, exported here: the folder transformers loads, with the status's held-out loss
    out = tmp_path / "export"
    env = example_env(("DILOCO_", "AWS_"), AWS_ENDPOINT_URL=seaweedfs_url(api), AWS_REGION="us-east-1",
                      AWS_ACCESS_KEY_ID=s3_credentials.access_key, AWS_SECRET_ACCESS_KEY=s3_credentials.secret_key)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "diloco", "export", "-f", str(manifest), "--out", str(out), "--evaluate"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads((out / "export.json").read_text())
    assert info["versions"] == exported["versions"]
    assert info["held_out_loss"] == pytest.approx(exported["heldOutLoss"], rel=1e-4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    loss = held_out_loss(model, tmp_path, tmp_path / "cache")
    assert loss == pytest.approx(exported["heldOutLoss"], rel=1e-4)
    assert exported["heldOutLoss"] < np.log(512) - 2.0  # it learnt the sequence

    # the sample log: per learner, nothing trained twice and nothing skipped across the kill
    _check_sample_log(audit_dir / "samples.jsonl", c)
    # the synchronizer dealt the data: each unit leader's ranges, in its storage, none twice
    deal = json.loads(s3.get_object(Bucket=BUCKET, Key=f"jobs/{JOB}/shard-000/deal.json")["Body"].read())
    assert set(deal["units"]) == {f"{JOB}-a-0", f"{JOB}-b-0"}, sorted(deal["units"])
    starts = sorted(r["start"] for ranges in deal["units"].values() for r in ranges)
    assert starts[0] == 0
    assert len(starts) == len(set(starts))
    run_tool("kubectl", "delete", "-n", ns, "-f", str(manifest), "--wait=true", env=e2e.kube.env())


def _check_sample_log(path: Path, c: int) -> None:
    """Unit a (killed) and unit b: the history each learner's model went through (a killed process's
    steps up to its checkpoint, then the resumed process's steps) is the batches 0, 1, 2, ... of its
    deal with no gap and no repeat; the killed process's batches past the checkpoint are redone by the
    resumed one on the same samples; no window is trained twice (the run is shorter than an epoch);
    and the two units, each its own data shard, share no window."""
    records = [json.loads(ln) for ln in path.read_text().splitlines()]
    by_shard: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_shard.setdefault(r["shard"], []).append(r)
    assert len(by_shard) == 2, sorted(by_shard)
    restarted = 0
    trained: dict[int, set[int]] = {}
    for shard, rs in sorted(by_shard.items()):
        # a process's batches run 0, 1, 2, ...; a restart starts again at its checkpoint's batch
        runs: list[list[dict[str, Any]]] = [[rs[0]]]
        for r in rs[1:]:
            if r["batch"] == runs[-1][-1]["batch"] + 1 and r["pid"] == runs[-1][-1]["pid"]:
                runs[-1].append(r)
            else:
                runs.append([r])
        assert runs[0][0]["batch"] == 0, shard
        history = runs[0]
        for run in runs[1:]:
            restarted += 1
            start = run[0]["batch"]
            assert start % CHECKPOINT_EVERY == 0, (shard, start)
            redone = {r["batch"]: r["samples"] for r in history if r["batch"] >= start}
            assert all(r["samples"] == redone[r["batch"]] for r in run if r["batch"] in redone), shard
            history = [r for r in history if r["batch"] < start] + run
        assert [r["batch"] for r in history] == list(range(len(history))), shard
        assert history[-1]["step"] >= STEPS
        windows = [w for r in history for w in r["samples"]]
        assert len(set(windows)) == len(windows), shard  # less than an epoch: no window twice
        trained[shard] = set(windows)
    assert not trained[0] & trained[1], "the two units trained on the same windows"
    assert restarted == 1, "one learner process was killed and resumed"
    assert c > 0
