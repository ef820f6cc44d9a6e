"""``diloco run -f job.yaml``: the ``DiLoCoJob`` manifest that ``kubectl apply`` takes, as a local run (pure).

The spec is parsed and checked by the operator's own model (``diloco_operator.schema.spec``), so a file
that the operator would refuse is refused here with the same message. Each learner unit becomes one
learner process (a unit of N pods: one process with N x its batch size, the unit's tokens per step);
the model, data, inner optimisation, DiLoCo settings and tracking are the spec's; the step budget is
each learner's ``max_steps``, the token budget the run's; chaos runs only when ``spec.chaos.enabled``.
The synchronizer's memory budgets (``synchronizer.memory``, or the shares of its memory limit) are
its local process's, as the operator gives them to its pod. What only a cluster has (images,
storage, the synchronizer's pods, scheduling, pod additions) is named in a note, never silently
dropped: the run's state lives in the run folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_core.flags import SettingsError
from diloco_operator.schema.spec import DiLoCoJobSpec

from diloco.job_file import Manifest, parse_manifest, read_manifest

# spec fields a local run has no use for, and why (named in a note when the file sets them)
CLUSTER_ONLY: dict[str, str] = {
    "images": "learners and the synchronizer run from this Python",
    "storage": "the run folder holds the job's state",
    "learners": "pod env and volumes are for pods",
    "suspend": "a local run starts at once",
    "unitLostAfterSeconds": "no pods to lose",
    "export": "the export Job runs on a cluster; diloco export -f takes the model out of a local run",
}
UNIT_CLUSTER_ONLY = ("gpus", "resources", "nodeSelector", "affinity", "tolerations", "region", "tokenGeneration",
                     "tokensPerStep", "minStepTimeSeconds", "env", "volumes", "volumeMounts")  # fmt: skip


@dataclass(frozen=True)
class JobFile:
    """What a job file says of a local run: settings (``RunSettings``' shape), per-learner batch sizes,
    the units' names (learner ``i`` is unit ``units[i]``), and notes on what it leaves out."""

    name: str
    job_id: str
    base: dict[str, Any]
    batch_sizes: tuple[int, ...]
    units: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)


def read_job_file(path: Path) -> JobFile:
    return _job_file(read_manifest(path), str(path))


def job_file_settings(doc: Any, source: str) -> JobFile:
    return _job_file(parse_manifest(doc, source), source)


def _job_file(manifest: Manifest, source: str) -> JobFile:
    spec = manifest.spec
    units = [u for u in spec.learner_units if u.replicas > 0]
    if not units:
        raise SettingsError(f"-f {source}: every learner unit has 0 replicas: nothing would train")
    return JobFile(
        name=manifest.name,
        job_id=manifest.job_id,
        base=_settings(spec, len(units)),
        batch_sizes=tuple(u.batch_size * u.replicas for u in units),
        units=tuple(u.name for u in units),
        notes=tuple(_notes(spec, manifest.raw)),
    )


def _set(section: Any) -> dict[str, Any]:
    """The fields a section of the spec sets (the run's own defaults stand for the rest)."""
    return dict(section.model_dump(exclude_unset=True))


def _settings(spec: DiLoCoJobSpec, learners: int) -> dict[str, Any]:
    diloco = _set(spec.diloco)
    train = _set(spec.train)
    compile_model = bool(train.pop("compile", False))
    out: dict[str, Any] = {
        "learners": learners,
        "model": _set(spec.model),
        "data": _set(spec.data),
        "train": train,
        "tracking": _set(spec.tracking),
        "compile_model": compile_model,
    }
    if "delayed_nesterov" in diloco:  # the run's own setting (its default depends on the learners)
        out["delayed_nesterov"] = diloco.pop("delayed_nesterov")
    out["diloco"] = diloco
    if spec.budget.steps is not None:
        out["train"] = {**out["train"], "max_steps": spec.budget.steps}
    if spec.budget.tokens is not None:
        out["token_budget"] = spec.budget.tokens
    out["sync_memory"] = spec.synchronizer.memory_budgets.settings()  # as the operator gives them to its pod
    if spec.chaos.enabled:
        out["mtbf_s"], out["repair_s"] = spec.chaos.mtbf_seconds, spec.chaos.repair_seconds
    else:
        out["mtbf_s"] = 0.0
    return out


def _notes(spec: DiLoCoJobSpec, raw: dict[str, Any]) -> list[str]:
    notes = [
        f"spec.{key} is not used by a local run: {why}" for key, why in CLUSTER_ONLY.items() if key in raw
    ]
    sync_fields = sorted(k for k in raw.get("synchronizer", {}) if k != "memory")
    if sync_fields:
        notes.append(
            f"spec.synchronizer.{{{', '.join(sync_fields)}}} are not used by a local run: one local synchronizer "
            "process (its memory budgets are: synchronizer.memory and the shares of a memory limit)"
        )
    for unit in spec.learner_units:
        if unit.replicas == 0:
            notes.append(f"unit {unit.name}: 0 replicas, left out")
        elif unit.replicas > 1:
            notes.append(
                f"unit {unit.name}: its {unit.replicas} pods run as one process of {unit.replicas} x "
                f"{unit.batch_size} sequences per step (the unit's tokens per step)"
            )
    unit_fields = sorted({k for u in raw.get("learnerUnits", []) for k in u if k in UNIT_CLUSTER_ONLY})
    if unit_fields:
        notes.append(f"spec.learnerUnits[].{{{', '.join(unit_fields)}}} are not used by a local run: no pods")
    if spec.chaos.units:
        notes.append("spec.chaos.units is not used by a local run: chaos may stop any learner")
    if spec.budget.steps is None:
        notes.append("spec.budget.steps is not set: each learner trains the run's default --max-steps")
    return notes
