"""Pure builders of the job's children, checked against golden YAML and for key properties."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_core.auth import mint_token, read_learner_token, verify_learner_token
from diloco_core.config import JobConfig
from diloco_operator.builders.children import build_children
from diloco_operator.builders.containers import (
    LEARNER_DEFAULT_REQUESTS,
    SYNC_DEFAULT_REQUESTS,
    with_default_requests,
)
from diloco_operator.builders.credentials import build_learner_token_secret, build_secret
from diloco_operator.builders.names import JobRef, learner_token_secret_name, unit_leader_id
from diloco_operator.builders.tokens import claim_annotations, unit_claims
from diloco_operator.runtime.reconcile import validation_sample
from diloco_operator.schema.spec import DiLoCoJobSpec, parse_spec

from tests.operator.golden import check_golden

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
JOB = JobRef("gpt-small", "research", "0c6f3c3e-1111-2222-3333-444455556666")


def example(name: str, index: int = 0) -> tuple[str, DiLoCoJobSpec]:
    doc = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d][index]
    return doc["metadata"]["name"], parse_spec(doc["spec"])


def by_kind(children: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [c for c in children if c["kind"] == kind]


def env_of(obj: dict[str, Any]) -> dict[str, Any]:
    container = obj["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_single_region_golden() -> None:
    name, spec = example("single-region.yaml")
    job = JobRef(name, "research", JOB.uid)
    tokens = [
        build_learner_token_secret(
            job,
            unit.name,
            f"token-of-{unit.name}",
            claim_annotations(unit_claims(job, spec, unit, 1_800_000_000)),
        )
        for unit in spec.learner_units
    ]
    check_golden(
        "single-region", [build_secret(job, "not-a-real-secret"), *tokens, *build_children(job, spec)]
    )


def test_a_units_token_is_its_leaders_and_only_the_job_secret_makes_it() -> None:
    """The operator writes each unit's Secret from the job secret: the leader pod's token, signed
    claims the synchronizer checks with the job secret, and which no other unit's token gives away."""
    job = JobRef("gpt", "research", JOB.uid)
    _, spec = example("single-region.yaml")
    unit = spec.learner_units[0]
    claims = unit_claims(job, spec, unit, 1_800_000_000)
    secret = build_learner_token_secret(
        job, unit.name, mint_token("job-secret", claims), claim_annotations(claims)
    )
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert (
        secret["metadata"]["name"] == learner_token_secret_name("gpt", unit.name) == f"gpt-{unit.name}-token"
    )
    assert secret["metadata"]["labels"]["diloco.dev/unit"] == unit.name
    assert secret["metadata"]["ownerReferences"][0]["uid"] == JOB.uid  # deleted with the job
    assert read_learner_token("job-secret", token) == claims
    assert claims.learner == unit_leader_id("gpt", unit.name)
    assert verify_learner_token("job-secret", claims.learner, token, now=1_800_000_000)
    assert not verify_learner_token("job-secret", "gpt-cpu-0", token, now=1_800_000_000)


def test_external_synchronizer_golden() -> None:
    name, spec = example("multi-region.yaml", 1)
    check_golden("multi-region-b", build_children(JobRef(name, "research", JOB.uid), spec))


def test_suspended_and_down_units_golden() -> None:
    _, spec = example("single-region.yaml")
    suspended = spec.model_copy(update={"suspend": True})
    check_golden(
        "suspended",
        by_kind(build_children(JOB, suspended), "StatefulSet")
        + by_kind(build_children(JOB, suspended), "Deployment"),
    )


def test_children_per_unit_and_owner_references() -> None:
    _, spec = example("single-region.yaml")
    children = build_children(JOB, spec)
    names = sorted((c["kind"], c["metadata"]["name"]) for c in children)
    units = [u.name for u in spec.learner_units]
    expected = [
        ("ConfigMap", "gpt-small-config"),
        ("ConfigMap", "gpt-small-revocations"),
        ("Deployment", "gpt-small-sync"),
        ("NetworkPolicy", "gpt-small-sync"),
        ("Service", "gpt-small-sync"),
    ]
    for unit in units:
        expected += [(k, f"gpt-small-{unit}") for k in ("PodDisruptionBudget", "Service", "StatefulSet")]
    assert names == sorted(expected)
    for child in children:
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "diloco.dev/v1alpha1",
            "kind": "DiLoCoJob",
            "name": "gpt-small",
            "uid": JOB.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "research"


