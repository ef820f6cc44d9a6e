"""The environment the operator gives its pods is what the worker and the synchronizer read.

The operator and the two services never import each other; their contract is the pod
environment (``diloco_operator.builders.env``). Here the built children's environment is resolved the way
the kubelet does it (values, the pod's own name and namespace, Secret keys, ``$(VAR)`` references
to variables defined earlier, the ConfigMap mounted as files) and parsed by each service's own
settings parser, so a variable one side writes and the other ignores is caught.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.builders.children import build_children
from diloco_operator.builders.names import JobRef
from diloco_operator.schema.spec import parse_spec
from diloco_operator.schema.sync_memory import SERVED_IN_MEMORY_CAP
from diloco_sync.cli import parse_settings as parse_sync_settings
from diloco_sync.settings import SyncSettings
from diloco_worker.settings import FLAGS as WORKER_FLAGS
from diloco_worker.settings import build_parser as build_worker_parser
from diloco_worker.settings import parse_settings as parse_worker_settings

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
NAMESPACE = "research"
# Set for people and tools looking at the pod, not read by the learner.
LEARNER_INFORMATIONAL = {"DILOCO_JOB_ID", "DILOCO_NAMESPACE", "DILOCO_REGION", "DILOCO_STORAGE_CONFIG"}
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _secret_value(name: str, key: str) -> str:
    return f"{name}.{key}.value"


def resolve_env(container: dict[str, Any], pod_name: str, config_files: dict[str, Path]) -> dict[str, str]:
    """The container's environment as the kubelet would give it to the process."""
    out: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            value = _REF.sub(lambda m: out.get(m.group(1), m.group(0)), str(item["value"]))
        else:
            ref = item["valueFrom"]
            if "fieldRef" in ref:
                value = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE}[
                    ref["fieldRef"]["fieldPath"]
                ]
            else:
                secret = ref["secretKeyRef"]
                value = _secret_value(secret["name"], secret["key"])
        out[item["name"]] = str(config_files.get(value, value))
    return out


def children_of(example: str, index: int = 0) -> tuple[str, list[dict[str, Any]]]:
    doc = [d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d][index]
    name = doc["metadata"]["name"]
    return name, build_children(JobRef(name, NAMESPACE, "uid-1"), parse_spec(doc["spec"]))


