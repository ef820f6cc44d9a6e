"""Pure builders of a DiLoCoJob's children: plain dicts, ready to be applied.

Children of job ``J`` in namespace ``N``:

- Secret ``J-secret`` (key ``job-secret``): the job secret, generated once by the operator.
- ConfigMap ``J-config``: ``job.json`` (a ``diloco_core.config.JobConfig``) and ``storage.json``
  (a ``diloco_core.config.StorageSettings``), mounted at ``/etc/diloco``.
- Per synchronizer shard ``i``: Deployment + Service ``J-sync`` (shard 0) or ``J-sync-i``.
- Per learner unit ``U``: StatefulSet + headless Service + PodDisruptionBudget ``J-U``.

A learner's identity is its pod name (``J-U-0`` …), given to the container as
``DILOCO_LEARNER_ID``; the unit's leader (``J-U-0``) is the one that talks to the synchronizer. Each
unit has a Secret ``J-U-token`` (key ``token``) holding that leader's token,
``diloco_core.auth.learner_token(job secret, "J-U-0")``, written by the operator from the job
secret; learner pods get only it (``DILOCO_TOKEN``), never the job secret. See ``env.py`` for the
full container environment.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco_core.config import (
    DataSettings,
    DiLoCoSettings,
    JobConfig,
    ModelSettings,
    StorageSettings,
    TrackingSettings,
    TrainSettings,
)

from diloco_operator import env
from diloco_operator.models import DiLoCoJobSpec, LearnerUnit

GROUP = "diloco.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DiLoCoJob"
PLURAL = "dilocojobs"

JOB_LABEL = "diloco.dev/job"
UNIT_LABEL = "diloco.dev/unit"
COMPONENT_LABEL = "app.kubernetes.io/component"
SHARD_LABEL = "diloco.dev/shard"
CONFIG_HASH_ANNOTATION = "diloco.dev/config-hash"
TEMPLATE_HASH_ANNOTATION = "diloco.dev/template-hash"
MANAGED_BY = "diloco-operator"

RUN_AS_USER = 10001
UNLIMITED_STEPS = 1_000_000_000


@dataclass(frozen=True)
class JobRef:
    """The identity of the custom resource that owns the children."""

    name: str
    namespace: str
    uid: str


def secret_name(job: str) -> str:
    return f"{job}-secret"


def config_name(job: str) -> str:
    return f"{job}-config"


def sync_name(job: str, shard: int = 0) -> str:
    return f"{job}-sync" if shard == 0 else f"{job}-sync-{shard}"


def unit_name(job: str, unit: str) -> str:
    return f"{job}-{unit}"


def job_id(job: JobRef, spec: DiLoCoJobSpec) -> str:
    """The id of the training job the learners belong to: the external synchronizer's job, if named."""
    external = spec.synchronizer.external
    if external is not None and external.job_id:
        return external.job_id
    return job.name


def sync_url(job: JobRef, spec: DiLoCoJobSpec, shard: int = 0) -> str:
    """The URL learners use to reach synchronizer ``shard`` (or the external synchronizer)."""
    if spec.synchronizer.external is not None:
        return spec.synchronizer.external.url.rstrip("/")
    scheme = "https" if spec.synchronizer.https else "http"
    return f"{scheme}://{sync_name(job.name, shard)}.{job.namespace}.svc:{env.SYNC_PORT}"


def labels(job: str, component: str, **extra: str) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "diloco",
        "app.kubernetes.io/instance": job,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        JOB_LABEL: job,
    }
    out.update(extra)
    return out


