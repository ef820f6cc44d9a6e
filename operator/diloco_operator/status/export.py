"""What the export Job's pod says, for the status: ``status.export`` (state, location, the versions,
the rounds and the held-out loss of the model in storage, from the container's termination message)
and the ``Exported`` / ``ExportFailed`` events."""

from __future__ import annotations

import json
from collections.abc import Iterable

from diloco_operator.builders.export import BACKOFF_LIMIT, COMPONENT, export_url
from diloco_operator.schema.spec import DiLoCoJobSpec
from diloco_operator.schema.status import ExportState, ExportStatus, JobStatus
from diloco_operator.status.events import Event
from diloco_operator.status.pods import PodObserved

MAX_MESSAGE = 1024  # of a failed export's log tail kept in the status


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
    return ExportStatus(
        state=state,
        location=location,
        versions=versions,
        rounds=rounds,
        held_out_loss=held_out_loss,
        message=message,
    )


def summary_status(message: str, location: str) -> ExportStatus:
    """The status of a finished export from its termination message (``export.json``, compact)."""
    try:
        info = json.loads(message)
        if not isinstance(info, dict):
            raise TypeError(type(info).__name__)
        raw = info.get("versions") or {}
        if not isinstance(raw, dict):
            raise TypeError(f"versions is a {type(raw).__name__}, not an object")
        versions = {str(k): int(v) for k, v in raw.items()}
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