def test_config_map_holds_a_valid_job_config() -> None:
    _, spec = example("single-region.yaml")
    (cm, _revocations) = by_kind(build_children(JOB, spec), "ConfigMap")
    config = JobConfig.model_validate_json(cm["data"]["job.json"])
    assert config.job_id == "gpt-small"
    assert config.diloco.quorum == 2
    assert config.diloco.inner_steps == 64
    assert config.model.n_embd == 384
    # TensorBoard's event files go to the job's storage unless the spec says elsewhere
    assert config.tracking.tensorboard == "s3://diloco/jobs/gpt-small/tensorboard"


def test_tracking_of_the_spec_reaches_the_job_config() -> None:
    _, spec = example("single-region.yaml")
    spec = spec.model_copy(
        update={"tracking": parse_spec({**_spec_dict(), "tracking": {"tensorboard": "/mnt/tb", "wandbProject": "p",
                                                                    "flushEverySeconds": 30}}).tracking}
    )  # fmt: skip
    (cm, _revocations) = by_kind(build_children(JOB, spec), "ConfigMap")
    tracking = JobConfig.model_validate_json(cm["data"]["job.json"]).tracking
    assert (tracking.tensorboard, tracking.wandb_project, tracking.flush_every_s) == ("/mnt/tb", "p", 30.0)


def _spec_dict() -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / "single-region.yaml").read_text())
    return dict(doc["spec"])


