"""The worker's configuration: one typed object, parsed once from flags and environment variables."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from diloco_core.auth import learner_token
from diloco_core.config import DataSettings, FragmentStrategy, ModelSettings, TrainSettings
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .data import DEFAULT_MAX_BYTES


class SettingsError(ValueError):
    """A setting is missing or invalid; the message says which and how to set it."""


class PlanSettings(BaseModel):
    """What the fragment plan needs before registering; must match the synchronizer's job."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    inner_steps: int = Field(32, ge=1)
    fragments: int = Field(4, ge=1)
    overlap: int = Field(2, ge=0)
    strategy: FragmentStrategy = "balanced"


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sync_url: str | None = None
    learner_id: str = Field(
        "learner-0", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
    )
    token: str | None = None
    unit: str = ""
    standalone: bool = False
    plan: PlanSettings = PlanSettings()
    model: ModelSettings = ModelSettings()
    train: TrainSettings = TrainSettings()
    data: DataSettings = DataSettings()
    corpus_max_bytes: int = Field(DEFAULT_MAX_BYTES, ge=1024)
    learner_index: int = Field(0, ge=0)
    num_learners: int = Field(1, ge=1)
    checkpoint_dir: str | None = None
    checkpoint_every: int = Field(0, ge=0, description="0: only on SIGTERM and at the end")
    eval_every: int = Field(0, ge=0)
    log_every: int = Field(10, ge=1)
    speed_factor: float = Field(1.0, ge=1.0, description="> 1 sleeps to emulate slower hardware")
    bandwidth_limit: float = Field(0.0, ge=0.0, description="bytes/s for outgoing fragments; 0: unlimited")
    metrics_file: str | None = None
    device: str = "auto"
    poll_wait_s: float = Field(10.0, gt=0.0)
    shutdown_timeout_s: float = Field(20.0, gt=0.0)
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
    health_host: str = "0.0.0.0"  # the pod's probes come from outside the container
    health_stale_s: float = Field(120.0, gt=0.0, description="/healthz fails once the loop is this quiet")

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if not self.standalone and not self.sync_url:
            raise ValueError("no synchronizer URL: set --sync-url or DILOCO_SYNC_URL (or pass --standalone)")
        if not self.standalone and not self.token:
            raise ValueError(
                "no learner token: set --token / DILOCO_TOKEN, or --job-secret / DILOCO_JOB_SECRET to derive it"
            )
        if self.standalone and self.blocking_sync:
            raise ValueError(
                "--blocking-sync waits for the synchronizer; it cannot be used with --standalone"
            )
        if self.learner_index >= self.num_learners:
            raise ValueError(
                f"learner index {self.learner_index} must be below num_learners {self.num_learners}"
            )
        if self.plan.overlap >= self.plan.inner_steps:
            raise ValueError(
                f"overlap ({self.plan.overlap}) must be smaller than inner_steps ({self.plan.inner_steps})"
            )
        return self


# flag → (section, field, type); the environment variable is DILOCO_<FLAG in upper case>
_FLAGS: dict[str, tuple[str | None, str, type]] = {
    "sync-url": (None, "sync_url", str),
    "learner-id": (None, "learner_id", str),
    "token": (None, "token", str),
    "unit": (None, "unit", str),
    "learner-index": (None, "learner_index", int),
    "num-learners": (None, "num_learners", int),
    "checkpoint-dir": (None, "checkpoint_dir", str),
    "checkpoint-every": (None, "checkpoint_every", int),
    "eval-every": (None, "eval_every", int),
    "log-every": (None, "log_every", int),
    "speed-factor": (None, "speed_factor", float),
    "bandwidth-limit": (None, "bandwidth_limit", float),
    "metrics-file": (None, "metrics_file", str),
    "device": (None, "device", str),
    "corpus-max-bytes": (None, "corpus_max_bytes", int),
    "poll-wait": (None, "poll_wait_s", float),
    "shutdown-timeout": (None, "shutdown_timeout_s", float),
    "threads": (None, "threads", int),
    "stop-at-step": (None, "stop_at_step", int),
    "health-port": (None, "health_port", int),
    "health-host": (None, "health_host", str),
    "health-stale-after": (None, "health_stale_s", float),
    "inner-steps": ("plan", "inner_steps", int),
    "fragments": ("plan", "fragments", int),
    "overlap": ("plan", "overlap", int),
    "fragment-strategy": ("plan", "strategy", str),
    "entry-point": ("model", "entry_point", str),
    "n-layer": ("model", "n_layer", int),
    "n-head": ("model", "n_head", int),
    "n-embd": ("model", "n_embd", int),
    "block-size": ("model", "block_size", int),
    "seed": ("model", "seed", int),
    "batch-size": ("train", "batch_size", int),
    "grad-accum": ("train", "grad_accum", int),
    "lr": ("train", "lr", float),
    "warmup-steps": ("train", "warmup_steps", int),
    "max-steps": ("train", "max_steps", int),
    "weight-decay": ("train", "weight_decay", float),
    "grad-clip": ("train", "grad_clip", float),
    "corpus": ("data", "corpus", str),
    "eval-fraction": ("data", "eval_fraction", float),
}


