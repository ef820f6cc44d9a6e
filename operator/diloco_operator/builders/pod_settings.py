"""A pod template with the job's pod settings (``diloco_operator.schema.pod_settings``): the
cluster's priority class, scheduler, extra labels and annotations, service account and image pull
Secrets. The operator's own labels and annotations stay as built (the schema refuses their keys)."""

from __future__ import annotations

from typing import Any

from diloco_operator.schema.pod_settings import PodSettings


def with_pod_settings(template: dict[str, Any], settings: PodSettings) -> dict[str, Any]:
    """``template`` (a PodTemplateSpec: metadata and spec) with ``settings``; nothing is added for
    a setting that is not set, so a job without them builds the same pods as before."""
    meta = template.setdefault("metadata", {})
    if settings.labels:
        meta["labels"] = {**settings.labels, **meta.get("labels", {})}
    if settings.annotations:
        meta["annotations"] = {**settings.annotations, **meta.get("annotations", {})}
    spec = template["spec"]
    for field, value in (
        ("priorityClassName", settings.priority_class_name),
        ("schedulerName", settings.scheduler_name),
        ("serviceAccountName", settings.service_account_name),
    ):
        if value:
            spec[field] = value
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s.name} for s in settings.image_pull_secrets]
    return template
