"""The inner training loop: AdamW, warmup + cosine, clipping, accumulation, bf16 autocast on CUDA."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from diloco_core.config import TrainSettings
from torch import nn

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StepHook(Protocol):
    """What the loop calls at every step boundary (the DiLoCo side, or nothing)."""

    def at_boundary(self, state: LoopState, step_tokens: int, stop: bool, step_time: float) -> bool:
        """Apply arrived global fragments, send due ones; returns the unit-wide stop decision."""
        ...


def lr_at(step: int, cfg: TrainSettings) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return float(cfg.lr * (step + 1) / cfg.warmup_steps)
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return float(floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, cfg: TrainSettings) -> torch.optim.AdamW:
    """AdamW; no weight decay on biases, norms and other 1-d tensors."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, task: TrainingTask, device: torch.device) -> float | None:
    """Mean loss over the task's held-out batches."""
    if not task.eval_batches:
        return None
    was_training = model.training
    model.eval()
    losses = []
    with autocast_for(device):
        losses = [float(task.loss_fn(model, b)) for b in task.eval_batches]
    model.train(was_training)
    return sum(losses) / len(losses)


def _emit(
    state: LoopState, loss: float, step_time: float, step_tokens: int, metrics: MetricsLog | None
) -> None:
    tps = step_tokens / step_time if step_time > 0 else 0.0
    log.info("step=%d loss=%.4f tokens/s=%.0f step_time=%.3fs", state.step, loss, tps, step_time)
    if metrics:
        metrics.write(
            step=state.step,
            loss=loss,
            tokens=state.tokens,
            tokens_per_s=tps,
            step_time_s=step_time,
            blocked_s=state.blocked_s,
            eval_loss=state.eval_loss,
        )


def train(
    task: TrainingTask,
    optimizer: torch.optim.Optimizer,
    cfg: TrainSettings,
    state: LoopState,
    *,
    unit: Unit,
    stop: threading.Event,
    hook: StepHook | None = None,
    save: Callable[[LoopState], None] | None = None,
    checkpoint_every: int = 0,
    eval_every: int = 0,
    log_every: int = 10,
    speed_factor: float = 1.0,
    metrics: MetricsLog | None = None,
    stop_at_step: int = 0,
    health: Health | None = None,
) -> LoopState:
    """Train until ``cfg.max_steps``, a stop request or ``stop_at_step``; a stop finishes the current step
    first. The learning-rate schedule always spans ``cfg.max_steps``."""
    model = unit.wrap(task.model)
    model.train()
    batches: Iterator[Any] = task.make_batches(state.cursor)
    params: Sequence[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
    while state.step < cfg.max_steps:
        if health:
            health.beat("training")
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state.step, cfg)
        loss_sum, step_tokens = 0.0, 0
        for micro in range(cfg.grad_accum):
            batch = next(batches)
            state.cursor += 1
            with unit.no_sync(model, skip=micro < cfg.grad_accum - 1), autocast_for(unit.device):
                loss = task.loss_fn(model, batch) / cfg.grad_accum
            loss.backward()
            loss_sum += float(loss.detach())
            step_tokens += task.tokens_of(batch) * unit.world_size
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens += step_tokens
        if speed_factor > 1.0:  # emulate slower hardware
            time.sleep((speed_factor - 1.0) * (time.perf_counter() - t0))
        step_time = time.perf_counter() - t0
        asked = stop.is_set() or (stop_at_step > 0 and state.step >= stop_at_step)
        stopping = hook.at_boundary(state, step_tokens, asked, step_time) if hook else asked
        if eval_every and state.step % eval_every == 0:
            state.eval_loss = evaluate(task.model, task, unit.device)
        if state.step % log_every == 0 or stopping or state.step >= cfg.max_steps:
            _emit(state, loss_sum, step_time, step_tokens, metrics)
        at_end = stopping or state.step >= cfg.max_steps
        if save and ((checkpoint_every and state.step % checkpoint_every == 0) or at_end):
            save(state)
        if stopping:
            log.info("step=%d stopping on request", state.step)
            break
    return state
