"""The user entry point: ``package.module:function`` builds what a learner trains.

The function receives a :class:`TaskContext` and returns a :class:`TrainingTask` (or the tuple
``(model, loss_fn, make_batches)``). ``make_batches(start)`` returns an iterator over training batches
that begins at batch number ``start`` of this process's shard — the data cursor is that plain integer,
so a resumed learner continues exactly where it stopped. ``loss_fn(model, batch)`` returns a scalar
loss. The built-in GPT (:func:`builtin_task`) uses the same interface.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diloco_core.config import DataSettings, ModelSettings, TrainSettings
from torch import Tensor, nn

from .data import (
    DEFAULT_MAX_BYTES,
    BatchStream,
    CorpusError,
    Shard,
    eval_batches,
    load_corpus,
    split_corpus,
)
from .dealing import UnitRanges
from .model import EMBEDDING_NAMES, build_gpt, lm_loss
from .tokens import token_batches, uses_tokens

LossFn = Callable[[nn.Module, Any], Tensor]


class EntryPointError(ValueError):
    """The entry point cannot be imported or returned something unusable."""


@dataclass(frozen=True)
class TaskContext:
    model: ModelSettings
    data: DataSettings
    train: TrainSettings
    shard: Shard
    device: torch.device
    corpus_max_bytes: int = DEFAULT_MAX_BYTES
    # the unit's ranges of the job's data when the synchronizer deals them (``diloco_worker.dealing``);
    # None without a synchronizer: the shard is then the unit's own part of every epoch
    ranges: UnitRanges | None = None


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: the element count of its inputs: the first tensor of a tuple or list, the
    ``input_ids`` of a dict (a Hugging Face batch; else its first value), or the batch itself."""
    if isinstance(batch, Mapping):
        if not batch:
            raise TypeError("an empty dict batch holds no tokens")
        first = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))
    else:
        first = batch[0] if isinstance(batch, tuple | list) else batch
    if not hasattr(first, "numel"):
        raise TypeError(
            f"cannot count the tokens of a batch whose inputs are {type(first).__name__}: give the task "
            "a tokens_of(batch) function"
        )
    return int(first.numel())


@dataclass
class TrainingTask:
    model: nn.Module
    loss_fn: LossFn
    make_batches: Callable[[int], Iterator[Any]]
    eval_batches: Sequence[Any] = ()
    embedding_names: Collection[str] = ()
    tokens_of: Callable[[Any], int] = field(default=count_tokens)


def builtin_task(ctx: TaskContext) -> TrainingTask:
    """The built-in GPT on the configured corpus: token data (:mod:`.tokens`), or text as bytes."""
    if uses_tokens(ctx.data):
        tokens = token_batches(ctx)
        return TrainingTask(
            build_gpt(ctx.model), lm_loss, tokens.make_batches, tokens.eval_batches, EMBEDDING_NAMES
        )
    if ctx.model.vocab_size < 256:
        raise CorpusError(f"the byte-level text corpus needs vocab_size 256 (it is {ctx.model.vocab_size})")
    if ctx.data.sample_log:
        raise CorpusError(
            "--sample-log needs token data: the byte-level text corpus draws windows at random, with "
            "replacement, which have no sample ids"
        )
    train_bytes, held_out = split_corpus(
        load_corpus(ctx.data.corpus, ctx.corpus_max_bytes), ctx.data.eval_fraction
    )

    def make_batches(start: int) -> Iterator[Any]:
        return BatchStream(
            train_bytes,
            ctx.shard,
            batch_size=ctx.train.batch_size,
            block_size=ctx.model.block_size,
            seed=ctx.model.seed,
            non_iid=ctx.data.non_iid,
            start=start,
            device=ctx.device,
        )

    evals = eval_batches(
        held_out, batch_size=ctx.train.batch_size, block_size=ctx.model.block_size, device=ctx.device
    )
    return TrainingTask(build_gpt(ctx.model), lm_loss, make_batches, evals, EMBEDDING_NAMES)


def _resolve(entry_point: str) -> Callable[[TaskContext], Any]:
    if entry_point == "builtin":
        return builtin_task
    module_name, sep, attr = entry_point.partition(":")
    if not sep or not module_name or not attr:
        raise EntryPointError(f"entry point {entry_point!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntryPointError(
            f"cannot import module {module_name!r} of entry point {entry_point!r}: {exc}"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise EntryPointError(f"module {module_name!r} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def load_task(ctx: TaskContext) -> TrainingTask:
    """Build the task named by ``ctx.model.entry_point``."""
    result = _resolve(ctx.model.entry_point)(ctx)
    if isinstance(result, TrainingTask):
        return result
    if isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], nn.Module):
        return TrainingTask(result[0], result[1], result[2])
    raise EntryPointError(
        f"entry point {ctx.model.entry_point!r} returned {type(result).__name__}; expected a TrainingTask "
        "or a tuple (model, loss_fn, make_batches)"
    )
