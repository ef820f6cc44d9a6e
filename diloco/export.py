"""``diloco export``: take the trained global model out of a job's storage.

Reads every fragment at the version its shard's manifest commits (``diloco_core.global_model``; the job
may still be running) and writes, in ``--out`` (a folder, or an ``s3://bucket/prefix`` or ``file://``
URL the files are stored under):

- ``model.safetensors``: every parameter of the model, float32, under the model's own names;
- ``export.json``: the job, the version of each fragment, the rounds merged, and (with
  ``--evaluate``) the held-out loss.

With ``--entry-point`` (``builtin``, the default, or ``package.module:function``) and the job's model
settings, the tensors are loaded into the model the learners train, which must take every one of
them: a check that the export is that model. A model with ``save_pretrained`` (Hugging Face) is
also written there as ``hf/``, which ``from_pretrained`` loads. ``--evaluate`` gives the held-out
loss of the exported model on the task's held-out batches (for ``builtin``: the corpus, its
held-out fraction and the batch size the job's learners use).

The job's settings come from ``-f job.yaml`` (its ``DiLoCoJob`` manifest) or ``--job-config`` (the
``JobConfig`` its pods read, which is how the operator's export Job runs it); flags win over both.
``--summary-file`` writes ``export.json`` compactly to one more place: the operator's export Job
points it at the container's termination message, where the job's status reads it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from diloco_core.config import DataSettings, ModelSettings, TrainSettings
from diloco_core.flags import SettingsError, add_flags, derive_flags, read, read_document, validate
from diloco_core.storage import StorageError, open_store
from pydantic import BaseModel, Field


class ExportSettings(BaseModel):
    storage: str = Field(description="the job's storage: a folder, file:///path or s3://bucket/prefix")
    out: str = Field(
        description="a folder to write (created; files in it are replaced), or an s3:// or file:// URL"
    )
    job_id: str | None = Field(None, description="refuse the storage unless it holds this job")
    evaluate: bool = Field(False, description="compute the exported model's held-out loss")
    load: bool = Field(True, description="load the tensors into the model built by --entry-point (a check)")
    model: ModelSettings = ModelSettings()
    data: DataSettings = DataSettings()
    train: TrainSettings = TrainSettings()
    corpus_max_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="bytes of the corpus read at most")
    summary_file: Path | None = Field(None, description="also write export.json here, compact (one line)")


FLAGS = derive_flags(
    ExportSettings,
    {
        "": None,
        "model": ("entry_point", "n_layer", "n_head", "n_embd", "block_size", "seed", "vocab_size"),
        "data": (
            "corpus",
            "eval_fraction",
            "format",
            "token_dtype",
            "column",
            "eos_token",
            "tokenizer",
            "cache_dir",
        ),
        "train": ("batch_size",),
    },
)


def parse_settings(argv: list[str]) -> ExportSettings:
    p = argparse.ArgumentParser(
        prog="diloco export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flags(p, FLAGS)
    p.add_argument(
        "-f",
        "--file",
        type=Path,
        default=None,
        metavar="JOB_YAML",
        help="the job's DiLoCoJob manifest: its storage, job id, model and data settings (flags win over it)",
    )
    p.add_argument(
        "--job-config",
        default=None,
        metavar="JOB_CONFIG",
        help="the JobConfig the job's pods read (JSON text or a JSON/YAML file): its job id, model, "
        "data and precision (flags win over it)",
    )
    a = p.parse_args(argv)
    base: dict[str, Any] | None = None
    source = f"-f {a.file}"
    if a.file is not None and a.job_config is not None:
        raise SettingsError("give -f or --job-config, not both")
    if a.job_config is not None:
        job = read_document(a.job_config, "--job-config")
        source = "--job-config"
        base = {k: job[k] for k in ("job_id", "model", "data") if k in job}
        if "precision" in (job.get("train") or {}):
            base["train"] = {"precision": job["train"]["precision"]}
    if a.file is not None:
        from diloco_operator.builders.export import eval_batch_size

        from diloco.job_file import read_manifest

        manifest = read_manifest(a.file)
        spec = manifest.spec
        base = {
            "storage": spec.storage.url, "job_id": manifest.job_id,
            "model": spec.model.model_dump(exclude_unset=True), "data": spec.data.model_dump(exclude_unset=True),
            # the held-out batches diloco run evaluates on, in the job's precision
            "train": {"batch_size": eval_batch_size(spec), "precision": spec.train.precision},
        }  # fmt: skip
    return validate(ExportSettings, read(FLAGS, a, {}), base=base, base_source=source, what="export settings")


def write_model(s: ExportSettings) -> dict[str, Any]:
    """Write the export; returns what ``export.json`` says."""
    import torch
    from diloco_core.global_model import read_global_model
    from safetensors.torch import save_file

    url = s.storage
    if "://" not in url or url.startswith("file://"):  # a folder: read, never created here
        folder = Path(url.removeprefix("file://"))
        if not folder.is_dir():
            raise SettingsError(f"--storage {s.storage}: no such folder")
        url = folder.resolve().as_uri()
    g = read_global_model(open_store(url), s.job_id)
    tensors = {name: torch.from_numpy(a.copy()) for name, a in sorted(g.tensors.items())}
    info: dict[str, Any] = {
        "job_id": g.job_id, "versions": {str(p): v for p, v in sorted(g.versions.items())}, "rounds": g.rounds,
        "plan_hash": g.plan.hash(), "parameters": int(sum(t.numel() for t in tensors.values())),
        "entry_point": s.model.entry_point,
    }  # fmt: skip
    model = _into_model(s, tensors) if s.load or s.evaluate else None
    with _output_folder(s.out) as folder:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"job_id": g.job_id})
        if model is not None:
            info.update(_finish(folder, s, *model))
        info["location"] = s.out
        (folder / "export.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    if s.summary_file is not None:
        s.summary_file.write_text(json.dumps(info, sort_keys=True, separators=(",", ":")) + "\n")
    return info


@contextmanager
def _output_folder(out: str) -> Iterator[Path]:
    """The folder to write the export in: ``out`` itself, or a temporary one whose files are stored
    under the URL ``out`` when the export is complete (``export.json`` last, so that its presence
    means the rest is there)."""
    if not out.startswith(("s3://", "file://")):
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="diloco-export-") as tmp:
        folder = Path(tmp)
        yield folder
        store = open_store(out)
        files = sorted((f for f in folder.rglob("*") if f.is_file()), key=lambda f: f.name == "export.json")
        for f in files:
            store.put(f.relative_to(folder).as_posix(), f.read_bytes())


def _into_model(s: ExportSettings, tensors: dict[str, Any]) -> tuple[Any, Any]:
    """The job's model (and its task) holding the exported tensors; refuses tensors it does not take."""
    import torch
    from diloco_worker.data import Shard
    from diloco_worker.entry import TaskContext, load_task

    device = torch.device("cpu")
    ctx = TaskContext(s.model, s.data, s.train, Shard(0, 1, "export"), device, s.corpus_max_bytes)
    task = load_task(ctx)
    model = task.model
    own = dict(model.named_parameters())
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or extra:
        parts = ([f"the export has {extra[:5]}, which it lacks"] if extra else []) + (
            [f"it has {missing[:5]}, which the export lacks"] if missing else []
        )
        raise SettingsError(
            f"the model {s.model.entry_point!r} builds with these settings is not the job's: "
            f"{'; '.join(parts)} (give the job's model settings)"
        )
    with torch.no_grad():
        for name, param in own.items():
            if tuple(param.shape) != tuple(tensors[name].shape):
                raise SettingsError(
                    f"tensor {name!r}: the export holds {tuple(tensors[name].shape)}, the model "
                    f"{tuple(param.shape)} (give the job's model settings)"
                )
            param.copy_(tensors[name])
    return model, task


