"""The inner training loop: AdamW, warm-up + cosine (or wsd, or constant), clipping, accumulation,
autocast (``precision``: bf16 on CUDA by default; fp16 with a gradient scaler).

On CUDA the loop never waits for the device within a step: the loss is summed on the device and
read only at logged steps, batches come from pinned memory with non-blocking copies, AdamW is fused.
The host therefore runs ahead of the device and a single step's wall time means little there; step
times and tokens/s are the means over the steps since the previous logged step instead (on a CPU
each step is measured on its own, as before). ``compile`` runs the model through ``torch.compile``;
the first step (which compiles) is timed and logged.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import torch
from diloco_core.config import Precision, TrainSettings
from diloco_core.progress import describe_duration
from torch import Tensor, nn

from .adamw import AdamW
from .data import DataStopped
from .distributed import Unit
from .entry import TrainingTask
from .health import Health
from .metrics import MetricsLog

log = logging.getLogger("diloco_worker.train")


@dataclass
class LoopState:
    """The plain-number part of a learner's progress (stored in checkpoints)."""

    step: int = 0
    tokens: int = 0  # tokens of the whole unit
    cursor: int = 0  # micro-batches this process has consumed
    blocked_s: float = 0.0
    eval_loss: float | None = None
    grad_scaler: dict[str, Any] | None = None  # fp16's loss scale (GradScaler.state_dict()), as of the save

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StepHook(Protocol):
    """What the loop calls at every step boundary (the DiLoCo side, or nothing)."""

    def at_boundary(self, state: LoopState, step_tokens: int, stop: bool, step_time: float) -> bool:
        """Apply arrived global fragments, send due ones; returns the unit-wide stop decision."""
        ...


def lr_at(step: int, cfg: TrainSettings) -> float:
    """Linear warm-up to ``lr``, then ``cfg.lr_schedule``: ``cosine`` decays to ``lr * min_lr_ratio``
    at ``max_steps``; ``wsd`` stays at ``lr`` until the last ``decay_fraction`` of ``max_steps`` (rounded
    to whole steps, at least one, never into the warm-up), then falls linearly to ``lr * min_lr_ratio``
    at ``max_steps``; ``constant`` stays at ``lr``."""
    if step < cfg.warmup_steps:
        return float(cfg.lr * (step + 1) / cfg.warmup_steps)
    if cfg.lr_schedule == "constant":
        return float(cfg.lr)
    if cfg.lr_schedule == "wsd":
        return _wsd_decay(step, cfg)
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return float(floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress)))


def _wsd_decay(step: int, cfg: TrainSettings) -> float:
    """After the warm-up: the stable phase at ``lr``, then the linear decay (:func:`lr_at`)."""
    start = max(cfg.warmup_steps, cfg.max_steps - max(1, round(cfg.decay_fraction * cfg.max_steps)))
    if step < start:
        return float(cfg.lr)
    progress = min(1.0, (step - start) / max(1, cfg.max_steps - start))
    return float(cfg.lr - (cfg.lr - cfg.lr * cfg.min_lr_ratio) * progress)


AdamWImpl = Literal["auto", "fused", "foreach", "loop"]


def adamw_impl(device: torch.device, wanted: AdamWImpl = "auto") -> Literal["fused", "foreach", "loop"]:
    """``auto``: one fused kernel on CUDA; on a CPU the per-tensor loop the learner has always used
    (its numbers stay exactly what they were); ``foreach`` (one kernel per operation over all
    tensors) on any other device."""
    if wanted != "auto":
        return wanted
    return "fused" if device.type == "cuda" else "loop" if device.type == "cpu" else "foreach"


def make_optimizer(model: nn.Module, cfg: TrainSettings, impl: AdamWImpl = "auto") -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases, norms and other 1-d tensors."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    first = next(iter(decay + no_decay), None)
    chosen = adamw_impl(first.device if first is not None else torch.device("cpu"), impl)
    if chosen == "loop":  # torch's single-tensor update without its start-up cost (see .adamw)
        return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=chosen == "fused" or None,
        foreach=chosen == "foreach",
    )


