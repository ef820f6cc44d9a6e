"""The runner's typed settings, parsed once from the command line (pure parsing helpers here).

The algorithm, the model and the learners' inner optimisation are the core's own settings
(``diloco_core.config``), with this command's defaults; the flags derive from the fields
(``diloco.runner.cli``), and the child processes get them back as flags (``diloco.runner.commands``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from diloco_core.config import DataSettings, DiLoCoSettings, ModelSettings, TrackingSettings, TrainSettings
from diloco_core.flags import Cli, SettingsError
from pydantic import BaseModel, ConfigDict, Field

from diloco.failures import FailureModel, failure_model_for

Mode = Literal["decoupled", "diloco-sync", "ddp"]
MODES: tuple[Mode, ...] = ("decoupled", "diloco-sync", "ddp")
Device = Literal["cpu", "cuda"]
# the default model on a GPU: GPT-2 small's shape over bytes (12 layers x 768, context 1024), batch 16;
# on CPUs shared by several learners it is the tiny one of RunSettings.model
GPU_MODEL: dict[str, int] = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
GPU_BATCH_SIZE = 16
# learners are declared dead quickly: a local run's chaos kills and restarts them within seconds
HEARTBEAT_TIMEOUT_S = 6.0

__all__ = ["MODES", "Mode", "RunSettings", "SettingsError", "build_algorithm", "resolve_gpus"]


class SyncMemory(BaseModel):
    """The local synchronizer's memory budgets in bytes, by its settings' names (None: its default);
    set from a job file's ``synchronizer.memory`` and memory limit, as the operator sets its pod's."""

    model_config = ConfigDict(extra="forbid")

    round_memory_bytes: int | None = Field(None, ge=0)
    served_in_memory_bytes: int | None = Field(None, ge=0)
    memory_budget_bytes: int | None = Field(None, ge=0)
    pending_memory_bytes: int | None = Field(None, ge=0)

    def settings(self) -> dict[str, int]:
        return {name: size for name, size in self.model_dump().items() if size is not None}


class RunSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field(
        "decoupled",
        description="decoupled (K=1, grace, overlap), diloco-sync (K=all, no overlap) or ddp (data-parallel every step)",
    )
    learners: int = Field(4, ge=1, description="learner processes")
    token_budget: int | None = Field(
        None, ge=1, description="stop once all learners processed this many tokens"
    )
    time_limit_s: Annotated[float, Cli("time-limit")] = Field(
        900.0, gt=0.0, description="stop after this many seconds"
    )
    diloco: DiLoCoSettings = DiLoCoSettings(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    delayed_nesterov: int | None = Field(
        None,
        ge=0,
        description="apply the outer momentum every N merges, 0 for plain Nesterov (default: the number of "
        "learners in decoupled mode, 0 otherwise)",
    )
    model: ModelSettings = ModelSettings(n_layer=2, n_head=4, n_embd=64, block_size=64)
    # warm-up: a tenth of the run, at most 20 steps (set from max_steps by the command line)
    train: TrainSettings = TrainSettings(batch_size=8, max_steps=300, warmup_steps=20)
    data: DataSettings = DataSettings()
    # TensorBoard's event files go to the run folder's tensorboard/ unless --tensorboard says elsewhere
    tracking: TrackingSettings = TrackingSettings()
    eval_every: int = Field(25, ge=0, description="learners' local evaluation interval in steps")
    mtbf_s: Annotated[float, Cli("mtbf")] = Field(
        60.0,
        ge=0.0,
        description="mean seconds between failures of each learner while it is up (Poisson); 0 disables failures",
    )
    repair_s: Annotated[float, Cli("repair")] = Field(
        8.0, ge=0.0, description="seconds a failed learner stays down before it is started again"
    )
    speed_factors: tuple[float, ...] = ()  # step-time multiplier per learner (--speed-factors, --slow)
    batch_sizes: tuple[int, ...] = ()  # sequences per micro-batch per learner (a job file's units)
    sync_memory: SyncMemory = SyncMemory()  # the synchronizer's memory budgets (a job file's)
    job_file: str | None = None  # the DiLoCoJob manifest the run was made from (-f)
    job_id: str | None = None  # the job's id: the manifest's name with -f (default: run-<folder>)
    compile_model: Annotated[bool, Cli("compile")] = Field(
        False, description="learners run their model through torch.compile"
    )
    bandwidth_limits: tuple[float | None, ...] = ()  # bytes/s per learner (--bandwidth-limit)
    runs_dir: Path = Field(Path("runs"), description="parent of the run folder")
    storage_url: Annotated[str | None, Cli("storage")] = Field(
        None, description="file:///path or s3://bucket/prefix (default: the run folder)"
    )
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="synchronizer port (default: a free one)")
    poll_interval_s: float = 0.5
    stop_timeout_s: float = 15.0
    plain: bool = Field(False, description="plain progress lines even on a terminal")
    device: Device = Field(
        "cpu",
        description="cpu, or cuda: learners on this machine's GPUs, each process seeing its own (round robin: "
        "more learners than GPUs share them), a GPU-sized default model (12 x 768, context 1024, batch 16)",
    )
    gpus: tuple[int, ...] = Field(
        (), description="with --device cuda: the GPUs to use, e.g. 0,1 (default: all)"
    )
    python: str = ""

    def batch_size_of(self, learner: int) -> int:
        return self.batch_sizes[learner] if self.batch_sizes else self.train.batch_size

    def tokens_per_step_of(self, learner: int) -> int:
        return int(self.batch_size_of(learner) * self.train.grad_accum * self.model.block_size)

    @property
    def tokens_per_step(self) -> int:
        """A learner's tokens per step (the mean over learners when their batch sizes differ)."""
        return sum(self.tokens_per_step_of(i) for i in range(self.learners)) // max(1, self.learners)

    @property
    def blocking_sync(self) -> bool:
        """Learners wait for each round's result before stepping on (every mode but decoupled)."""
        return self.mode != "decoupled"

    def speed_of(self, learner: int) -> float:
        return self.speed_factors[learner] if self.speed_factors else 1.0

    def bandwidth_of(self, learner: int) -> float | None:
        return self.bandwidth_limits[learner] if self.bandwidth_limits else None

    def gpu_of(self, learner: int) -> int | None:
        """The GPU (an index among the runner's visible ones) of a learner: round robin, so with more
        learners than GPUs some share one; None on the CPU."""
        return self.gpus[learner % len(self.gpus)] if self.device == "cuda" and self.gpus else None

    def algorithm(self) -> DiLoCoSettings:
        return build_algorithm(self)

    @property
    def failures(self) -> FailureModel:
        """The failure model of this run (shared with ``diloco simulate run``)."""
        return failure_model_for(
            self.mode,
            learners=self.learners,
            mtbf_s=self.mtbf_s,
            repair_s=self.repair_s,
            seed=self.model.seed,
        )