def _finish(folder: Path, s: ExportSettings, model: Any, task: Any) -> dict[str, Any]:
    """The Hugging Face folder where the model has ``save_pretrained``; the held-out loss if asked."""
    import torch
    from diloco_worker.train import evaluate

    out: dict[str, Any] = {}
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(str(folder / "hf"))
        out["hf"] = "hf"
    if s.evaluate:
        loss = evaluate(model, task, torch.device("cpu"), s.train.precision)
        if loss is None:
            raise SettingsError(f"the task of {s.model.entry_point!r} has no held-out batches to evaluate on")
        out["held_out_loss"] = loss
    return out


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv)
    except SettingsError as exc:
        print(f"diloco export: {exc}", file=sys.stderr)
        return 2
    from diloco_core.global_model import ExportError

    try:
        info = write_model(settings)
    except (ExportError, SettingsError, StorageError) as exc:
        print(f"diloco export: {exc}", file=sys.stderr)
        return 1
    versions = ", ".join(f"{p}: v{v}" for p, v in info["versions"].items())
    print(
        f"exported job {info['job_id']!r}: {info['parameters']:,} parameters, fragments at {versions}, "
        f"{info['rounds']} rounds merged -> {settings.out}"
    )
    if "held_out_loss" in info:
        print(f"held-out loss: {info['held_out_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