def owner_reference(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(job: JobRef, name: str, component: str, **extra: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": labels(job.name, component, **extra),
        "ownerReferences": [owner_reference(job)],
    }


def build_job_config(job: JobRef, spec: DiLoCoJobSpec) -> JobConfig:
    """The ``JobConfig`` every synchronizer and learner of the job reads from the ConfigMap: the spec's
    sections are the core's settings; the step budget gives the schedule's length."""
    train = spec.train.model_dump(exclude={"compile"}) | {"max_steps": spec.budget.steps or UNLIMITED_STEPS}
    return JobConfig(
        job_id=job_id(job, spec),
        diloco=DiLoCoSettings.model_validate(spec.diloco.model_dump()),
        model=ModelSettings.model_validate(spec.model.model_dump()),
        train=TrainSettings.model_validate(train),
        data=DataSettings.model_validate(spec.data.model_dump()),
        tracking=build_tracking(spec),
    )


def build_tracking(spec: DiLoCoJobSpec) -> TrackingSettings:
    """The spec's tracking, TensorBoard's event files in the job's storage unless it names a place."""
    tracking = TrackingSettings.model_validate(spec.tracking.model_dump())
    if tracking.tensorboard:
        return tracking
    return tracking.model_copy(update={"tensorboard": f"{spec.storage.url}/tensorboard"})


def build_storage_settings(spec: DiLoCoJobSpec) -> StorageSettings:
    s = spec.storage
    return StorageSettings(url=s.url, endpoint_url=s.endpoint, region=s.region)


def learner_token_secret_name(job: str, unit: str) -> str:
    return f"{unit_name(job, unit)}-token"


def unit_leader_id(job: str, unit: str) -> str:
    """The learner id of a unit's leader: its StatefulSet's pod of ordinal 0."""
    return f"{unit_name(job, unit)}-0"


def build_learner_token_secret(
    job: JobRef, unit: str, token: str, annotations: Mapping[str, str]
) -> dict[str, Any]:
    """The unit's learner token (its leader's), the only credential its pods get; ``annotations``
    say what the token claims (``tokens.claim_annotations``)."""
    meta = metadata(job, learner_token_secret_name(job.name, unit), "learner-token", **{UNIT_LABEL: unit})
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta | {"annotations": dict(annotations)},
        "type": "Opaque",
        "data": {env.LEARNER_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def revocations_name(job: str) -> str:
    return f"{job}-revocations"


def build_revocations_config_map(job: JobRef, revocations_json: str) -> dict[str, Any]:
    """The lowest learner-token generation the job's synchronizer accepts per learner, mounted into
    its pods and re-read there when it changes (a change restarts nothing)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, revocations_name(job.name), "revocations"),
        "data": {env.REVOCATIONS_KEY: revocations_json},
    }


def build_secret(job: JobRef, job_secret: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(job, secret_name(job.name), "secret"),
        "type": "Opaque",
        "stringData": {env.JOB_SECRET_KEY: job_secret},
    }


def build_config_map(job: JobRef, spec: DiLoCoJobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, config_name(job.name), "config"),
        "data": {
            env.CONFIG_KEY: build_job_config(job, spec).model_dump_json(indent=2),
            env.STORAGE_KEY: build_storage_settings(spec).model_dump_json(indent=2),
            env.UNITS_KEY: units_document(spec),
        },
    }


def units_document(spec: DiLoCoJobSpec) -> str:
    """The job's learner units in the spec's order: a learner's data shard is its unit's place among
    them (``diloco_worker.settings.data_shard``), read when the learner starts."""
    return json.dumps({"units": [u.name for u in spec.learner_units]})


def config_hash(config_map: dict[str, Any]) -> str:
    """A short digest of the ConfigMap's data; a change rolls the pods that read it. The units list is
    left out: a unit added or removed must not restart the others (each takes its data shard from
    the list when it starts next, see env.py)."""
    data = {k: v for k, v in config_map["data"].items() if k != env.UNITS_KEY}
    blob = json.dumps(data, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def template_hash(template: Mapping[str, Any]) -> str:
    """A short digest of a pod template: the pods made from another one are outdated."""
    blob = json.dumps(template, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


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


def sync_port_name(spec: DiLoCoJobSpec) -> str:
    """The name of the synchronizer's port (container and Service): what it speaks."""
    return "https" if spec.synchronizer.tls is not None else "http"


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


def http_probe(path: str, port: str, period: int, failures: int, scheme: str = "HTTP") -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port, **({"scheme": scheme} if scheme != "HTTP" else {})},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


# Requests of a pod whose spec names none, so that it is never BestEffort (the first evicted under
# node pressure) and the scheduler counts it. A learner holds a model, its optimizer state and a
# data pipeline: one core and 2Gi is the floor of a small model; the synchronizer holds one copy
# of the parameters per fragment in memory and spends its CPU on the codec: half a core and 1Gi.
LEARNER_DEFAULT_REQUESTS = {"cpu": "1", "memory": "2Gi"}
SYNC_DEFAULT_REQUESTS = {"cpu": "500m", "memory": "1Gi"}


def with_default_requests(resources: Mapping[str, Any], defaults: Mapping[str, str]) -> dict[str, Any]:
    """``resources`` with a default request for each resource it neither requests nor limits.

    A resource with a limit only is left alone: Kubernetes requests the limit then, and a default
    request above a smaller limit would be refused.
    """
    out: dict[str, Any] = {k: dict(v) for k, v in resources.items()}
    named = set(out.get("requests") or {}) | set(out.get("limits") or {})
    missing = {k: v for k, v in defaults.items() if k not in named}
    if missing:
        out["requests"] = {**missing, **(out.get("requests") or {})}
    return out


def unit_resources(unit: LearnerUnit) -> dict[str, Any]:
    """The unit's resources (default requests added, see above), ``gpus`` as ``nvidia.com/gpu``."""
    resources = with_default_requests(unit.resources, LEARNER_DEFAULT_REQUESTS)
    if unit.gpus:
        for part in ("requests", "limits"):
            resources.setdefault(part, {})["nvidia.com/gpu"] = unit.gpus
    return resources
