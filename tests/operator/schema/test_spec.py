"""Spec parsing and the checks the schema cannot express; operator settings; is_subset (drift)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from diloco_core.config import DiLoCoSettings
from diloco_core.flags import SettingsError
from diloco_operator.cli import main, parse_args
from diloco_operator.kube import is_subset
from diloco_operator.schema.references import secret_references
from diloco_operator.schema.spec import SpecError, parse_spec, validate_job
from diloco_operator.settings import settings_from_env


def raw(**extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "images": {"worker": "w", "synchronizer": "s"},
        "storage": {"bucket": "bkt", "credentialsSecretRef": {"name": "creds"}},
        "learnerUnits": [{"name": "a"}, {"name": "b"}],
    }
    base.update(extra)
    return base


def test_parse_uses_camel_case_and_defaults() -> None:
    spec = parse_spec(raw(diloco={"innerSteps": 100, "mergeRule": "mean"}))
    assert spec.diloco.inner_steps == 100
    assert spec.diloco.merge_rule == "mean"
    assert spec.diloco.codec == DiLoCoSettings().codec == "int2"
    assert spec.storage.url == "s3://bkt"
    assert spec.learner_units[0].replicas == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"diloco": {"codec": "int3"}}, "spec.diloco.codec"),
        ({"learnerUnits": []}, "spec.learnerUnits"),
        ({"learnerUnits": [{"name": "Bad_Name"}]}, "spec.learnerUnits.0.name"),
        ({"surprise": 1}, "spec.surprise"),
        (
            {"storage": {"bucket": "bkt", "endpoint": "seaweedfs:8333"}},
            "spec.storage.endpoint: 'seaweedfs:8333' is not an S3 endpoint: expected an http:// or https://",
        ),
    ],
)
def test_parse_errors_name_the_field(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec(raw(**extra))


@pytest.mark.parametrize(
    "endpoint", ["http://seaweedfs.storage.svc:8333", "https://s3.example.com", "http://[::1]:9000/"]
)
def test_storage_endpoints_that_can_work(endpoint: str) -> None:
    assert parse_spec(raw(storage={"bucket": "bkt", "endpoint": endpoint})).storage.endpoint == endpoint


@pytest.mark.parametrize(
    ("name", "extra", "message"),
    [
        ("j", {"diloco": {"innerSteps": 4, "overlap": 4}}, "overlap"),
        ("j", {"diloco": {"quorum": 3}}, "quorum"),
        ("j", {"learnerUnits": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ("j" * 40, {"learnerUnits": [{"name": "u" * 20}]}, "at most 52"),
        ("j", {"chaos": {"enabled": True, "units": ["zz"]}}, "zz"),
        (
            "j",
            {"synchronizer": {"shards": 4}, "diloco": {"fragments": 2}},
            "spec.synchronizer.shards (4) must be at most spec.diloco.fragments (2)",
        ),
    ],
)
def test_validate_job(name: str, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        validate_job(name, parse_spec(raw(**extra)))


EXTERNAL = {"url": "https://s", "tokenSecretRef": {"name": "t", "key": "k"}}


@pytest.mark.parametrize(
    ("units", "synchronizer", "refused"),
    [
        (["sync"], {}, "sync"),
        (["a", "sync-1"], {"shards": 2}, "sync-1"),
        (["sync-3", "sync"], {"shards": 4}, "sync, sync-3"),
        (["sync-2"], {"shards": 2}, None),  # shards 0 and 1: J-sync, J-sync-1
        (["sync-0", "syncer", "a-sync"], {"shards": 2}, None),
        (["sync"], {"external": EXTERNAL}, None),  # this job runs no synchronizer
    ],
)
def test_a_unit_may_not_take_the_name_of_a_synchronizer_shard(
    units: list[str], synchronizer: dict[str, Any], refused: str | None
) -> None:
    spec = parse_spec(
        raw(learnerUnits=[{"name": u} for u in units], synchronizer=synchronizer, diloco={"fragments": 4})
    )
    if refused is None:
        validate_job("j", spec)
        return
    with pytest.raises(SpecError, match=re.escape(f"unit names {refused} are the synchronizer's own")):
        validate_job("j", spec)


@pytest.mark.parametrize(
    ("name", "ok"),
    [("j", True), ("my-job-2", True), ("1job", False), ("my.job", False), ("job-", False), ("Job", False)],
)
def test_the_job_name_must_be_a_dns_1035_label_as_it_names_services(name: str, ok: bool) -> None:
    spec = parse_spec(raw())
    if ok:
        validate_job(name, spec)
        return
    with pytest.raises(SpecError, match=re.escape(f"the job name '{name}' must be a DNS-1035 label")):
        validate_job(name, spec)


def test_the_quorum_counts_only_units_with_pods() -> None:
    units = [{"name": "a"}, {"name": "b", "replicas": 0}]
    validate_job("j", parse_spec(raw(learnerUnits=units, diloco={"quorum": 1})))
    with pytest.raises(
        SpecError, match=re.escape("learner units (1, not counting b: replicas 0, never ready)")
    ):
        validate_job("j", parse_spec(raw(learnerUnits=units, diloco={"quorum": 2})))


@pytest.mark.parametrize(
    "synchronizer",
    [
        {"shards": 2},
        # an external synchronizer: this job runs no shard
        {"shards": 4, "external": {"url": "https://s", "tokenSecretRef": {"name": "t", "key": "k"}}},
    ],
)
def test_shards_up_to_the_fragments_are_valid(synchronizer: dict[str, Any]) -> None:
    validate_job("j", parse_spec(raw(synchronizer=synchronizer, diloco={"fragments": 2})))


def test_valid_job_passes_and_lists_secret_references() -> None:
    spec = parse_spec(
        raw(synchronizer={"external": {"url": "https://s", "tokenSecretRef": {"name": "t", "key": "k"}}})
    )
    validate_job("j", spec)
    assert secret_references(spec) == [
        ("creds", "AWS_ACCESS_KEY_ID"),
        ("creds", "AWS_SECRET_ACCESS_KEY"),
        ("t", "k"),
    ]


def test_settings_from_env() -> None:
    s = settings_from_env(
        {"DILOCO_OPERATOR_RESYNC_SECONDS": "2", "DILOCO_OPERATOR_METRICS_PORT": "0", "HOME": "/"}
    )
    assert (s.resync_seconds, s.metrics_port, s.sync_url) == (2.0, 0, None)
    with pytest.raises(ValueError, match="DILOCO_OPERATOR_RESYNC_SECONDS"):
        settings_from_env({"DILOCO_OPERATOR_RESYNC_SECONDS": "-1"})
    with pytest.raises(ValueError, match="DILOCO_OPERATOR_NOPE"):
        settings_from_env({"DILOCO_OPERATOR_NOPE": "1"})


def test_cli_arguments() -> None:
    args = parse_args(["-n", "a", "-n", "b", "--standalone"], {})
    assert (args.namespace, args.standalone, args.peering) == (("a", "b"), True, "diloco")
    assert parse_args([], {}).namespace == ()


def test_every_setting_is_a_flag_and_a_variable_and_the_flag_wins() -> None:
    env = {
        "DILOCO_OPERATOR_RESYNC_SECONDS": "2",
        "DILOCO_OPERATOR_NAMESPACE": "x,y",
        "DILOCO_OPERATOR_ALLOW_CHAOS": "1",
    }
    s = parse_args(["--resync-seconds", "3", "--no-allow-chaos"], env)
    assert (s.resync_seconds, s.namespace, s.allow_chaos) == (3.0, ("x", "y"), False)
    with pytest.raises(SettingsError, match=r"resync_seconds \(--resync-seconds=0\)"):
        parse_args(["--resync-seconds", "0"], {})


def test_namespace_patterns_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-n", "team-*", "--standalone"]) == 2
    assert "not patterns: team-*" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("desired", "actual", "same"),
    [
        ({"a": 1}, {"a": 1, "b": 2}, True),
        ({"a": {"b": [1, 2]}}, {"a": {"b": [1, 2], "c": 0}}, True),
        ({"a": {"b": [1, 2]}}, {"a": {"b": [1]}}, False),
        ({"a": [{"name": "x"}]}, {"a": [{"name": "x", "protocol": "TCP"}]}, True),
        ({"gpu": 1}, {"gpu": "1"}, True),
        ({"replicas": 2}, {"replicas": 3}, False),
        # quantities come back in the apiserver's canonical form
        (
            {"resources": {"requests": {"cpu": "0.5", "memory": "1.5Gi"}, "limits": {"memory": 1073741824}}},
            {"resources": {"requests": {"cpu": "500m", "memory": "1536Mi"}, "limits": {"memory": "1Gi"}}},
            True,
        ),
        ({"emptyDir": {"sizeLimit": "1.5Gi"}}, {"emptyDir": {"sizeLimit": "1536Mi"}}, True),
        ({"requests": {"storage": "1024Mi"}}, {"requests": {"storage": "1Gi"}}, True),
        ({"limits": {"cpu": "1"}}, {"limits": {"cpu": "2"}}, False),
        ({"limits": {"nvidia.com/gpu": 1}}, {"limits": {"nvidia.com/gpu": "2"}}, False),
        ({"requests": {"cpu": "0.5"}}, {"requests": {}}, False),
        # elsewhere a value is compared as written: an environment variable "0.5" is not "500m"
        ({"env": [{"name": "X", "value": "0.5"}]}, {"env": [{"name": "X", "value": "500m"}]}, False),
        ({"a": 1}, {}, False),
    ],
)
def test_is_subset(desired: Any, actual: Any, same: bool) -> None:
    assert is_subset(desired, actual) is same
