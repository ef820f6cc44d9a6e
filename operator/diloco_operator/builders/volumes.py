"""The volumes and mounts the operator's pods share: the job's configuration, TLS material, the
synchronizer's CA, a unit's token and the revocations."""

from __future__ import annotations

from typing import Any

from diloco_operator.builders import env
from diloco_operator.builders.names import (
    config_name,
    learner_token_secret_name,
    revocations_name,
)
from diloco_operator.schema.spec import DiLoCoJobSpec


def config_volumes(job: str) -> list[dict[str, Any]]:
    return [
        {"name": "config", "configMap": {"name": config_name(job)}},
        {"name": "tmp", "emptyDir": {}},
    ]


def config_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "config", "mountPath": env.CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def tls_volumes(spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    """The synchronizer's certificate and key (only those two keys of the Secret)."""
    tls = spec.synchronizer.tls
    if tls is None:
        return []
    items = [{"key": k, "path": k} for k in ("tls.crt", "tls.key")]
    return [{"name": "tls", "secret": {"secretName": tls.secret_name, "items": items, "defaultMode": 0o440}}]


def tls_mounts(spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    return [{"name": "tls", "mountPath": env.TLS_DIR, "readOnly": True}] if spec.synchronizer.tls else []


def sync_ca_volumes(spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    """The CA bundle learners trust for the synchronizer (only its key of the Secret or ConfigMap)."""
    ca = spec.synchronizer.ca
    if ca is None:
        return []
    items = [{"key": ca.key, "path": env.SYNC_CA_FILE}]
    source: dict[str, Any] = (
        {"secret": {"secretName": ca.secret_name, "items": items}}
        if ca.secret_name
        else {"configMap": {"name": ca.config_map_name, "items": items}}
    )
    return [{"name": "sync-ca", **source}]


def sync_ca_mounts(spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    return (
        [{"name": "sync-ca", "mountPath": env.SYNC_CA_DIR, "readOnly": True}] if spec.synchronizer.ca else []
    )


def token_volumes(job: str, unit: str) -> list[dict[str, Any]]:
    """The unit's learner-token Secret (its token only)."""
    items = [{"key": env.LEARNER_TOKEN_KEY, "path": env.LEARNER_TOKEN_KEY}]
    secret = {"secretName": learner_token_secret_name(job, unit), "items": items, "defaultMode": 0o440}
    return [{"name": "learner-token", "secret": secret}]


def token_mounts() -> list[dict[str, Any]]:
    return [{"name": "learner-token", "mountPath": env.TOKEN_DIR, "readOnly": True}]


def revocations_volumes(job: str) -> list[dict[str, Any]]:
    return [{"name": "revocations", "configMap": {"name": revocations_name(job)}}]


def revocations_mounts() -> list[dict[str, Any]]:
    return [{"name": "revocations", "mountPath": env.REVOCATIONS_DIR, "readOnly": True}]
