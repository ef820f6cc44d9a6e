"""The job's model taken out when it Succeeded: a Kubernetes Job running ``diloco export``.

When the budget is reached the learners stop, the synchronizer has merged what they sent, and the
operator starts ``<job>-export-<hash>`` (``batch/v1``, the worker image, the job's ConfigMap and
storage credentials, ``spec.learners``' env and volumes, so it reads the data as the learners do).
It writes the global model at one consistent version to ``<storage>/export`` (``model.safetensors``,
``hf/`` for a Hugging Face model, ``export.json``) and evaluates it on the task's held-out batches,
the ones ``diloco run`` and ``diloco export -f`` evaluate on. Its container ends with ``export.json``
as its termination message, which the status copies (``diloco_operator.status.export``). The name
carries a hash of the Job's content: a changed spec gives a new export Job, and the old one is pruned.
"""

from __future__ import annotations

from typing import Any

from diloco_operator.builders import env
from diloco_operator.builders.config import template_hash
from diloco_operator.builders.containers import (
    container_security_context,
    pod_security_context,
    with_default_requests,
)
from diloco_operator.builders.names import JobRef, job_id, labels, metadata
from diloco_operator.builders.pod_settings import with_pod_settings
from diloco_operator.builders.volumes import config_mounts, config_volumes
from diloco_operator.schema.spec import DiLoCoJobSpec

COMPONENT = "export"
EXPORT_DEFAULT_REQUESTS = {"cpu": "1", "memory": "2Gi"}
BACKOFF_LIMIT = 2  # an export that fails three times is reported Failed, with its last words
TERMINATION_LOG = "/dev/termination-log"


def export_url(spec: DiLoCoJobSpec) -> str:
    return f"{spec.storage.url}/export"


def eval_batch_size(spec: DiLoCoJobSpec) -> int:
    """The batch size of the held-out batches the job's global model is evaluated on (by ``diloco run``,
    ``diloco export -f`` and the export Job alike): the first running unit's sequences per step (its
    batch size x its pods)."""
    running = [u for u in spec.learner_units if u.replicas > 0] or spec.learner_units
    return running[0].batch_size * max(1, running[0].replicas)


def export_command(job: JobRef, spec: DiLoCoJobSpec) -> list[str]:
    return [
        "diloco",
        "export",
        "--job-config",
        f"{env.CONFIG_DIR}/{env.CONFIG_KEY}",
        "--job-id",
        job_id(job, spec),
        "--storage",
        spec.storage.url,
        "--out",
        export_url(spec),
        "--batch-size",
        str(eval_batch_size(spec)),
        "--evaluate",
        "--summary-file",
        TERMINATION_LOG,
    ]


def build_export_job(job: JobRef, spec: DiLoCoJobSpec) -> dict[str, Any]:
    """The export Job (``batch/v1``); its name ends in a hash of its pod template."""
    container = {
        "name": COMPONENT,
        "image": spec.images.worker,
        "imagePullPolicy": spec.images.pull_policy,
        "command": export_command(job, spec),
        "env": [*env.storage_env(spec), *spec.learners.env],
        "resources": with_default_requests(spec.export.resources, EXPORT_DEFAULT_REQUESTS),
        "securityContext": container_security_context(),
        "volumeMounts": [*config_mounts(), *spec.learners.volume_mounts],
        # the summary on success; the log's tail when it fails, to say why
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    template = {
        "metadata": {"labels": labels(job.name, COMPONENT)},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": pod_security_context(),
            "containers": [container],
            "volumes": [*config_volumes(job.name), *spec.learners.volumes],
        },
    }
    with_pod_settings(template, spec.pods)
    name = f"{job.name}-export-{template_hash(template)[:5]}"  # <= 63: a job's name is <= 50
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(job, name, COMPONENT),
        "spec": {"backoffLimit": BACKOFF_LIMIT, "template": template},
    }