def mounted_files(obj: dict[str, Any], children: list[dict[str, Any]], tmp_path: Path) -> dict[str, Path]:
    """The pod's ConfigMap and Secret volumes written to files, keyed by the path the pod sees each
    at (a Secret's value is ``_secret_value``; volumes of objects the job does not make, such as a CA
    bundle, are left out)."""
    pod = obj["spec"]["template"]["spec"]
    maps = {c["metadata"]["name"]: c["data"] for c in children if c["kind"] == "ConfigMap"}
    files: dict[str, Path] = {}
    for volume in pod.get("volumes", []):
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
        if "configMap" in volume and volume["configMap"]["name"] in maps:
            data = maps[volume["configMap"]["name"]]
        elif "secret" in volume and "items" in volume["secret"] and volume["name"] != "tls":
            secret = volume["secret"]["secretName"]
            data = {item["key"]: _secret_value(secret, item["key"]) for item in volume["secret"]["items"]}
        else:
            continue
        folder = tmp_path / obj["metadata"]["name"] / volume["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for key, text in data.items():
            (folder / key).write_text(text)
            files[f"{mount['mountPath']}/{key}"] = folder / key
    return files


def container_of(obj: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = obj["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize(("example", "index"), [("single-region.yaml", 0), ("multi-region.yaml", 1)])
def test_learner_environment_parses_into_the_workers_settings(
    example: str, index: int, tmp_path: Path
) -> None:
    _, children = children_of(example, index)
    doc = [d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d][index]
    storage = parse_spec(doc["spec"]).storage.url
    for sts in (c for c in children if c["kind"] == "StatefulSet"):
        pod = f"{sts['metadata']['name']}-0"
        env = resolve_env(container_of(sts), pod, mounted_files(sts, children, tmp_path))

        settings = parse_worker_settings([], env)

        assert settings.learner_id == pod
        assert settings.sync_url == env["DILOCO_SYNC_URL"]
        # the unit's own token Secret, never the job secret: a learner cannot make another's token
        assert "DILOCO_JOB_SECRET" not in env
        assert "DILOCO_TOKEN" not in env
        assert settings.token_file == env["DILOCO_TOKEN_FILE"]
        token = Path(env["DILOCO_TOKEN_FILE"]).read_text()
        assert token == _secret_value(f"{sts['metadata']['name']}-token", "token")
        # Durable, per pod: a replaced pod keeps its name and finds its own checkpoint.
        assert settings.checkpoint_dir == f"{storage}/checkpoints/{pod}"
        # periodic checkpoints there: a learner killed without SIGTERM resumes near where it was
        spec_train = doc["spec"].get("train", {})
        assert settings.train.checkpoint_every == spec_train.get("checkpointEvery", 100) > 0
        assert settings.train.checkpoints_kept == spec_train.get("checkpointsKept", 2)
        assert settings.train.batch_size == int(env["DILOCO_BATCH_SIZE"])
        assert settings.unit == env["DILOCO_UNIT"]


def test_the_checkpoint_interval_and_how_many_are_kept_come_from_spec_train(tmp_path: Path) -> None:
    doc = next(d for d in yaml.safe_load_all((EXAMPLES / "single-region.yaml").read_text()) if d)
    doc["spec"]["train"] = {**doc["spec"].get("train", {}), "checkpointEvery": 25, "checkpointsKept": 4}
    children = build_children(JobRef("ck", NAMESPACE, "uid-1"), parse_spec(doc["spec"]))
    sts = next(c for c in children if c["kind"] == "StatefulSet")
    env = resolve_env(
        container_of(sts), f"{sts['metadata']['name']}-0", mounted_files(sts, children, tmp_path)
    )
    settings = parse_worker_settings([], env)
    assert (settings.train.checkpoint_every, settings.train.checkpoints_kept) == (25, 4)


def test_every_learner_variable_is_read_by_the_worker_or_named_informational() -> None:
    read = {f.env for f in WORKER_FLAGS}
    read |= {"DILOCO_" + a.dest.upper() for a in build_worker_parser()._actions if a.dest != "help"}
    _, children = children_of("single-region.yaml")
    for sts in (c for c in children if c["kind"] == "StatefulSet"):
        names = {e["name"] for e in container_of(sts)["env"] if e["name"].startswith("DILOCO_")}
        assert names - read - LEARNER_INFORMATIONAL == set(), "set by the operator, ignored by the worker"


def sync_settings(
    deployment: dict[str, Any],
    children: list[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[dict[str, str], Any]:
    """A synchronizer Deployment's environment, and the settings the synchronizer parses from it."""
    files = mounted_files(deployment, children, tmp_path)
    env = resolve_env(container_of(deployment), f"{deployment['metadata']['name']}-abc", files)
    for key in [k for k in list(os.environ) if k.startswith(("DILOCO_", "AWS_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env, parse_sync_settings([])


def test_synchronizer_environment_parses_into_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, children = children_of("single-region.yaml")
    deployments = [c for c in children if c["kind"] == "Deployment"]
    assert deployments
    for deployment in deployments:
        env, settings = sync_settings(deployment, children, tmp_path, monkeypatch)

        assert settings.job.job_id == job
        assert settings.owner == f"{NAMESPACE}/{job}"  # the same name in another namespace is another job
        assert container_of(deployment)["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert settings.storage_url == env["DILOCO_STORAGE"]
        assert settings.shard_index == int(env["DILOCO_SHARD_INDEX"])
        assert settings.num_shards == int(env["DILOCO_NUM_SHARDS"])
        assert settings.job.diloco.quorum == 2
        assert (settings.host, settings.port) == ("0.0.0.0", int(env["DILOCO_PORT"]))
        assert settings.job_secret.get_secret_value() == env["DILOCO_JOB_SECRET"]
        assert settings.revocations_file == env["DILOCO_REVOCATIONS_FILE"]
        assert settings.min_step_time_s == 0.0005  # spec.synchronizer.minStepTimeSeconds' default
        assert Path(env["DILOCO_REVOCATIONS_FILE"]).read_text() == "{}"


@pytest.mark.parametrize(
    ("synchronizer", "expected"),
    [
        ({}, (1024**3, 64 * 1024**2, 1024**3, 1024**3)),  # the synchronizer's own defaults
        # a memory limit of 8Gi: of the 7.75Gi above the 256Mi floor, a third, an eighth up to 64Mi, a
        # third, and what they leave for the pending contributions
        (
            {"resources": {"limits": {"memory": "8Gi"}}},
            (7936 * 1024**2 // 3, 64 * 1024**2, 7936 * 1024**2 // 3, 7936 * 1024**2 // 3 - 64 * 1024**2 + 1),
        ),
        (
            {
                "resources": {"limits": {"memory": "8Gi"}},
                "memory": {"rounds": "4Gi", "servedInMemory": "512Mi"},
            },
            (4 * 1024**3, 512 * 1024**2, 7936 * 1024**2 // 3, 3328 * 1024**2 - 7936 * 1024**2 // 3),
        ),
        (
            {"memory": {"rounds": "20Gi", "servedInMemory": 0, "outageBuffer": "512Mi", "pending": "6Gi"}},
            (20 * 1024**3, 0, 512 * 1024**2, 6 * 1024**3),
        ),
    ],
)
def test_the_synchronizers_memory_budgets_reach_its_settings(
    synchronizer: dict[str, Any],
    expected: tuple[int, int, int, int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    doc = next(d for d in yaml.safe_load_all((EXAMPLES / "single-region.yaml").read_text()) if d)
    doc["spec"]["synchronizer"] = synchronizer
    children = build_children(JobRef("memory", NAMESPACE, "uid-1"), parse_spec(doc["spec"]))
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    _, settings = sync_settings(deployment, children, tmp_path, monkeypatch)
    assert (
        settings.round_memory_bytes,
        settings.served_in_memory_bytes,
        settings.memory_budget_bytes,
        settings.pending_memory_bytes,
    ) == expected
    # the most a limit's share gives a served version is the synchronizer's own default (one value)
    assert SyncSettings.model_fields["served_in_memory_bytes"].default == SERVED_IN_MEMORY_CAP
