"""The job's configuration as its pods read it: the ConfigMap's ``job.json``, ``storage.json`` and
``units.json``, and the hashes that tell a pod its configuration or template changed."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
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

from diloco_operator.builders import env
from diloco_operator.builders.names import UNLIMITED_STEPS, JobRef, config_name, job_id, metadata
from diloco_operator.schema.spec import DiLoCoJobSpec


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
