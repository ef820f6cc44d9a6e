"""What a job's pods carry for the cluster around them: a priority class, a scheduler, extra labels
and annotations, a service account (object storage through the cloud's workload identity) and the
Secrets to pull images with.

``spec.pods`` holds them for every pod of the job (synchronizer shards, learner units, the export
Job); ``spec.learnerUnits[].pods`` and ``spec.synchronizer.pods`` for those pods only, over the job's
(:func:`merged`): a name set there wins, labels and annotations are merged key by key, pull Secrets
are added. The keys the operator itself sets (its selectors, its hashes) cannot be set here: a
user's would break the selectors of its StatefulSets, Deployments and NetworkPolicies. Label and
annotation syntax is checked here as the apiserver would check it in the pods, so a mistake is
refused when the job is applied rather than when a StatefulSet cannot create its pods.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from diloco_operator.schema.patterns import DNS_SUBDOMAIN, KEY_NAME

# Keys the operator sets on its pods (``diloco_operator.builders.names``): every ``diloco.dev/`` key
# and the app.kubernetes.io keys of its labels. A test checks the builders' labels are all here.
RESERVED_PREFIX = "diloco.dev/"
RESERVED_KEYS: tuple[str, ...] = (
    "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
)  # fmt: skip
_NAME = re.compile(KEY_NAME)
_SUBDOMAIN = re.compile(DNS_SUBDOMAIN)
MAX_ANNOTATIONS_BYTES = 256 * 1024  # the apiserver's limit for all annotations of an object


def reserved_key(key: str) -> bool:
    return key.startswith(RESERVED_PREFIX) or key in RESERVED_KEYS


def key_problem(key: str) -> str | None:
    """Why ``key`` is not a Kubernetes label/annotation key (``[prefix/]name``), or None."""
    prefix, _, name = key.rpartition("/")
    if not name or len(name) > 63 or not _NAME.match(name):
        return (
            f"'{key}': the name part must be 1-63 characters, alphanumerics with '-', '_' or '.' "
            "inside, starting and ending alphanumeric"
        )
    if "/" in key and (not prefix or len(prefix) > 253 or not _SUBDOMAIN.match(prefix)):
        return f"'{key}': the prefix before '/' must be a DNS subdomain (e.g. example.com)"
    if reserved_key(key):
        return (
            f"'{key}' is the operator's own (every {RESERVED_PREFIX} key and {', '.join(RESERVED_KEYS)}): "
            "its selectors depend on it; choose another key"
        )
    return None


def _check_keys(values: dict[str, str]) -> list[str]:
    return [p for key in values if (p := key_problem(key)) is not None]


class PullSecret(BaseModel):
    """A LocalObjectReference, as in a PodSpec's imagePullSecrets."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(..., min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)


class PodSettings(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    priority_class_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    scheduler_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    service_account_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    image_pull_secrets: list[PullSecret] = Field(default_factory=list, max_length=16)

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        problems = _check_keys(labels)
        problems += [
            f"'{key}': the value '{value}' must be at most 63 characters, empty or alphanumerics with "
            "'-', '_' or '.' inside"
            for key, value in labels.items()
            if value and (len(value) > 63 or not _NAME.match(value))
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return labels

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, annotations: dict[str, str]) -> dict[str, str]:
        problems = _check_keys(annotations)
        size = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
        if size > MAX_ANNOTATIONS_BYTES:
            problems.append(f"{size} bytes in all; the apiserver admits at most {MAX_ANNOTATIONS_BYTES}")
        if problems:
            raise ValueError("; ".join(problems))
        return annotations


def merged(job: PodSettings, own: PodSettings | None) -> PodSettings:
    """The job's settings with a unit's or the synchronizer's over them."""
    if own is None:
        return job
    secrets = list(dict.fromkeys([*job.image_pull_secrets, *own.image_pull_secrets]))
    return PodSettings(
        priority_class_name=own.priority_class_name or job.priority_class_name,
        scheduler_name=own.scheduler_name or job.scheduler_name,
        service_account_name=own.service_account_name or job.service_account_name,
        labels={**job.labels, **own.labels},
        annotations={**job.annotations, **own.annotations},
        image_pull_secrets=secrets,
    )
