"""The job's model taken out when it Succeeded: a Kubernetes Job running ``diloco export``, and what
its pod's termination message says, for the status.

When the budget is reached the learners stop, the synchronizer has merged what they sent, and the
operator starts ``<job>-export-<hash>`` (``batch/v1``, the worker image, the job's ConfigMap and
storage credentials, ``spec.learners``' env and volumes, so it reads the data as the learners do).
It writes the global model at one consistent version to ``<storage>/export`` (``model.safetensors``,
``hf/`` for a Hugging Face model, ``export.json``) and evaluates it on the task's held-out batches,
the ones ``diloco run`` and ``diloco export -f`` evaluate on. Its container ends with ``export.json``
as its termination message, which the status copies (``status.export``): the versions, the rounds
and the held-out loss of the model in storage. The name carries a hash of the Job's content: a
changed spec gives a new export Job, and the old one is pruned.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from diloco_operator import env
from diloco_operator.build import (
    JobRef,
    config_mounts,
    config_volumes,
    container_security_context,
    job_id,
    labels,
    metadata,
    pod_security_context,
    template_hash,
    with_default_requests,
)
from diloco_operator.job_status import ExportState, ExportStatus, JobStatus
from diloco_operator.models import DiLoCoJobSpec
from diloco_operator.pods import PodObserved
from diloco_operator.status import Event

COMPONENT = "export"
EXPORT_DEFAULT_REQUESTS = {"cpu": "1", "memory": "2Gi"}
BACKOFF_LIMIT = 2  # an export that fails three times is reported Failed, with its last words
TERMINATION_LOG = "/dev/termination-log"
MAX_MESSAGE = 1024  # of a failed export's log tail kept in the status


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
        "diloco", "export",
        "--job-config", f"{env.CONFIG_DIR}/{env.CONFIG_KEY}",
        "--job-id", job_id(job, spec),
        "--storage", spec.storage.url,
        "--out", export_url(spec),
        "--batch-size", str(eval_batch_size(spec)),
        "--evaluate",
        "--summary-file", TERMINATION_LOG,
    ]  # fmt: skip


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
    name = f"{job.name}-export-{template_hash(template)[:5]}"  # <= 63: a job's name is <= 50
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(job, name, COMPONENT),
        "spec": {"backoffLimit": BACKOFF_LIMIT, "template": template},
    }


def job_export(spec: DiLoCoJobSpec, new: JobStatus, pods: Iterable[PodObserved]) -> ExportStatus | None:
    """The job's ``status.export``: while it has Succeeded (and exports), what the export says, Pending
    before its pod shows; otherwise None (removed: the model in storage is no longer the final one)."""
    if new.phase != "Succeeded" or not spec.export.enabled:
        return None
    return export_status(spec, pods) or export_state("Pending", export_url(spec))


def export_events(old: ExportStatus | None, new: ExportStatus | None) -> list[Event]:
    """An event when an export ends: where the model is and its held-out loss, or why it failed."""
    if new is None or (old is not None and old.state == new.state):
        return []
    if new.state == "Succeeded":
        loss = f", held-out loss {new.held_out_loss:.4f}" if new.held_out_loss is not None else ""
        versions = ", ".join(f"{p}: v{v}" for p, v in sorted((new.versions or {}).items()))
        return [Event("Normal", "Exported", f"the global model ({versions}) is in {new.location}{loss}")]
    if new.state == "Failed":
        return [Event("Warning", "ExportFailed", f"the export to {new.location} failed: {new.message}")]
    return []


def export_status(spec: DiLoCoJobSpec, pods: Iterable[PodObserved]) -> ExportStatus | None:
    """What the export pods say (pure): Succeeded with the summary of the one that finished, else
    Failed once the Job gave up (its retries all failed), else Running; None when there is none yet."""
    mine = [p for p in pods if p.component == COMPONENT]
    if not mine:
        return None
    location = export_url(spec)
    for pod in mine:
        if pod.phase == "Succeeded":
            return summary_status(pod.message, location)
    failed = [p for p in mine if p.phase == "Failed"]
    if len(failed) > BACKOFF_LIMIT:
        last = failed[-1].message.strip()[-MAX_MESSAGE:]
        return export_state("Failed", location, message=last or "the export failed")
    return export_state("Running", location)


def export_state(
    state: ExportState,
    location: str,
    *,
    versions: dict[str, int] | None = None,
    rounds: int | None = None,
    held_out_loss: float | None = None,
    message: str | None = None,
) -> ExportStatus:
    """An export status with every field set, None ones too: the merge patch that writes it then
    removes what an earlier export said (a field left unset would keep it)."""
    return ExportStatus(state=state, location=location, versions=versions, rounds=rounds,
                        held_out_loss=held_out_loss, message=message)  # fmt: skip


def summary_status(message: str, location: str) -> ExportStatus:
    """The status of a finished export from its termination message (``export.json``, compact)."""
    try:
        info = json.loads(message)
        if not isinstance(info, dict):
            raise TypeError(type(info).__name__)
        versions = {str(k): int(v) for k, v in (info.get("versions") or {}).items()}
        loss = info.get("held_out_loss")
        return export_state(
            "Succeeded",
            str(info.get("location") or location),
            versions=versions,
            rounds=int(info.get("rounds") or 0),
            held_out_loss=float(loss) if loss is not None else None,
        )
    except (TypeError, ValueError) as exc:
        return export_state("Succeeded", location, message=f"the export's summary cannot be read: {exc}")
