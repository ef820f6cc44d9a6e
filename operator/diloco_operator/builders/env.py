"""The environment contract between the operator and the containers it starts.

Learner (``diloco worker``) containers get:

- ``DILOCO_JOB_ID`` the job's id (its name, or ``synchronizer.external.jobId``); ``DILOCO_UNIT`` learner unit; ``DILOCO_LEARNER_ID`` the pod name;
  ``DILOCO_NAMESPACE``; ``DILOCO_REGION`` (when the unit names one).
- ``DILOCO_SYNC_URL`` the synchronizer (shard 0; the others are announced at registration):
  ``https://`` when the job's synchronizer serves TLS (``synchronizer.tls``) or the external URL is.
- ``DILOCO_SYNC_CA_FILE`` the CA bundle of ``synchronizer.ca``, mounted at ``SYNC_CA_DIR`` (only then).
- ``DILOCO_TOKEN_FILE`` the unit's learner token, the unit's own Secret ``<job>-<unit>-token`` mounted
  at ``TOKEN_DIR``: the token of the unit's leader (pod ordinal 0, the only pod that talks to the
  synchronizer), signed claims (``diloco_core.auth``: learner id, tokens per step, generation,
  expiry) that the operator mints from the job secret (its own, or the external synchronizer's token
  Secret) and renews in place (``tokens``). Learner pods never see the job secret, so a learner
  cannot make another learner's token or one for an id the job has not.
- ``DILOCO_JOB_CONFIG`` path of the ``JobConfig`` JSON; ``DILOCO_STORAGE_CONFIG`` path of the
  ``StorageSettings`` JSON; ``DILOCO_CHECKPOINT_DIR`` where the learner's checkpoints go: the
  job's storage, ``<storage>/checkpoints/<learner id>`` (the learner adds ``rank-N/`` in a unit of
  several pods), so a replaced pod, which keeps its name, resumes from its own checkpoint.
- ``DILOCO_BATCH_SIZE`` the unit's batch size (overrides ``train.batch_size`` of the config).
- ``DILOCO_UNITS_FILE`` path of the job's learner units (``{"units": [names in the spec's order]}``, a
  key of the job ConfigMap left out of its digest): the learner's data shard is its unit's place among
  them, of as many, read when it starts, so no two units read the same windows; the unit's pods take
  turns along its shard, batch by batch. A unit added or removed restarts no other unit (each takes
  the new list when it next starts).
- ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` for the unit's torch.distributed group; the
  rank is the ordinal suffix of the pod name (``HOSTNAME``).
- ``DILOCO_HEALTH_HOST`` / ``DILOCO_HEALTH_PORT`` where the learner serves ``/healthz`` and ``/readyz``.
- ``DILOCO_COMPILE`` ``true`` when ``spec.train.compile`` is set (the worker's ``--compile``).
- ``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` for storage.
- then the spec's own ``spec.learners.env`` and the unit's ``env``, which may not name any of these
  (``pod_additions``).

Synchronizer (``diloco synchronizer``) containers get ``DILOCO_JOB_ID``, ``DILOCO_JOB_OWNER``
(``<namespace>/<name>``: the job's identity in its storage prefix's marker, ``diloco_core.ownership``,
so two jobs of one name in two namespaces never share a prefix), ``DILOCO_JOB_SECRET``,
``DILOCO_JOB_CONFIG``, ``DILOCO_STORAGE_CONFIG``, ``DILOCO_STORAGE`` (the s3:// URL),
``DILOCO_HOST`` (0.0.0.0), ``DILOCO_PORT``, ``DILOCO_SHARD_INDEX``,
``DILOCO_NUM_SHARDS``, ``DILOCO_SHARD_URLS`` (comma separated) and the same ``AWS_*`` variables;
they serve ``/healthz`` and ``/readyz`` on ``DILOCO_PORT``; ``DILOCO_REVOCATIONS_FILE`` the
``<job>-revocations`` ConfigMap mounted at ``REVOCATIONS_DIR`` (``tokens.revocations``);
``DILOCO_MIN_STEP_TIME_S`` the job's ``synchronizer.minStepTimeSeconds``; ``DILOCO_ROUND_MEMORY_BYTES``,
``DILOCO_SERVED_IN_MEMORY_BYTES`` and ``DILOCO_MEMORY_BUDGET_BYTES`` the memory budgets that
``synchronizer.memory`` or the synchronizer's memory limit gives (``schema.sync_memory``). With
``synchronizer.tls`` they also get
``DILOCO_TLS_CERT`` and ``DILOCO_TLS_KEY``, the Secret's ``tls.crt`` and ``tls.key`` mounted at
``TLS_DIR``, and serve HTTPS there.
"""

