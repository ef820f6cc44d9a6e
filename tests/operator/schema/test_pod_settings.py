"""Pod settings of a job (spec.pods, a unit's and the synchronizer's): what is refused and why, the
operator's own keys, and how a unit's or the synchronizer's settings go over the job's."""

from __future__ import annotations

import pytest
from diloco_operator.builders.names import (
    CONFIG_HASH_ANNOTATION,
    SHARD_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    UNIT_LABEL,
    labels,
)
from diloco_operator.schema.pod_settings import PodSettings, key_problem, merged, reserved_key
from diloco_operator.schema.references import pod_settings_references
from diloco_operator.schema.spec import SpecError, parse_spec
from pydantic import ValidationError

BASE = {
    "images": {"worker": "w", "synchronizer": "s"},
    "storage": {"bucket": "bkt"},
    "learnerUnits": [{"name": "a"}, {"name": "b"}],
}


def test_the_operators_own_keys_are_reserved() -> None:
    own = [*labels("job", "learner", **{UNIT_LABEL: "a", SHARD_LABEL: "0"})]
    own += [CONFIG_HASH_ANNOTATION, TEMPLATE_HASH_ANNOTATION]
    assert [k for k in own if not reserved_key(k)] == []
    assert not reserved_key("team.example.com/cost-center")
    assert not reserved_key("app.kubernetes.io/part-of")


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("team", None),
        ("example.com/team", None),
        ("", "name part"),
        ("-team", "name part"),
        ("a" * 64, "name part"),
        ("Example.com/team", "DNS subdomain"),
        ("/team", "DNS subdomain"),
        ("diloco.dev/unit", "operator's own"),
        ("app.kubernetes.io/instance", "operator's own"),
    ],
)
def test_label_and_annotation_keys(key: str, why: str | None) -> None:
    problem = key_problem(key)
    assert (problem is None) if why is None else (problem is not None and why in problem), problem


def test_bad_settings_are_refused_with_the_field() -> None:
    bad = {
        "priorityClassName": "High Priority",
        "labels": {"diloco.dev/job": "x", "team": "not valid!"},
        "annotations": {"ok.example.com/a": "any text at all: fine"},
        "imagePullSecrets": [{"name": "Reg_Creds"}],
    }
    with pytest.raises(SpecError) as refused:
        parse_spec({**BASE, "pods": bad})
    said = str(refused.value)
    for part in ("spec.pods.priorityClassName", "spec.pods.labels", "'diloco.dev/job'", "'not valid!'",
                 "spec.pods.imagePullSecrets.0.name"):  # fmt: skip
        assert part in said, said
    assert "annotations" not in said


def test_annotations_larger_than_the_apiserver_admits_are_refused() -> None:
    with pytest.raises(ValidationError, match="262144"):
        PodSettings(annotations={f"k{i}": "x" * 70_000 for i in range(4)})


def test_a_units_and_the_synchronizers_settings_go_over_the_jobs() -> None:
    spec = parse_spec(
        {
            **BASE,
            "pods": {
                "priorityClassName": "training",
                "serviceAccountName": "trainer",
                "labels": {"team": "llm", "tier": "batch"},
                "annotations": {"cost.example.com/center": "42"},
                "imagePullSecrets": [{"name": "registry"}],
            },
            "learnerUnits": [
                {"name": "a"},
                {
                    "name": "b",
                    "pods": {
                        "priorityClassName": "spare",
                        "labels": {"tier": "spot"},
                        "imagePullSecrets": [{"name": "registry"}, {"name": "mirror"}],
                    },
                },
            ],
            "synchronizer": {"pods": {"schedulerName": "hub-scheduler", "serviceAccountName": "sync"}},
        }
    )
    a, b = (merged(spec.pods, u.pods) for u in spec.learner_units)
    assert a == spec.pods
    assert b.priority_class_name == "spare"
    assert b.service_account_name == "trainer"
    assert b.labels == {"team": "llm", "tier": "spot"}
    assert b.annotations == {"cost.example.com/center": "42"}
    assert [s.name for s in b.image_pull_secrets] == ["registry", "mirror"]
    sync = merged(spec.pods, spec.synchronizer.pods)
    assert (sync.scheduler_name, sync.service_account_name, sync.priority_class_name) == (
        "hub-scheduler",
        "sync",
        "training",
    )
    assert pod_settings_references(spec) == (["sync", "trainer"], ["spare", "training"])


def test_an_external_synchronizers_settings_name_nothing_to_check() -> None:
    spec = parse_spec(
        {
            **BASE,
            "synchronizer": {
                "external": {"url": "https://sync.example.com", "tokenSecretRef": {"name": "t", "key": "k"}},
                "pods": {"serviceAccountName": "unused"},
            },
        }
    )
    assert pod_settings_references(spec) == ([], [])
