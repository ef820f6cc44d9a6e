"""What a job adds to its learner pods (spec.learners and each unit's env, volumes, volumeMounts):
the order in the pod template, the names refused (by the operator and by the CRD's CEL rules), and
the knobs of spec.train that reach the learner (precision, schedule, compile)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_core.config import JobConfig
from diloco_operator.builders.children import build_children
from diloco_operator.builders.names import JobRef
from diloco_operator.schema.pod_additions import (
    OWN_VOLUMES,
    RESERVED_ENV,
    RESERVED_ENV_PREFIX,
    reserved_env,
)
from diloco_operator.schema.spec import SpecError, parse_spec, validate_job

from tests.operator.builders.test_env import container_of, mounted_files, resolve_env
from tests.operator.schema.test_crd import schema

JOB = JobRef("j", "ns", "uid-1")
NAMESPACE = "research"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def raw(units: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "images": {"worker": "w", "synchronizer": "s"},
        "storage": {"bucket": "bkt"},
        "learnerUnits": units or [{"name": "a"}, {"name": "b"}],
        **extra,
    }


def statefulsets(spec: dict[str, Any], job: JobRef = JOB) -> dict[str, dict[str, Any]]:
    children = build_children(job, parse_spec(spec))
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "StatefulSet"}


def pod(sts: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = sts["spec"]["template"]["spec"]
    return template


SHARED = {
    "env": [
        {"name": "HF_HOME", "value": "/data/hf"},
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}},
        {"name": "ME", "value": "$(DILOCO_LEARNER_ID)"},
    ],
    "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
    "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, {"name": "data", "mountPath": "/data"}],
}
UNIT_A = {
    "name": "a",
    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "HF_HOME", "value": "/data/a"}],
    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus-a"}}],
    "volumeMounts": [{"name": "data", "mountPath": "/scratch", "subPath": "tmp"}],
}
UNIT_B = {"name": "b", "volumes": [{"name": "data", "nfs": {"server": "nfs", "path": "/corpus"}}]}


def test_the_jobs_additions_then_the_units_come_after_the_operators_own_in_order() -> None:
    sts = statefulsets(raw([UNIT_A, UNIT_B], learners=SHARED))
    a, b = pod(sts["j-a"]), pod(sts["j-b"])
    env_a = a["containers"][0]["env"]
    own = [e["name"] for e in env_a[:-5]]
    assert [e["name"] for e in env_a[-5:]] == ["HF_HOME", "WANDB_API_KEY", "ME", "NCCL_DEBUG", "HF_HOME"]
    assert all(reserved_env(n) for n in own)  # the operator's come first, and users may not set them
    assert env_a[-4]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "key"}}  # as written
    assert [e["name"] for e in b["containers"][0]["env"][-3:]] == ["HF_HOME", "WANDB_API_KEY", "ME"]
    assert [v["name"] for v in a["volumes"]] == ["config", "tmp", "learner-token", "shm", "data"]
    assert a["volumes"][-1] == UNIT_A["volumes"][0]
    assert b["volumes"][-1] == UNIT_B["volumes"][0]  # each unit its own volume under one name
    assert [(m["name"], m["mountPath"]) for m in a["containers"][0]["volumeMounts"]] == [
        ("config", "/etc/diloco"), ("tmp", "/tmp"), ("learner-token", "/etc/diloco-token"),
        ("shm", "/dev/shm"), ("data", "/data"), ("data", "/scratch"),
    ]  # fmt: skip
    assert a["containers"][0]["volumeMounts"][-1]["subPath"] == "tmp"


def test_a_user_variable_may_refer_to_the_operators_and_the_job_without_additions_is_unchanged() -> None:
    sts = statefulsets(raw([UNIT_A, UNIT_B], learners=SHARED))["j-a"]
    env = resolve_env(container_of(sts), "j-a-0", {})
    assert env["ME"] == "j-a-0"
    assert env["HF_HOME"] == "/data/a"  # the unit's comes last, so it wins
    plain, empty = statefulsets(raw()), statefulsets(raw(learners={"env": [], "volumes": []}))
    assert plain == empty


def test_additions_change_the_pod_template_and_restart_only_the_units_they_touch() -> None:
    before = statefulsets(raw([{"name": "a"}, {"name": "b"}]))
    after = statefulsets(raw([{"name": "a", "env": [{"name": "X", "value": "1"}]}, {"name": "b"}]))

    def template_hash(sts: dict[str, Any]) -> str:
        return str(sts["spec"]["template"]["metadata"]["annotations"]["diloco.dev/template-hash"])

    assert template_hash(before["j-a"]) != template_hash(after["j-a"])
    assert template_hash(before["j-b"]) == template_hash(after["j-b"])


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("diloco-env", {"learners": {"env": [{"name": "DILOCO_LR", "value": "1"}]}},
     r"spec\.learners\.env: DILOCO_LR \(item 0\) is not allowed: every DILOCO_ variable"),
    ("unit-env", {"learnerUnits": [{"name": "a", "env": [{"name": "OK", "value": "1"}, {"name": "WORLD_SIZE", "value": "8"}]}]},
     r"spec\.learnerUnits\.0\.env: WORLD_SIZE \(item 1\) is not allowed: the operator sets it"),
    ("aws", {"learners": {"env": [{"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}},
     "AWS_ACCESS_KEY_ID \\(item 0\\) is not allowed"),
    ("nameless", {"learners": {"env": [{"value": "1"}]}}, r"spec\.learners\.env: item 0 needs a name"),
    ("own-volume", {"learners": {"volumes": [{"name": "tmp", "emptyDir": {}}]}},
     r"spec\.learners\.volumes: 'tmp' \(item 0\) is one of the operator's own volumes"),
    ("unit-volume", {"learnerUnits": [{"name": "a", "volumes": [{"name": "learner-token", "emptyDir": {}}]}]},
     r"spec\.learnerUnits\.0\.volumes: 'learner-token' \(item 0\) is one of the operator's own volumes"),
    ("no-path", {"learners": {"volumes": [{"name": "d", "emptyDir": {}}], "volumeMounts": [{"name": "d"}]}},
     r"spec\.learners\.volumeMounts: item 0 needs a name and a mountPath"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "extra", "says"), REFUSED, ids=[c[0] for c in REFUSED])
def test_the_operator_refuses_names_that_would_override_its_own_with_the_field_to_change(
    case: str, extra: dict[str, Any], says: str
) -> None:
    with pytest.raises(SpecError, match=says):
        parse_spec(raw(**extra))


@pytest.mark.parametrize("source", ["my-secret", None, ["a"]])
def test_a_volume_source_must_be_an_object(source: Any) -> None:
    """The CRD keeps a volume's unknown fields as written: a source that is no object is refused
    with the field to change, before any child is built."""
    volume = {"name": "creds", "secret": source}
    for extra in (
        {"learners": {"volumes": [volume]}},
        {"learnerUnits": [{"name": "a", "volumes": [volume]}]},
    ):
        with pytest.raises(
            SpecError, match=r"'creds' \(item 0\): secret must be an object \(a volume source\)"
        ):
            parse_spec(raw(**extra))


# what no schema can check: the job's and a unit's volumes and mounts together
CONFLICTS: list[tuple[str, dict[str, Any], str]] = [
    ("twice", {"learners": {"volumes": [{"name": "d", "emptyDir": {}}]},
               "learnerUnits": [{"name": "a", "volumes": [{"name": "d", "emptyDir": {}}]}]},
     r"spec\.learnerUnits\[0\] \(a\): volume 'd' is declared more than once"),
    ("no-volume", {"learners": {"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
                   "learnerUnits": [{"name": "a", "volumes": [{"name": "data", "emptyDir": {}}]}, {"name": "b"}]},
     r"spec\.learnerUnits\[1\] \(b\): volumeMounts name 'data', which neither"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "extra", "says"), CONFLICTS, ids=[c[0] for c in CONFLICTS])
def test_volumes_and_mounts_of_the_job_and_a_unit_must_fit_together(
    case: str, extra: dict[str, Any], says: str
) -> None:
    spec = parse_spec(raw(**extra))
    with pytest.raises(SpecError, match=says):
        validate_job("j", spec)


def test_every_problem_is_named_at_once_and_a_good_spec_passes() -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(raw(
            [{"name": "a", "env": [{"name": "RANK", "value": "0"}]}],
            learners={"env": [{"name": "DILOCO_X", "value": "1"}], "volumes": [{"name": "config", "emptyDir": {}}]},
        ))  # fmt: skip
    assert all(n in str(refused.value) for n in ("RANK", "DILOCO_X", "'config'"))
    validate_job("j", parse_spec(raw([UNIT_A, UNIT_B], learners=SHARED)))


def maximal_spec() -> dict[str, Any]:
    """A spec that makes the operator set every learner variable and volume it can."""
    return raw(
        [{"name": "a", "replicas": 2, "region": "eu"}],
        storage={"bucket": "bkt", "endpoint": "http://s3", "region": "eu",
                 "credentialsSecretRef": {"name": "creds"}},
        synchronizer={"tls": {"secretName": "tls"}, "ca": {"secretName": "ca"}},
        train={"compile": True},
    )  # fmt: skip


def test_every_variable_and_volume_the_operator_gives_a_learner_is_reserved() -> None:
    (sts,) = statefulsets(maximal_spec()).values()
    names = [e["name"] for e in pod(sts)["containers"][0]["env"]]
    assert "DILOCO_COMPILE" in names
    assert [n for n in names if not reserved_env(n)] == []
    assert {"WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "AWS_REGION", "AWS_ACCESS_KEY_ID"} <= set(names)
    assert {v["name"] for v in pod(sts)["volumes"]} == set(OWN_VOLUMES)


def _cel(node: dict[str, Any]) -> str:
    (rule,) = node["items"]["x-kubernetes-validations"]
    return str(rule["rule"])


def test_the_crds_cel_rules_refuse_the_same_names() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    for where in (spec["learners"], spec["learnerUnits"]["items"]):
        env_rule, volume_rule = _cel(where["properties"]["env"]), _cel(where["properties"]["volumes"])
        assert f"self.name.startsWith('{RESERVED_ENV_PREFIX}')" in env_rule
        assert re.findall(r"'([A-Z_]+)'", env_rule.split(" in ", 1)[1]) == list(RESERVED_ENV)
        assert re.findall(r"'([a-z-]+)'", volume_rule) == list(OWN_VOLUMES)
        for name in ("env", "volumes", "volumeMounts"):
            node = where["properties"][name]
            assert node["items"]["x-kubernetes-preserve-unknown-fields"] is True
            assert "name" in node["items"]["required"]


def test_the_synchronizer_gets_the_jobs_own_variables_after_the_operators_and_never_in_their_place() -> None:
    """``spec.synchronizer.env``: what the synchronizer needs from the user (a W&B key for
    ``spec.tracking.wandbProject``, say), the same rules as the learners' (operator and CRD)."""
    key = {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}}
    children = build_children(JOB, parse_spec(raw(synchronizer={"env": [key]})))
    (sync,) = [c for c in children if c["kind"] == "Deployment"]
    env = sync["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[-1] == key
    assert [e["name"] for e in env[:-1]] == [
        e["name"] for c in build_children(JOB, parse_spec(raw())) if c["kind"] == "Deployment"
        for e in c["spec"]["template"]["spec"]["containers"][0]["env"]
    ]  # fmt: skip
    with pytest.raises(SpecError, match="DILOCO_STORAGE"):
        parse_spec(raw(synchronizer={"env": [{"name": "DILOCO_STORAGE", "value": "file:///elsewhere"}]}))
    node = schema()["properties"]["spec"]["properties"]["synchronizer"]["properties"]["env"]
    assert _cel(node) == _cel(schema()["properties"]["spec"]["properties"]["learners"]["properties"]["env"])


def test_precision_schedule_and_compile_reach_the_learner(tmp_path: Path) -> None:
    doc = next(d for d in yaml.safe_load_all((EXAMPLES / "single-region.yaml").read_text()) if d)
    doc["spec"]["train"] = {
        **doc["spec"].get("train", {}), "precision": "fp16", "lrSchedule": "wsd", "decayFraction": 0.3,
        "compile": True,
    }  # fmt: skip
    from diloco_worker.settings import parse_settings as parse_worker_settings

    children = build_children(JobRef("k", NAMESPACE, "uid-1"), parse_spec(doc["spec"]))
    config = JobConfig.model_validate_json(
        next(c for c in children if c["kind"] == "ConfigMap")["data"]["job.json"]
    )
    assert "compile" not in config.train.model_dump()  # the worker's setting, not the job's
    sts = next(c for c in children if c["kind"] == "StatefulSet")
    env = resolve_env(
        container_of(sts), f"{sts['metadata']['name']}-0", mounted_files(sts, children, tmp_path)
    )
    settings = parse_worker_settings([], env)
    assert (settings.train.precision, settings.train.lr_schedule, settings.train.decay_fraction) == (
        "fp16", "wsd", 0.3,
    )  # fmt: skip
    assert settings.compile_model is True
    plain = statefulsets(raw())["j-a"]
    assert "DILOCO_COMPILE" not in {e["name"] for e in pod(plain)["containers"][0]["env"]}


def test_the_train_knobs_are_checked_by_the_model_like_the_crd() -> None:
    with pytest.raises(SpecError, match=r"spec\.train\.precision"):
        parse_spec(raw(train={"precision": "fp8"}))
    with pytest.raises(SpecError, match=r"spec\.train\.decayFraction"):
        parse_spec(raw(train={"decayFraction": 0}))
    with pytest.raises(SpecError, match=r"spec\.train\.lrSchedule"):
        parse_spec(raw(train={"lrSchedule": "linear"}))