_HELP: dict[str, str] = {
    "entry-point": "what to train: 'builtin' (the byte-level GPT) or 'package.module:function', a "
    "function that receives a TaskContext and returns a TrainingTask or (model, loss_fn, "
    "make_batches); the module must be importable (installed or on PYTHONPATH). See docs/user-models.md",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco worker",
        description="A Decoupled DiLoCo learner. Every flag can also be set as DILOCO_<FLAG> "
        "(upper case, '-' → '_'), e.g. DILOCO_SYNC_URL.",
    )
    for flag, (_, _, typ) in _FLAGS.items():
        parser.add_argument(f"--{flag}", type=typ, default=None, help=_HELP.get(flag))
    parser.add_argument("--job-secret", default=None, help="derive the learner token from the job secret")
    parser.add_argument("--job-config", default=None, help="a JobConfig: JSON text, or a JSON/YAML file path")
    parser.add_argument(
        "--standalone", action="store_true", default=None, help="train without a synchronizer"
    )
    parser.add_argument("--non-iid", action="store_true", default=None)
    parser.add_argument(
        "--blocking-sync",
        action="store_true",
        default=None,
        help="synchronous DiLoCo: after sending a fragment, wait until its next global version is "
        "applied before the next inner step (the wait counts as blocked time)",
    )
    parser.add_argument(
        "--no-partial-contributions",
        dest="partial_contributions",
        action="store_false",
        default=None,
        help="send a fragment only after its own H steps, never when the synchronizer opens a round "
        "(DILOCO_PARTIAL_CONTRIBUTIONS=0)",
    )
    return parser


def _job_config(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        if raw.lstrip().startswith("{"):
            cfg = json.loads(raw)
        else:
            path = Path(raw.removeprefix("@"))
            text = path.read_text()
            cfg = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise SettingsError(f"cannot read --job-config / DILOCO_JOB_CONFIG: {exc}") from exc
    if not isinstance(cfg, dict):
        raise SettingsError("--job-config must be a JSON object (a JobConfig)")
    out: dict[str, Any] = {k: dict(cfg[k]) for k in ("model", "train", "data") if k in cfg}
    if "diloco" in cfg:
        d = cfg["diloco"]
        out["plan"] = {k: d[k] for k in ("inner_steps", "fragments", "overlap") if k in d}
        if "fragment_strategy" in d:
            out["plan"]["strategy"] = d["fragment_strategy"]
    return out


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _env_bool(flag: str, text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    env = "DILOCO_" + flag.replace("-", "_").upper()
    raise SettingsError(f"{env}={text!r}: expected one of {', '.join(_TRUE + _FALSE[:-1])}")


def parse_settings(argv: Sequence[str], env: Mapping[str, str] | None = None) -> WorkerSettings:
    """Flags win over environment variables, which win over --job-config, which wins over defaults."""
    env = os.environ if env is None else env
    args = vars(build_parser().parse_args(list(argv)))

    def value(flag: str) -> Any:
        v = args.get(flag.replace("-", "_"))
        return v if v is not None else env.get("DILOCO_" + flag.replace("-", "_").upper())

    raw: dict[str, Any] = _job_config(value("job-config"))
    for flag, (section, name, _) in _FLAGS.items():
        v = value(flag)
        if v is not None:
            (raw.setdefault(section, {}) if section else raw)[name] = v
    booleans = (
        ("standalone", None, "standalone"),
        ("non-iid", "data", "non_iid"),
        ("blocking-sync", None, "blocking_sync"),
        ("partial-contributions", None, "partial_contributions"),
    )
    for flag, section, name in booleans:
        v = value(flag)
        if v is not None:
            flag_on = v if isinstance(v, bool) else _env_bool(flag, str(v))
            (raw.setdefault(section, {}) if section else raw)[name] = flag_on
    secret = value("job-secret")
    if not raw.get("token") and secret:
        raw["token"] = learner_token(str(secret), str(raw.get("learner_id", "learner-0")))
    try:
        return WorkerSettings.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise SettingsError(f"invalid worker settings: {problems}") from None
