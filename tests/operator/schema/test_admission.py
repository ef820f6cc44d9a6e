"""What the apiserver admits and refuses with the CRD installed (its schema, patterns and CEL
rules), and that the operator's own checks refuse the same specs."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_core.endpoint_url import ENDPOINT_URL_EXPECTED, ENDPOINT_URL_PATTERN
from diloco_operator.schema.spec import SpecError, parse_spec, validate_job

from tests.operator.schema.test_crd import schema


def test_the_crd_checks_storage_endpoints_as_the_core_does() -> None:
    """The same pattern and the same words as ``diloco_core.endpoint_url``."""
    endpoint = schema()["properties"]["spec"]["properties"]["storage"]["properties"]["endpoint"]
    (rule,) = endpoint["x-kubernetes-validations"]
    assert rule["rule"] == f"self.matches(r'{ENDPOINT_URL_PATTERN}')"
    assert rule["messageExpression"] == f'"\'" + self + "\' {ENDPOINT_URL_EXPECTED}"'


def test_the_crd_refuses_more_shards_than_fragments_for_a_synchronizer_of_its_own() -> None:
    rules = {r["rule"] for r in schema()["properties"]["spec"]["x-kubernetes-validations"]}
    assert "has(self.synchronizer.external) || self.synchronizer.shards <= self.diloco.fragments" in rules


# Specs the apiserver refuses, with what its answer must say. Each could never work: a resource
# quantity that is not one (the StatefulSet would be refused), an embedding the built-in model's
# heads cannot split, an entry point that is no 'package.module:function', a storage endpoint the S3
# client cannot use, synchronizer shards that would own no fragment.
REFUSED = [
    (
        "quantity",
        {"learnerUnits": [{"name": "a", "resources": {"requests": {"cpu": "lots"}}}]},
        "learnerUnits[0].resources.requests.cpu",
    ),
    (
        "sync-quantity",
        {"synchronizer": {"resources": {"limits": {"memory": "a lot"}}}},
        "synchronizer.resources.limits.memory",
    ),
    (
        "sync-memory-quantity",
        {"synchronizer": {"memory": {"rounds": "a lot"}}},
        "synchronizer.memory.rounds",
    ),
    ("heads", {"model": {"nHead": 3, "nEmbd": 128}}, "model.nEmbd must be a multiple of model.nHead"),
    ("entry-point", {"model": {"entryPoint": "my model.py"}}, "spec.model.entryPoint"),
    # variables and volumes that would override the operator's own (CEL rules)
    ("diloco-env", {"learners": {"env": [{"name": "DILOCO_LR", "value": "1"}]}}, "DILOCO_ variables are"),
    (
        "unit-env",
        {"learnerUnits": [{"name": "a", "env": [{"name": "MASTER_PORT", "value": "1"}]}]},
        "spec.learnerUnits[0].env[0]",
    ),
    (
        "own-volume",
        {"learnerUnits": [{"name": "a", "volumes": [{"name": "tmp", "emptyDir": {}}]}]},
        "the operator's own volumes",
    ),
    (
        "endpoint",
        {"storage": {"bucket": "diloco-test", "endpoint": "seaweedfs:8333"}},
        f"'seaweedfs:8333' {ENDPOINT_URL_EXPECTED}",
    ),
    (
        "shards",
        {"synchronizer": {"shards": 4}, "diloco": {"quorum": 1, "fragments": 2}},
        "synchronizer.shards must be at most diloco.fragments",
    ),
    ("sync-unit", {"learnerUnits": [{"name": "sync"}]}, "names of the synchronizer's Services"),
    (
        "sync-shard-unit",
        {
            "synchronizer": {"shards": 2},
            "diloco": {"quorum": 1, "fragments": 2},
            "learnerUnits": [{"name": "sync-1"}],
        },
        "names of the synchronizer's Services",
    ),
    (
        "parked-quorum",
        {"diloco": {"quorum": 2}, "learnerUnits": [{"name": "a"}, {"name": "b", "replicas": 0}]},
        "learner units with pods",
    ),
    (
        "unit-pace",
        {"learnerUnits": [{"name": "a", "minStepTimeSeconds": 0}]},
        "spec.learnerUnits[0].minStepTimeSeconds",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize(("case", "spec", "says"), REFUSED, ids=[c[0] for c in REFUSED])
def test_the_apiserver_refuses_a_spec_that_can_never_work(
    api: Any, namespace: str, case: str, spec: dict[str, Any], says: str
) -> None:
    from kubernetes.client.exceptions import ApiException

    from tests.operator.kubejobs import create_job, job_manifest, unit

    manifest = job_manifest(case, [unit("a")])
    manifest["spec"].update(spec)
    with pytest.raises(ApiException) as refused:
        create_job(api, namespace, manifest)
    assert refused.value.status == 422
    assert says in refused.value.body
    with pytest.raises(SpecError):  # and the operator refuses it too (diloco operator --dry-run)
        validate_job(case, parse_spec(manifest["spec"]))


@pytest.mark.integration
def test_unit_names_past_the_shards_and_a_parked_unit_within_the_quorum_are_admitted(
    api: Any, namespace: str
) -> None:
    from kubernetes import client as k8s

    from tests.operator.kubejobs import GROUP, PLURAL, VERSION, job_manifest

    manifest = job_manifest("parked", [{"name": "sync-2"}, {"name": "syncer"}, {"name": "b", "replicas": 0}])
    manifest["spec"]["synchronizer"] = {"shards": 2}
    manifest["spec"]["diloco"] = {"quorum": 2, "fragments": 2}
    created = k8s.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, manifest, dry_run="All"
    )
    validate_job("parked", parse_spec(created["spec"]))


@pytest.mark.integration
def test_a_user_entry_point_and_a_user_models_heads_are_admitted(api: Any, namespace: str) -> None:
    from kubernetes import client as k8s

    from tests.operator.kubejobs import GROUP, PLURAL, VERSION, job_manifest, unit

    manifest = job_manifest(
        "user", [unit("a", resources={"requests": {"cpu": "1500m", "memory": 1073741824}})]
    )
    manifest["spec"]["model"] = {
        "entryPoint": "user_model:build",
        "nHead": 3,
        "nEmbd": 128,
    }  # not the built-in
    created = k8s.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, manifest, dry_run="All"
    )
    assert created["spec"]["model"]["entryPoint"] == "user_model:build"


@pytest.mark.integration
def test_learner_env_and_volumes_are_admitted_as_written(api: Any, namespace: str) -> None:
    """Kept whole (x-kubernetes-preserve-unknown-fields), not pruned to their names."""
    from kubernetes import client as k8s

    from tests.operator.kubejobs import GROUP, PLURAL, VERSION, job_manifest, unit

    env = [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    volumes = [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus", "readOnly": True}}]
    mounts = [{"name": "data", "mountPath": "/data", "subPath": "x"}]
    manifest = job_manifest("extras", [{**unit("a"), "env": env, "volumes": volumes}])
    manifest["spec"]["learners"] = {"env": [{"name": "A", "value": "1"}], "volumeMounts": mounts}
    manifest["spec"]["train"] = {"precision": "bf16", "lrSchedule": "wsd", "compile": True}
    created = k8s.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, manifest, dry_run="All"
    )
    spec = created["spec"]
    assert (spec["learnerUnits"][0]["env"], spec["learnerUnits"][0]["volumes"]) == (env, volumes)
    assert spec["learners"]["volumeMounts"] == mounts
    assert spec["train"]["decayFraction"] == 0.2  # defaulted
    validate_job("extras", parse_spec(spec))


@pytest.mark.integration
@pytest.mark.parametrize(
    ("endpoint", "synchronizer"),
    [
        ("http://seaweedfs.storage.svc:8333", {"shards": 2}),
        ("https://s3.example.com", {}),
        # a synchronizer in another cluster: this job runs no shard
        (
            "http://[::1]:9000/",
            {"shards": 4, "external": {"url": "https://s", "tokenSecretRef": {"name": "t", "key": "k"}}},
        ),
    ],
)
def test_storage_endpoints_and_shards_that_can_work_are_admitted(
    api: Any, namespace: str, endpoint: str, synchronizer: dict[str, Any]
) -> None:
    from kubernetes import client as k8s

    from tests.operator.kubejobs import GROUP, PLURAL, VERSION, job_manifest, unit

    manifest = job_manifest("ok", [unit("a")], synchronizer=synchronizer)
    manifest["spec"]["storage"]["endpoint"] = endpoint
    manifest["spec"]["diloco"]["fragments"] = 2
    created = k8s.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, manifest, dry_run="All"
    )
    assert created["spec"]["storage"]["endpoint"] == endpoint
    validate_job("ok", parse_spec(created["spec"]))