def test_learner_pods_identity_token_and_placement() -> None:
    _, spec = example("single-region.yaml")
    sts = {s["metadata"]["name"]: s for s in by_kind(build_children(JOB, spec), "StatefulSet")}
    a100 = sts["gpt-small-a100"]
    env = env_of(a100)
    assert env["DILOCO_LEARNER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["DILOCO_SYNC_URL"] == "http://gpt-small-sync.research.svc:8080"
    assert "DILOCO_JOB_SECRET" not in env  # the unit's own token, never the job secret
    assert env["DILOCO_TOKEN_FILE"] == "/etc/diloco-token/token"  # the unit's Secret, mounted
    volumes = {v["name"]: v for v in a100["spec"]["template"]["spec"]["volumes"]}
    assert volumes["learner-token"]["secret"]["secretName"] == "gpt-small-a100-token"
    assert "DILOCO_TOKEN" not in env
    assert env["AWS_SECRET_ACCESS_KEY"] == {
        "secretKeyRef": {"name": "diloco-s3", "key": "AWS_SECRET_ACCESS_KEY"}
    }
    pod = a100["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 1}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"livenessProbe", "readinessProbe"} <= set(container)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert a100["spec"]["replicas"] == 2
    assert sts["gpt-small-cpu"]["spec"]["template"]["spec"]["tolerations"][0]["key"] == "spot"


def test_region_becomes_a_node_selector() -> None:
    _, spec = example("multi-region.yaml", 0)
    (sts, *_) = by_kind(build_children(JobRef("llm-a", "ns", "u"), spec), "StatefulSet")
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"topology.kubernetes.io/region": "region-a"}
    assert env_of(sts)["DILOCO_REGION"] == "region-a"


def test_external_synchronizer_starts_no_synchronizer() -> None:
    name, spec = example("multi-region.yaml", 1)
    children = build_children(JobRef(name, "ns", "u"), spec)
    assert not by_kind(children, "Deployment")
    env = env_of(by_kind(children, "StatefulSet")[0])
    assert env["DILOCO_SYNC_URL"] == "https://diloco-sync.region-a.example.com"
    assert "DILOCO_JOB_SECRET" not in env
    volumes = {
        v["name"]: v for v in by_kind(children, "StatefulSet")[0]["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["learner-token"]["secret"]["secretName"] == f"{name}-{spec.learner_units[0].name}-token"
    assert env["DILOCO_TOKEN_FILE"] == "/etc/diloco-token/token"
    assert not by_kind(children, "ConfigMap")[1:]  # no revocations: the external synchronizer's job has them


@pytest.mark.parametrize(
    ("suspend", "stopped", "down", "expected"),
    [
        (False, False, frozenset(), {"a100": 2, "h100": 1, "cpu": 1, "sync": 1}),
        (True, False, frozenset(), {"a100": 0, "h100": 0, "cpu": 0, "sync": 0}),
        (False, True, frozenset(), {"a100": 0, "h100": 0, "cpu": 0, "sync": 1}),
        (False, False, frozenset({"h100"}), {"a100": 2, "h100": 0, "cpu": 1, "sync": 1}),
    ],
)
def test_replicas_follow_suspend_finish_and_repair(
    suspend: bool, stopped: bool, down: frozenset[str], expected: dict[str, int]
) -> None:
    _, spec = example("single-region.yaml")
    spec = spec.model_copy(update={"suspend": suspend})
    children = build_children(JOB, spec, learners_stopped=stopped, down_units=down)
    got = {
        c["metadata"]["name"].removeprefix("gpt-small-"): c["spec"]["replicas"]
        for c in children
        if c["kind"] in ("StatefulSet", "Deployment")
    }
    assert got == expected


def test_config_change_rolls_pods() -> None:
    _, spec = example("single-region.yaml")
    before = by_kind(build_children(JOB, spec), "StatefulSet")[0]
    changed = spec.model_copy(update={"diloco": spec.diloco.model_copy(update={"outer_lr": 0.5})})
    after = by_kind(build_children(JOB, changed), "StatefulSet")[0]
    key = "diloco.dev/config-hash"
    assert (
        before["spec"]["template"]["metadata"]["annotations"][key]
        != after["spec"]["template"]["metadata"]["annotations"][key]
    )


def test_shards_get_their_own_deployment_and_service() -> None:
    _, spec = example("single-region.yaml")
    spec = spec.model_copy(update={"synchronizer": spec.synchronizer.model_copy(update={"shards": 3})})
    deployments = by_kind(build_children(JOB, spec), "Deployment")
    assert [d["metadata"]["name"] for d in deployments] == [
        "gpt-small-sync",
        "gpt-small-sync-1",
        "gpt-small-sync-2",
    ]
    env = env_of(deployments[2])
    assert env["DILOCO_SHARD_INDEX"] == "2"
    assert env["DILOCO_SHARD_URLS"].count(",") == 2


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {"requests": {"cpu": "1", "memory": "2Gi"}}),  # never BestEffort
        ({"requests": {"cpu": "4"}}, {"requests": {"cpu": "4", "memory": "2Gi"}}),
        (
            {"limits": {"memory": "1Gi"}},
            {"limits": {"memory": "1Gi"}, "requests": {"cpu": "1"}},
        ),  # limit only: kept
        (
            {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}},
            {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}},
        ),
    ],
    ids=["none", "cpu-only", "memory-limit-only", "complete"],
)
def test_default_requests_fill_what_the_spec_leaves_out(
    given: dict[str, Any], expected: dict[str, Any]
) -> None:
    assert with_default_requests(given, LEARNER_DEFAULT_REQUESTS) == expected