def build_algorithm(s: RunSettings) -> DiLoCoSettings:
    """The synchronizer's settings for a mode: decoupled (K=1, grace, overlap), diloco-sync (K=all,
    no overlap, blocking) or ddp (every step, full precision, blocking).

    Decoupled mode uses Delayed Nesterov with N = the number of learners unless told otherwise:
    with K = 1 each learner's outer gradient is usually merged on its own, so plain Nesterov applies
    the momentum M times per "round" of M learners, which amplifies the step (Async Local-SGD, Liu et
    al. 2024); on the default run plain Nesterov's held-out loss went up and down between
    evaluations and ended near 3.4, Delayed Nesterov's fell steadily to about 2.6.
    """
    if s.mode == "decoupled":
        delayed = s.learners if s.delayed_nesterov is None else s.delayed_nesterov
        return s.diloco.model_copy(update={"delayed_nesterov": delayed})  # K: 1 unless a job file says
    if s.mode == "diloco-sync":
        return s.diloco.model_copy(
            update={"overlap": 0, "quorum": s.learners, "delayed_nesterov": s.delayed_nesterov or 0}
        )
    # one unit (one learner to the synchronizer) whose ranks average gradients every step; the
    # synchronizer only keeps the global copy (and the checkpoint of record): its outer step is a copy
    return s.diloco.model_copy(
        update={
            "inner_steps": 1,
            "fragments": 1,
            "overlap": 0,
            "quorum": 1,
            "codec": "fp32",
            "error_feedback": False,
            "down_codec": "fp32",
            "outer_lr": 1.0,
            "outer_warmup": 0,
            "outer_momentum": 0.0,
            "delayed_nesterov": 0,
            "merge_rule": "mean",
        }
    )