def autocast_dtype(device: torch.device, precision: Precision = "auto") -> torch.dtype | None:
    """The dtype of the autocast regions; None: no autocast (float32). ``auto``: bf16 on CUDA, none
    elsewhere."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def autocast_for(
    device: torch.device, precision: Precision = "auto"
) -> contextlib.AbstractContextManager[Any]:
    dtype = autocast_dtype(device, precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def make_grad_scaler(
    device: torch.device, precision: Precision, state: Mapping[str, Any] | None = None
) -> torch.amp.GradScaler | None:
    """fp16's gradient (loss) scaler, from a checkpoint's ``state`` when there is one; None for the
    other precisions (bf16 has float32's range and needs none)."""
    if precision != "fp16":
        return None
    scaler = torch.amp.GradScaler(device.type)
    if state:
        scaler.load_state_dict(dict(state))
    return scaler


def _clip_and_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[nn.Parameter],
    cfg: TrainSettings,
    scaler: torch.amp.GradScaler | None,
) -> torch.Tensor | None:
    """Clip the gradients and step; returns their norm before clipping (on the device), None without
    clipping. With a scaler the gradients are unscaled first, so clipping sees their true norm, and a
    step whose gradients are not finite is skipped while the scale backs off (torch's GradScaler)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else None
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@torch.no_grad()
def evaluate(
    model: nn.Module, task: TrainingTask, device: torch.device, precision: Precision = "auto"
) -> float | None:
    """Mean loss over the task's held-out batches (in the training's precision)."""
    if not task.eval_batches:
        return None
    was_training = model.training
    model.eval()
    losses = []
    with autocast_for(device, precision):
        losses = [float(task.loss_fn(model, b)) for b in task.eval_batches]
    model.train(was_training)
    return sum(losses) / len(losses)


class StepClock:
    """Step times as reported to heartbeats and logs. ``per_step``: each step's own wall time (a
    CPU); otherwise the mean over the window since the previous logged step, once there is one."""

    def __init__(self, per_step: bool, state: LoopState) -> None:
        self.per_step = per_step
        self._mark = (time.perf_counter(), state.step, state.tokens)
        self.window_step_time: float | None = None
        self.window_tokens_per_s: float | None = None

    def step_time(self, measured: float) -> float:
        if self.per_step or self.window_step_time is None:
            return measured
        return self.window_step_time

    def close_window(self, state: LoopState) -> None:
        """At a logged step, after reading the loss (the host has waited for the device)."""
        now, (t0, step0, tokens0) = time.perf_counter(), self._mark
        if state.step > step0 and now > t0:
            self.window_step_time = (now - t0) / (state.step - step0)
            self.window_tokens_per_s = (state.tokens - tokens0) / (now - t0)
        self._mark = (now, state.step, state.tokens)


def _emit(
    state: LoopState,
    loss: float,
    step_time: float,
    step_tokens: int,
    metrics: MetricsLog | None,
    clock: StepClock | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
    lr: float | None = None,
    grad_norm: float | None = None,
    steps_left: int = 0,
) -> None:
    tps = step_tokens / step_time if step_time > 0 else 0.0
    if clock is not None and not clock.per_step and clock.window_tokens_per_s is not None:
        tps = clock.window_tokens_per_s
        step_time = clock.window_step_time or step_time
    mfu = tps * flops_per_token / peak_flops if flops_per_token and peak_flops else None
    eta_s = steps_left * step_time
    log.info(
        "step=%d loss=%.4f tokens/s=%.0f step_time=%.3fs%s eta=%s",
        state.step,
        loss,
        tps,
        step_time,
        f" mfu={100 * mfu:.1f}%" if mfu is not None else "",
        describe_duration(eta_s),
    )
    if metrics:
        metrics.write(
            step=state.step,
            loss=loss,
            tokens=state.tokens,
            tokens_per_s=tps,
            step_time_s=step_time,
            blocked_s=state.blocked_s,
            eval_loss=state.eval_loss,
            eta_s=eta_s,
            **({"mfu": mfu} if mfu is not None else {}),
            **({"lr": lr} if lr is not None else {}),
            **({"grad_norm": grad_norm} if grad_norm is not None and math.isfinite(grad_norm) else {}),
        )


def _accumulate(
    task: TrainingTask,
    model: nn.Module,
    batches: Iterator[Any],
    cfg: TrainSettings,
    state: LoopState,
    unit: Unit,
    scaler: torch.amp.GradScaler | None,
) -> tuple[Tensor, int]:
    """One step's forward and backward passes over its ``grad_accum`` batches: the step's loss (kept
    on the device) and tokens. A ``DataStopped`` while a batch is awaited leaves the cursor at the step's
    first batch, so that a checkpoint taken then resumes the step whole."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=unit.device)
    step_tokens, first = 0, state.cursor
    for micro in range(cfg.grad_accum):
        try:
            batch = next(batches)
        except DataStopped:
            state.cursor = first
            raise
        state.cursor += 1
        with unit.no_sync(model, skip=micro < cfg.grad_accum - 1), autocast_for(unit.device, cfg.precision):
            loss = task.loss_fn(model, batch) / cfg.grad_accum
        (loss if scaler is None else scaler.scale(loss)).backward()
        loss_sum += loss.detach()
        step_tokens += task.tokens_of(batch) * unit.world_size
    return loss_sum, step_tokens


