"""The environment contract between the operator and the containers it starts.

Learner (``diloco worker``) containers get:

- ``DILOCO_JOB_ID`` the job's id (its name, or ``synchronizer.external.jobId``); ``DILOCO_UNIT`` learner unit; ``DILOCO_LEARNER_ID`` the pod name;
  ``DILOCO_NAMESPACE``; ``DILOCO_REGION`` (when the unit names one).
- ``DILOCO_SYNC_URL`` the synchronizer (shard 0; the others are announced at registration).
- ``DILOCO_JOB_SECRET`` from the job's Secret (or the external synchronizer's token Secret); the
  learner's token is ``diloco_core.auth.learner_token(DILOCO_JOB_SECRET, DILOCO_LEARNER_ID)``.
- ``DILOCO_JOB_CONFIG`` path of the ``JobConfig`` JSON; ``DILOCO_STORAGE_CONFIG`` path of the
  ``StorageSettings`` JSON; ``DILOCO_CHECKPOINT_DIR`` where the learner's checkpoints go: the
  job's storage, ``<storage>/checkpoints/<learner id>`` (the learner adds ``rank-N/`` in a unit of
  several pods), so a replaced pod, which keeps its name, resumes from its own checkpoint.
- ``DILOCO_BATCH_SIZE`` the unit's batch size (overrides ``train.batch_size`` of the config).
- ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` for the unit's torch.distributed group; the
  rank is the ordinal suffix of the pod name (``HOSTNAME``).
- ``DILOCO_HEALTH_HOST`` / ``DILOCO_HEALTH_PORT`` where the learner serves ``/healthz`` and ``/readyz``.
- ``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` for storage.

Synchronizer (``diloco synchronizer``) containers get ``DILOCO_JOB_ID``, ``DILOCO_JOB_SECRET``,
``DILOCO_JOB_CONFIG``, ``DILOCO_STORAGE_CONFIG``, ``DILOCO_STORAGE`` (the s3:// URL),
``DILOCO_HOST`` (0.0.0.0), ``DILOCO_PORT``, ``DILOCO_SHARD_INDEX``,
``DILOCO_NUM_SHARDS``, ``DILOCO_SHARD_URLS`` (comma separated) and the same ``AWS_*`` variables;
they serve ``/healthz`` and ``/readyz`` on ``DILOCO_PORT``.
"""

from __future__ import annotations

from typing import Any

from diloco_operator.models import DiLoCoJobSpec

CONFIG_DIR = "/etc/diloco"
CONFIG_KEY = "job.json"
STORAGE_KEY = "storage.json"
JOB_SECRET_KEY = "job-secret"  # noqa: S105 (a key name, not a secret)
SYNC_PORT = 8080
HEALTH_PORT = 8081
DIST_PORT = 29500


def value(name: str, val: str | int) -> dict[str, Any]:
    return {"name": name, "value": str(val)}


def field_ref(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def secret_ref(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def config_env() -> list[dict[str, Any]]:
    return [
        value("DILOCO_JOB_CONFIG", f"{CONFIG_DIR}/{CONFIG_KEY}"),
        value("DILOCO_STORAGE_CONFIG", f"{CONFIG_DIR}/{STORAGE_KEY}"),
    ]


def storage_env(spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    """The standard AWS variables that ``diloco_core.storage`` reads."""
    s = spec.storage
    out: list[dict[str, Any]] = []
    if s.endpoint:
        out.append(value("AWS_ENDPOINT_URL", s.endpoint))
    if s.region:
        out.append(value("AWS_REGION", s.region))
    creds = s.credentials_secret_ref
    if creds is not None:
        out.append(secret_ref("AWS_ACCESS_KEY_ID", creds.name, creds.access_key_id_key))
        out.append(secret_ref("AWS_SECRET_ACCESS_KEY", creds.name, creds.secret_access_key_key))
    return out


def job_secret_env(spec: DiLoCoJobSpec, own_secret: str) -> dict[str, Any]:
    """The job secret: ours, or the external synchronizer's when the job uses one."""
    external = spec.synchronizer.external
    if external is not None:
        return secret_ref("DILOCO_JOB_SECRET", external.token_secret_ref.name, external.token_secret_ref.key)
    return secret_ref("DILOCO_JOB_SECRET", own_secret, JOB_SECRET_KEY)
