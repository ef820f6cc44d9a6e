"""The worker's configuration: one typed object, parsed once from flags and environment variables.

Every field is a flag and a ``DILOCO_*`` variable of ``diloco worker`` (``diloco_core.flags``), its
description the flag's help; so are the fields of ``model``, ``train`` and ``data`` and the plan's
four fields of ``diloco``. The rest of ``diloco`` comes from ``--job-config`` (the synchronizer tells
a learner the settings it acts on when it registers).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from diloco_core.auth import learner_token
from diloco_core.config import (
    PLAN_FIELDS,
    DataSettings,
    DiLoCoSettings,
    ModelSettings,
    TrackingSettings,
    TrainSettings,
)
from diloco_core.flags import (
    Cli,
    SettingsError,
    add_flags,
    derive_flags,
    option_or_env,
    read,
    read_document,
    validate,
)
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .data import DEFAULT_MAX_BYTES

__all__ = ["FLAGS", "SettingsError", "WhenDone", "WorkerSettings", "build_parser", "parse_settings"]

WhenDone = Literal["exit", "wait"]


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sync_url: str | None = Field(None, description="the synchronizer (shard 0 of a sharded one)")
    sync_ca_file: str | None = Field(
        None,
        description="CA bundle (PEM) that an https synchronizer's certificate must chain to "
        "(default: the public certificate authorities)",
    )
    learner_id: str = Field(
        "learner-0",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="this learner's id (under Kubernetes: the pod name)",
    )
    token: Annotated[str | None, Cli(secret=True)] = Field(
        None, description="the learner token (default: derived from --job-secret)"
    )
    token_file: str | None = Field(
        None,
        description="file holding the learner token, re-read whenever it changes (a mounted Secret "
        "that the operator renews)",
    )
    unit: str = Field("", description="the learner unit this learner belongs to")
    job_id: str = Field(
        "local", min_length=1, max_length=63, description="the training job's id (its experiment in tracking)"
    )
    standalone: bool = Field(False, description="train without a synchronizer")
    diloco: DiLoCoSettings = DiLoCoSettings()
    model: ModelSettings = ModelSettings()
    train: TrainSettings = TrainSettings()
    data: DataSettings = DataSettings()
    tracking: TrackingSettings = TrackingSettings()
    corpus_max_bytes: int = Field(DEFAULT_MAX_BYTES, ge=1024, description="bytes of the corpus read at most")
    learner_index: int = Field(
        0,
        ge=0,
        description="this learner's data shard (its unit's; the unit's processes take turns along it)",
    )
    num_learners: int = Field(1, ge=1, description="number of data shards: the job's learners (units)")
    units_file: str | None = Field(
        None,
        description="the job's learner units, a JSON file {\"units\": [names]} (the operator's): this "
        "learner's data shard is its unit's (--unit) place among them, of as many; read at start-up, it "
        "overrides --learner-index and --num-learners",
    )
    checkpoint_dir: str | None = Field(None, description="a folder or an s3:// prefix for checkpoints")
    eval_every: int = Field(0, ge=0, description="steps between local evaluations; 0: never")
    log_every: int = Field(10, ge=1, description="steps between progress lines")
    speed_factor: float = Field(1.0, ge=1.0, description="> 1 sleeps to emulate slower hardware")
    bandwidth_limit: float = Field(0.0, ge=0.0, description="bytes/s for outgoing fragments; 0: unlimited")
    metrics_file: str | None = Field(None, description="JSON lines of per-step metrics")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    sync_compute: Literal["auto", "numpy", "torch"] = Field(
        "auto",
        description="where a due fragment's outer gradient is computed and quantized: 'torch' on the "
        "learner's device (side CUDA stream, byte-identical payloads), 'numpy' on the host, or 'auto' "
        "(torch on CUDA, numpy otherwise)",
    )
    compile_model: Annotated[bool, Cli("compile")] = Field(
        False, description="run the model through torch.compile (the first step compiles; its time is logged)"
    )
    adamw: Literal["auto", "fused", "foreach", "loop"] = Field(
        "auto",
        description="AdamW implementation: 'fused' (one kernel), 'foreach', 'loop' (per tensor), or 'auto' "
        "(fused on CUDA, loop on a CPU, foreach elsewhere)",
    )
    peak_tflops: float = Field(
        0.0,
        ge=0.0,
        description="the device's peak TFLOP/s that MFU is measured against (0: the bf16 peak of "
        "a known GPU; none on a CPU)",
    )
    anchor_memory: Literal["auto", "device", "host"] = Field(
        "auto",
        description="with the torch path on CUDA: keep the anchors in 'device' memory or in pinned "
        "'host' memory; 'auto' decides from the free device memory and logs the choice",
    )
    poll_wait_s: Annotated[float, Cli("poll-wait")] = Field(
        10.0, gt=0.0, description="seconds a long-poll for new global versions waits"
    )
    shutdown_timeout_s: Annotated[float, Cli("shutdown-timeout")] = Field(
        20.0, gt=0.0, description="seconds an orderly stop may take"
    )
    stop_at_step: int = Field(0, ge=0, description="leave (checkpoint, goodbye) at this step; 0: never")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0: PyTorch's default")
    blocking_sync: bool = Field(
        False, description="wait at every sync until the fragment's next global version is applied"
    )
    partial_contributions: bool = Field(
        True,
        description="answer a round opened by another learner with the partial outer gradient so far "
        "(ignored with blocking_sync)",
    )
    health_port: int | None = Field(None, ge=0, le=65535, description="serve /healthz and /readyz here")
    # the pod's probes come from outside the container
    health_host: str = Field("0.0.0.0", description="address of the health endpoint")
    health_stale_s: Annotated[float, Cli("health-stale-after")] = Field(
        120.0, gt=0.0, description="/healthz fails once the loop is this quiet"
    )
    when_done: WhenDone = Field(
        "exit",
        description="after training to the end: 'exit' (code 0), or 'wait' until stopped (a pod that "
        "must not be restarted, under a StatefulSet)",
    )

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if not self.standalone and not self.sync_url:
            raise ValueError("no synchronizer URL: set --sync-url or DILOCO_SYNC_URL (or pass --standalone)")
        if not self.standalone and not self.token and not self.token_file:
            raise ValueError(
                "no learner token: set --token / DILOCO_TOKEN, --token-file / DILOCO_TOKEN_FILE, or "
                "--job-secret / DILOCO_JOB_SECRET to derive it"
            )
        if self.token and self.token_file:
            raise ValueError("--token and --token-file both given: one of them")
        if self.standalone and self.blocking_sync:
            raise ValueError(
                "--blocking-sync waits for the synchronizer; it cannot be used with --standalone"
            )
        if self.learner_index >= self.num_learners:
            raise ValueError(
                f"learner index {self.learner_index} must be below num_learners {self.num_learners}"
            )
        return self


# of the job's DiLoCo settings, a learner's flags set those its fragment plan depends on
FLAGS = derive_flags(
    WorkerSettings,
    {
        "": None,
        "diloco": PLAN_FIELDS,
        "model": None,
        "train": None,
        "data": None,
        "tracking": None,
    },
)
_JOB_SECTIONS = ("diloco", "model", "train", "data", "tracking")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco worker",
        description="A Decoupled DiLoCo learner. Every flag can also be set as DILOCO_<FLAG> "
        "(upper case, '-' → '_'), e.g. DILOCO_SYNC_URL; a flag wins over its variable, which wins "
        "over --job-config.",
    )
    add_flags(parser, FLAGS)
    parser.add_argument("--job-secret", default=None, help="derive the learner token from the job secret")
    parser.add_argument("--job-config", default=None, help="a JobConfig: JSON text, or a JSON/YAML file path")
    return parser


def parse_settings(argv: Sequence[str], env: Mapping[str, str] | None = None) -> WorkerSettings:
    """Flags win over environment variables, which win over --job-config, which wins over defaults."""
    env = os.environ if env is None else env
    args = build_parser().parse_args(list(argv))
    given = read(FLAGS, args, env)
    job_config = option_or_env(args, env, "job-config")
    job = read_document(job_config, "--job-config / DILOCO_JOB_CONFIG") if job_config else {}
    base: dict[str, Any] = {k: job[k] for k in ("job_id", *_JOB_SECTIONS) if k in job}
    secret = option_or_env(args, env, "job-secret")
    if not given.has(("token",)) and not given.has(("token_file",)) and secret:
        learner = str(given.values.get("learner_id", "learner-0"))
        given.set(("token",), learner_token(str(secret), learner), "--job-secret")
    return validate(WorkerSettings, given, base=base, base_source="--job-config", what="worker settings")


def data_shard(settings: WorkerSettings) -> tuple[int, int]:
    """(index, count) of this learner's data shard: from ``--units-file`` when given, else
    ``--learner-index`` of ``--num-learners``."""
    if settings.units_file is None:
        return settings.learner_index, settings.num_learners
    try:
        units = json.loads(Path(settings.units_file).read_text())["units"]
        if not isinstance(units, list) or not all(isinstance(u, str) for u in units):
            raise TypeError("units is not a list of names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SettingsError(
            f"--units-file {settings.units_file}: cannot read the job's units: {exc}"
        ) from None
    if settings.unit not in units:
        raise SettingsError(
            f"--units-file {settings.units_file}: unit {settings.unit!r} (--unit) is not among the job's units "
            f"{units}"
        )
    return units.index(settings.unit), len(units)