def resolve_gpus(s: RunSettings, visible: int) -> tuple[int, ...]:
    """The GPUs a run uses: those asked for (indices among the ``visible`` ones) or all of them;
    refuses what cannot work."""
    if s.device != "cuda":
        if s.gpus:
            raise SettingsError("--gpus needs --device cuda")
        return ()
    if visible < 1:
        raise SettingsError("--device cuda: PyTorch sees no CUDA device on this machine (use --device cpu)")
    gpus = s.gpus or tuple(range(visible))
    if any(not 0 <= g < visible for g in gpus) or len(set(gpus)) != len(gpus):
        raise SettingsError(
            f"--gpus {','.join(map(str, gpus))}: each index once, among the {visible} visible GPUs (0..{visible - 1})"
        )
    if s.mode == "ddp" and s.learners > len(gpus):
        raise SettingsError(
            f"--mode ddp on GPUs runs one rank per GPU (NCCL cannot share one between ranks): "
            f"{s.learners} learners need {s.learners} GPUs, {len(gpus)} given"
        )
    return gpus


def parse_speed_factors(text: str, learners: int) -> tuple[float, ...]:
    """``1,1,1.18,1.18`` (one step-time multiplier per learner) → a tuple of ``learners`` factors."""
    try:
        factors = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise SettingsError(f"--speed-factors: expected comma-separated numbers, got {text!r}") from None
    if len(factors) != learners:
        raise SettingsError(f"--speed-factors: got {len(factors)} factors for {learners} learners")
    if any(f <= 0 for f in factors):
        raise SettingsError(f"--speed-factors: every factor must be > 0, got {text!r}")
    return factors


def parse_slow(text: str, learners: int) -> tuple[float, ...]:
    """``FRACTION:FACTOR`` (e.g. ``0.5:1.18``): the last ``round(FRACTION x learners)`` learners step
    ``FACTOR`` times slower, the others at full speed."""
    try:
        fraction_text, factor_text = text.split(":")
        fraction, factor = float(fraction_text), float(factor_text)
    except ValueError:
        raise SettingsError(f"--slow: expected FRACTION:FACTOR such as 0.5:1.18, got {text!r}") from None
    if not 0.0 <= fraction <= 1.0 or factor <= 0:
        raise SettingsError(f"--slow: FRACTION must be in [0, 1] and FACTOR > 0, got {text!r}")
    slow = round(fraction * learners)
    return tuple([1.0] * (learners - slow) + [factor] * slow)


_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 1024.0, "mi": 1024.0**2, "gi": 1024.0**3}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(k|m|g|ki|mi|gi)?b?(?:/s)?\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """``500k``, ``2M``, ``1MiB``, ``64kB/s`` or ``123456`` (bytes per second) → bytes per second."""
    match = _RATE.match(text)
    if match is None:
        raise SettingsError(f"bandwidth {text!r}: expected bytes per second such as 500k, 2M or 1MiB")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value <= 0:
        raise SettingsError(f"bandwidth {text!r}: must be > 0")
    return value


def parse_bandwidth(text: str, learners: int) -> tuple[float | None, ...]:
    """One rate for every learner (``1M``) or one per learner (``1M,-,-,200k``; ``-`` = unlimited)."""
    parts = text.split(",")
    if len(parts) == 1:
        return (parse_rate(parts[0]),) * learners
    if len(parts) != learners:
        raise SettingsError(f"--bandwidth-limit: got {len(parts)} rates for {learners} learners")
    return tuple(None if p.strip() in ("-", "") else parse_rate(p) for p in parts)