from __future__ import annotations

from typing import Any

from diloco_operator.schema.spec import DiLoCoJobSpec
from diloco_operator.schema.sync_memory import Budgets

CONFIG_DIR = "/etc/diloco"
CONFIG_KEY = "job.json"
STORAGE_KEY = "storage.json"
UNITS_KEY = "units.json"
JOB_SECRET_KEY = "job-secret"  # noqa: S105 (a key name, not a secret)
LEARNER_TOKEN_KEY = "token"  # noqa: S105 (a key name, not a secret)
SYNC_PORT = 8080
TLS_DIR = "/etc/diloco-tls"  # the synchronizer's certificate and key (not under CONFIG_DIR, a ConfigMap)
SYNC_CA_DIR = "/etc/diloco-sync-ca"  # the CA bundle learners trust for the synchronizer
SYNC_CA_FILE = "ca.crt"
TOKEN_DIR = "/etc/diloco-token"  # noqa: S105 (a path) the unit's learner token (its Secret, mounted)
REVOCATIONS_DIR = "/etc/diloco-revocations"  # the job's revoked token generations (a ConfigMap)
REVOCATIONS_KEY = "revocations.json"
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


def units_env() -> dict[str, Any]:
    return value("DILOCO_UNITS_FILE", f"{CONFIG_DIR}/{UNITS_KEY}")


def memory_env(budgets: Budgets) -> list[dict[str, Any]]:
    """The synchronizer's memory budgets that the job sets or its memory limit gives (the others are
    the synchronizer's defaults)."""
    return [value(f"DILOCO_{name.upper()}", size) for name, size in budgets.settings().items()]


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


def sync_tls_env(spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    """The synchronizer's certificate and key, when it serves HTTPS."""
    if spec.synchronizer.tls is None:
        return []
    return [value("DILOCO_TLS_CERT", f"{TLS_DIR}/tls.crt"), value("DILOCO_TLS_KEY", f"{TLS_DIR}/tls.key")]


def sync_ca_env(spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    """The CA bundle a learner checks the synchronizer's certificate against, when the spec names one."""
    if spec.synchronizer.ca is None:
        return []
    return [value("DILOCO_SYNC_CA_FILE", f"{SYNC_CA_DIR}/{SYNC_CA_FILE}")]


def learner_token_env() -> dict[str, Any]:
    """Where the unit's learner token is: its own Secret (never the job secret) mounted as a file,
    which the kubelet updates when the operator renews the token."""
    return value("DILOCO_TOKEN_FILE", f"{TOKEN_DIR}/{LEARNER_TOKEN_KEY}")


def revocations_env() -> dict[str, Any]:
    """The synchronizer's revocations file (the ``<job>-revocations`` ConfigMap, mounted)."""
    return value("DILOCO_REVOCATIONS_FILE", f"{REVOCATIONS_DIR}/{REVOCATIONS_KEY}")


def job_secret_env(spec: DiLoCoJobSpec, own_secret: str) -> dict[str, Any]:
    """The job secret: ours, or the external synchronizer's when the job uses one."""
    external = spec.synchronizer.external
    if external is not None:
        return secret_ref("DILOCO_JOB_SECRET", external.token_secret_ref.name, external.token_secret_ref.key)
    return secret_ref("DILOCO_JOB_SECRET", own_secret, JOB_SECRET_KEY)