@dataclass(frozen=True)
class LoopOptions:
    """How the loop runs: checkpoints, evaluations and log lines every so many steps (0: never, but
    at the end for checkpoints), an emulated slowdown, an early stop, ``torch.compile``, and the model's
    FLOPs per token with the device's peak (both known: logged steps carry the MFU)."""

    checkpoint_every: int = 0
    eval_every: int = 0
    log_every: int = 10
    speed_factor: float = 1.0
    stop_at_step: int = 0
    compile_model: bool = False
    flops_per_token: float | None = None
    peak_flops: float | None = None


@dataclass(frozen=True)
class LoopHooks:
    """What the loop calls: the session at each step boundary (``hook``), the checkpoint writer
    (``save(state, at_end)``), the metrics log and the health probe's beat."""

    hook: StepHook | None = None
    save: Callable[[LoopState, bool], None] | None = None
    metrics: MetricsLog | None = None
    health: Health | None = None


def train(
    task: TrainingTask,
    optimizer: torch.optim.Optimizer,
    cfg: TrainSettings,
    state: LoopState,
    *,
    unit: Unit,
    stop: threading.Event,
    options: LoopOptions = LoopOptions(),  # noqa: B008 - frozen
    hooks: LoopHooks = LoopHooks(),  # noqa: B008 - frozen
) -> LoopState:
    """Train until ``cfg.max_steps``, a stop request or ``options.stop_at_step``; a stop finishes the
    current step first. The learning-rate schedule always spans ``cfg.max_steps``."""
    o, h = options, hooks
    model = unit.wrap(task.model)
    if o.compile_model:
        model = torch.compile(model)  # type: ignore[assignment]
    model.train()
    batches: Iterator[Any] = task.make_batches(state.cursor)
    params: Sequence[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
    on_cuda = unit.device.type == "cuda"
    scaler = make_grad_scaler(unit.device, cfg.precision, state.grad_scaler)
    clock = StepClock(per_step=not on_cuda, state=state)
    first_logged = state.step + 1  # logged in every process: its record carries the start-up figures
    while state.step < cfg.max_steps:
        if h.health:
            h.health.beat("training")
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state.step, cfg)
        try:
            loss_sum, step_tokens = _accumulate(task, model, batches, cfg, state, unit, scaler)
        except DataStopped:  # asked to stop while waiting for data: the step is not taken
            log.info("step=%d stopping on request while waiting for data", state.step)
            if h.save:
                h.save(state, True)
            break
        # the norm before clipping, on the device until a logged step reads it
        grad_norm = _clip_and_step(optimizer, params, cfg, scaler)
        state.step += 1
        state.tokens += step_tokens
        step_time = _step_time(t0, unit, o, first=state.step == first_logged)
        asked = stop.is_set() or (o.stop_at_step > 0 and state.step >= o.stop_at_step)
        stopping = (
            h.hook.at_boundary(state, step_tokens, asked, clock.step_time(step_time)) if h.hook else asked
        )
        if o.eval_every and state.step % o.eval_every == 0:
            state.eval_loss = evaluate(task.model, task, unit.device, cfg.precision)
        at_end = stopping or state.step >= cfg.max_steps
        if state.step % o.log_every == 0 or at_end or state.step == first_logged:
            loss_value = float(loss_sum)  # waits for the device: the window closes after the work
            clock.close_window(state)
            if h.metrics is not None and unit.distributed:  # the unit's all-reduce, this rank's side
                h.metrics.set(allreduce_bytes=unit.collective.ring_bytes(unit.world_size))
            _emit(
                state,
                loss_value,
                step_time,
                step_tokens,
                h.metrics,
                clock,
                o.flops_per_token,
                o.peak_flops,
                lr=lr_at(state.step - 1, cfg),
                grad_norm=float(grad_norm) if grad_norm is not None else None,
                steps_left=cfg.max_steps - state.step,
            )
        if h.save and ((o.checkpoint_every and state.step % o.checkpoint_every == 0) or at_end):
            if scaler is not None:
                state.grad_scaler = scaler.state_dict()
            h.save(state, at_end)
        if stopping:
            log.info("step=%d stopping on request", state.step)
            break
    return state


def _step_time(t0: float, unit: Unit, options: LoopOptions, *, first: bool) -> float:
    """The step's time since ``t0``, after the emulated slowdown (``speed_factor``); the first step of a
    compiled model says how long it took (compilation included)."""
    on_cuda = unit.device.type == "cuda"
    if options.speed_factor > 1.0:  # emulate slower hardware
        if on_cuda:
            torch.cuda.synchronize(unit.device)  # the step's device time, not the time to queue it
        time.sleep((options.speed_factor - 1.0) * (time.perf_counter() - t0))
    if first and options.compile_model:
        if on_cuda:
            torch.cuda.synchronize(unit.device)
        log.info("torch.compile: the first step took %.1f s (compilation included)", time.perf_counter() - t0)
    return time.perf_counter() - t0