def test_learners_and_synchronizer_without_resources_get_default_requests() -> None:
    spec = parse_spec(
        {
            "images": {"worker": "w", "synchronizer": "s"},
            "storage": {"bucket": "bkt"},
            "learnerUnits": [{"name": "a", "gpus": 1}],
        }
    )
    children = build_children(JOB, spec)
    (sts,), (deploy,) = by_kind(children, "StatefulSet"), by_kind(children, "Deployment")
    learner = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert learner == {
        "requests": {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": 1},
        "limits": {"nvidia.com/gpu": 1},
    }
    sync = deploy["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert sync == {"requests": SYNC_DEFAULT_REQUESTS}


def test_synchronizer_stays_reachable_while_not_ready() -> None:
    """During a storage outage /readyz answers 503 but the synchronizer keeps taking contributions."""
    _, spec = example("single-region.yaml")
    children = build_children(JOB, spec)
    (service,) = [s for s in by_kind(children, "Service") if s["metadata"]["name"] == "gpt-small-sync"]
    assert service["spec"]["publishNotReadyAddresses"] is True
    (deploy,) = by_kind(children, "Deployment")
    assert (
        deploy["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"
    )


def test_a_dry_run_validates_one_child_per_distinct_pod_spec() -> None:
    units = [{"name": f"u{i}", "replicas": 8} for i in range(100)] + [
        {"name": "big", "resources": {"requests": {"cpu": "8"}}},
        {"name": "tainted", "tolerations": [{"key": "gpu", "operator": "Exists"}]},
    ]
    spec = parse_spec(
        {
            "images": {"worker": "w", "synchronizer": "s"},
            "storage": {"bucket": "bkt"},
            "learnerUnits": units,
            "synchronizer": {"shards": 3},
        }
    )
    sample = validation_sample(build_children(JOB, spec))
    assert [(o["kind"], o["metadata"]["name"]) for o in sample] == [
        ("Deployment", "gpt-small-sync"),
        ("StatefulSet", "gpt-small-u0"),
        ("StatefulSet", "gpt-small-big"),
        ("StatefulSet", "gpt-small-tainted"),
    ]


def test_each_unit_reads_its_own_data_shard_and_adding_or_removing_a_unit_restarts_no_other() -> None:
    """The units list is a key of the job ConfigMap, mounted in every learner pod and left out of the
    digest the pod templates carry: each learner takes its unit's place in it when it starts."""
    name, spec = example("single-region.yaml")
    job = JobRef(name, "ns", "uid")
    more = spec.model_copy(update={"learner_units": [*spec.learner_units, spec.learner_units[0].model_copy(
        update={"name": "late"})]})  # fmt: skip
    fewer = spec.model_copy(update={"learner_units": spec.learner_units[1:]})
    specs = {"same": spec, "more": more, "fewer": fewer}
    config = {
        k: next(c for c in build_children(job, s) if c["kind"] == "ConfigMap") for k, s in specs.items()
    }
    assert json.loads(config["same"]["data"]["units.json"]) == {"units": [u.name for u in spec.learner_units]}
    assert json.loads(config["more"]["data"]["units.json"])["units"][-1] == "late"
    templates = {
        k: {t["metadata"]["labels"]["diloco.dev/unit"]: t["spec"]["template"] for t in
            by_kind(build_children(job, s), "StatefulSet")}
        for k, s in specs.items()
    }  # fmt: skip
    for changed in ("more", "fewer"):
        for unit, template in templates[changed].items():
            if unit in templates["same"]:
                assert template == templates["same"][unit], unit
    env = {
        e["name"]: e.get("value")
        for e in next(iter(templates["same"].values()))["spec"]["containers"][0]["env"]
    }
    assert env["DILOCO_UNITS_FILE"] == "/etc/diloco/units.json"  # in the config volume
    assert "DILOCO_LEARNER_INDEX" not in env


def test_a_units_pods_carry_the_hash_of_their_template_and_restart_together() -> None:
    name, spec = example("single-region.yaml")
    resized = spec.model_copy(
        update={
            "learner_units": [
                u.model_copy(update={"replicas": u.replicas + 1}) if i == 0 else u
                for i, u in enumerate(spec.learner_units)
            ]
        }
    )
    before, after = (
        by_kind(build_children(JobRef(name, "ns", "uid"), s), "StatefulSet") for s in (spec, resized)
    )
    hashes = [
        [s["spec"]["template"]["metadata"]["annotations"]["diloco.dev/template-hash"] for s in b]
        for b in (before, after)
    ]
    assert hashes[0][0] != hashes[1][0]  # the resized unit's world size is in its pods' environment
    assert hashes[0][1:] == hashes[1][1:]  # the other units' pods are untouched
    assert {s["spec"]["updateStrategy"]["type"] for s in before} == {"OnDelete"}
