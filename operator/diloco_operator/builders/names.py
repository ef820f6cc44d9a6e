"""What a DiLoCoJob's children are called and labelled: the API group, names, labels, owner references.

Children of job ``J`` in namespace ``N``:

- Secret ``J-secret`` (key ``job-secret``): the job secret, generated once by the operator.
- ConfigMap ``J-config``: ``job.json`` (a ``diloco_core.config.JobConfig``) and ``storage.json``
  (a ``diloco_core.config.StorageSettings``), mounted at ``/etc/diloco``.
- Per synchronizer shard ``i``: Deployment + Service ``J-sync`` (shard 0) or ``J-sync-i``.
- Per learner unit ``U``: StatefulSet + headless Service + PodDisruptionBudget ``J-U``.

A learner's identity is its pod name (``J-U-0`` …), given to the container as
``DILOCO_LEARNER_ID``; the unit's leader (``J-U-0``) is the one that talks to the synchronizer. Each
unit has a Secret ``J-U-token`` (key ``token``) holding that leader's token, minted by the operator
from the job secret (``credentials``); learner pods get only it, never the job secret. See ``env``
for the full container environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco_operator.builders import env
from diloco_operator.schema.spec import DiLoCoJobSpec

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
# Kueue's labels on a learner unit's StatefulSet: its LocalQueue and its WorkloadPriorityClass
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# Kueue's annotations of a pod template asking its topology-aware scheduling for one domain
REQUIRED_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-required-topology"
PREFERRED_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-preferred-topology"
MANAGED_BY = "diloco-operator"
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


def learner_token_secret_name(job: str, unit: str) -> str:
    return f"{unit_name(job, unit)}-token"


def unit_leader_id(job: str, unit: str) -> str:
    """The learner id of a unit's leader: its StatefulSet's pod of ordinal 0."""
    return f"{unit_name(job, unit)}-0"


def revocations_name(job: str) -> str:
    return f"{job}-revocations"


def sync_port_name(spec: DiLoCoJobSpec) -> str:
    """The name of the synchronizer's port (container and Service): what it speaks."""
    return "https" if spec.synchronizer.tls is not None else "http"
