"""A user model for ``diloco worker --entry-point user_model:build`` (see docs/user-models.md).

A character-level MLP (Bengio et al. 2003): the previous ``--block-size`` bytes, embedded and
concatenated, predict the next byte. The text is the source of the standard library's ``json``
package, so the example needs no download. Run it on its own, without a synchronizer:

    PYTHONPATH=examples diloco worker --standalone --entry-point user_model:build \\
        --block-size 8 --n-embd 64 --batch-size 32 --max-steps 200 --eval-every 50 --log-every 10
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from diloco_worker.entry import TaskContext, TrainingTask
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]
EMBED = 16  # width of one byte's embedding


class CharMLP(nn.Module):
    def __init__(self, context: int, hidden: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, EMBED)
        self.hidden = nn.Linear(context * EMBED, hidden)
        self.out = nn.Linear(hidden, 256)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.hidden(self.emb(x).flatten(1)))
        return self.out(h)  # type: ignore[no-any-return]


def load_text() -> np.ndarray:
    """The bytes of the ``json`` package's source files, in a fixed order."""
    folder = Path(json.__file__).parent
    data = b"".join(p.read_bytes() for p in sorted(folder.glob("*.py")))
    return np.frombuffer(data, dtype=np.uint8)


def windows(data: np.ndarray, starts: np.ndarray, context: int, device: torch.device) -> Batch:
    idx = starts[:, None] + np.arange(context + 1)
    chunk = torch.from_numpy(data[idx].astype(np.int64)).to(device)
    return chunk[:, :-1], chunk[:, -1]  # (inputs [B, context], next byte [B])


def loss_fn(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def build(ctx: TaskContext) -> TrainingTask:
    """Called once per process with the job's settings and this process's data shard."""
    torch.manual_seed(ctx.model.seed)  # every learner starts from the same parameters
    context, batch_size = ctx.model.block_size, ctx.train.batch_size
    text = load_text()
    cut = int(len(text) * (1.0 - ctx.data.eval_fraction))
    train, held_out = text[:cut], text[cut:]
    # shard i of n reads only its own contiguous slice of the training text
    size = len(train) // ctx.shard.count
    mine = train[ctx.shard.index * size : (ctx.shard.index + 1) * size]

    def make_batches(start: int) -> Iterator[Batch]:
        # batch number i is a pure function of (seed, shard, i): a resumed learner that asks for
        # batch ``start`` gets exactly the batch it would have seen had it never stopped; the
        # processes of a unit take turns along the shard's batches (rank r of W takes i*W + r)
        for i in itertools.count(start):
            rng = np.random.default_rng(
                [ctx.model.seed, ctx.shard.index, i * ctx.shard.ranks + ctx.shard.rank]
            )
            starts = rng.integers(0, len(mine) - context - 1, size=batch_size)
            yield windows(mine, starts, context, ctx.device)

    eval_starts = np.linspace(0, len(held_out) - context - 2, num=4 * batch_size).astype(np.int64)
    evals = [windows(held_out, s, context, ctx.device) for s in np.split(eval_starts, 4)]
    return TrainingTask(
        model=CharMLP(context, ctx.model.n_embd),
        loss_fn=loss_fn,
        make_batches=make_batches,
        eval_batches=evals,
        embedding_names=("emb.weight",),
        tokens_of=lambda batch: int(batch[1].numel()),  # one predicted byte per example
    )
