"""What every method of the in-process experiments trains: the built-in byte-level GPT, its data
shards and held-out batches, and one inner step (the worker's AdamW schedule and clipping)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from diloco_core.config import ModelSettings, TrainSettings
from diloco_worker.data import BatchStream, Shard, eval_batches, load_corpus, split_corpus
from diloco_worker.model import lm_loss
from diloco_worker.train import autocast_for, lr_at
from torch import nn

Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class Workload:
    """The model, the data and the inner optimisation (the same for every method)."""

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 20
    corpus: str = "stdlib"
    corpus_bytes: int = 2_000_000
    eval_batches: int = 8
    device: str = "cpu"  # where every learner and the data-parallel model train (bf16 autocast on CUDA)


def model_settings(w: Workload, seed: int) -> ModelSettings:
    return ModelSettings(
        n_layer=w.n_layer, n_head=w.n_head, n_embd=w.n_embd, block_size=w.block_size, seed=seed
    )


def train_settings(w: Workload, steps: int) -> TrainSettings:
    return TrainSettings(
        batch_size=w.batch_size, lr=w.lr, warmup_steps=w.warmup_steps, max_steps=max(steps, 1)
    )


class Corpus:
    """The byte corpus loaded once and split into training bytes and held-out batches."""

    def __init__(self, w: Workload) -> None:
        train, held = split_corpus(load_corpus(w.corpus, w.corpus_bytes), 0.02)
        self.train = train
        self.held_out = eval_batches(
            held,
            batch_size=16,
            block_size=w.block_size,
            max_batches=w.eval_batches,
            device=torch.device(w.device),
        )

    def stream(
        self, w: Workload, m: int, count: int, seed: int, batch_size: int | None = None
    ) -> BatchStream:
        return BatchStream(
            self.train,
            Shard(m, count, "bench"),
            batch_size=batch_size or w.batch_size,
            block_size=w.block_size,
            seed=seed,
            device=torch.device(w.device),
        )


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with autocast_for(batches[0][0].device):
        loss = statistics.fmean(float(lm_loss(model, b)) for b in batches)
    model.train()
    return loss


def to_numpy(model: nn.Module) -> Arrays:
    return {n: p.detach().cpu().float().numpy().copy() for n, p in model.named_parameters()}


@torch.no_grad()
def load_params(model: nn.Module, values: Arrays) -> None:
    params = dict(model.named_parameters())
    for name, v in values.items():
        params[name].copy_(torch.from_numpy(np.asarray(v, dtype=np.float32)))


def inner_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    step: int,
    cfg: TrainSettings,
) -> None:
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    with autocast_for(batch[0].device):
        loss = lm_loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()


def step_time(rng: np.random.Generator, factor: float, noise: float) -> float:
    """Virtual seconds of one inner step: ``factor x (1 + noise x N(0, 1))``, at least half of ``factor``."""
    return factor * max(0.5, 1.0 + noise * float(rng.standard_normal())) if noise else factor
