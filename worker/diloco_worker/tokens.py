"""Token data: memory-mapped token files cut into windows, dealt to shards without replacement.

The corpus is one or more flat files of token ids (nanoGPT's ``.bin`` files, or the one file that
:mod:`.token_cache` makes from Parquet, Arrow or tokenized text), memory-mapped, never read whole. Each
file is cut into non-overlapping windows of ``block_size + 1`` tokens (the tail shorter than a window
is not used); window ``w`` has one global index over all files in order. The last ``eval_fraction`` of
the windows are held out: they are never trained on, and the evaluation batches are fixed windows of
them, the same for every learner.

The training windows form one stream for the job: epoch ``e`` is a permutation seeded by (seed, e).
With a synchronizer the stream is dealt to the learner units in ranges (``diloco_core.dealing``,
:class:`DealtWindows`): a unit reads a sequence of its own, the ranges it was dealt one after the
other, so units added, removed or restarted never re-deal a window. Without one (or non-IID), shard
``j`` of ``count`` takes every ``count``-th window of each epoch's permutation (:class:`WindowDeal`).
With one process a unit's batch ``i`` is windows ``[i*B, (i+1)*B)`` of its sequence. The ``R``
processes of a learner unit take turns: rank ``r``'s batch ``i`` is the sequence's batch ``i*R + r``,
so its processes never share a window. The batch index is the data cursor a learner checkpoints, so a
resumed learner trains exactly the windows a learner that never stopped would have.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from diloco_core.config import DataSettings

from .data import CorpusError, Shard, to_batch
from .data_sources import SourceFile, list_files, local_file, one_file, resolve_cache_dir
from .dealing import UnitRanges, range_size
from .token_cache import (
    cache_key,
    cached_tokens,
    load_tokenizer,
    table_chunks,
    text_chunks,
    tokenizer_eos,
)

if TYPE_CHECKING:
    from .entry import TaskContext

log = logging.getLogger("diloco_worker.data")
EVAL_BATCHES = 4
_SAMPLE_CHECKED = 1 << 16  # ids at each end of a file checked against the vocabulary when it is opened


def uses_tokens(data: DataSettings) -> bool:
    """Whether the corpus is token data (this module), rather than the byte-level text of :mod:`.data`."""
    return data.format != "text" or data.tokenizer is not None


class TokenFile:
    """One flat file of token ids, memory-mapped when first read (an S3 object is downloaded then)."""

    def __init__(self, source: SourceFile, dtype: np.dtype, vocab_size: int) -> None:
        if source.size % dtype.itemsize:
            raise CorpusError(
                f"{source.name} is {source.size} bytes, not a whole number of {dtype.name} ids: is "
                f"--token-dtype right? (nanoGPT writes uint16; a vocabulary over 65536 needs uint32)"
            )
        self.source, self.dtype, self.vocab_size = source, dtype, vocab_size
        self.name, self.n_tokens = source.name, source.size // dtype.itemsize
        self._ids: np.memmap | None = None

    def ids(self) -> np.memmap:
        if self._ids is None:
            ids = np.memmap(self.source.local(), dtype=self.dtype, mode="r")
            self.check(0, ids[:_SAMPLE_CHECKED])
            self.check(max(0, len(ids) - _SAMPLE_CHECKED), ids[-_SAMPLE_CHECKED:])
            self._ids = ids
        return self._ids

    def check(self, offset: int, ids: np.ndarray) -> None:
        """An id not below the vocabulary (the model's embedding would fail on it) is an error."""
        if len(ids) and int(ids.max()) >= self.vocab_size:
            at = offset + int(np.argmax(ids >= self.vocab_size))
            raise CorpusError(
                f"{self.name}: token id {int(ids[at - offset])} at token {at} is not below vocab_size "
                f"{self.vocab_size}: set --vocab-size above the largest id (or check --token-dtype)"
            )


class TokenCorpus:
    """Token files cut into windows of ``block_size + 1`` ids, numbered in file order."""

    def __init__(self, files: Sequence[TokenFile], block_size: int, name: str) -> None:
        self.files, self.window, self.name = list(files), block_size + 1, name
        counts = np.array([f.n_tokens // self.window for f in self.files], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.n_windows = int(counts.sum())

    def rows(self, windows: np.ndarray) -> np.ndarray:
        """The windows' ids, one row each (int64), checked against the vocabulary."""
        out = np.empty((len(windows), self.window), dtype=np.int64)
        for row, (w, f) in enumerate(zip(windows, self._file_of(windows), strict=True)):
            start = (int(w) - int(self.starts[f])) * self.window
            ids = self.files[f].ids()[start : start + self.window]
            self.files[f].check(start, ids)
            out[row] = ids
        return out

    def _file_of(self, windows: np.ndarray) -> np.ndarray:
        if len(windows) and (int(np.min(windows)) < 0 or int(np.max(windows)) >= self.n_windows):
            raise IndexError(f"window outside 0..{self.n_windows - 1}")
        return np.searchsorted(self.starts, windows, side="right") - 1


class Split(NamedTuple):
    """Windows ``[0, train)`` are trained on, ``[train, train + held_out)`` held out."""

    train: int
    held_out: int


def split_windows(corpus: TokenCorpus, eval_fraction: float, shards: int) -> Split:
    """The last ``eval_fraction`` of the windows (at least one) are held out; every shard needs at least
    one training window."""
    held_out = max(1, int(corpus.n_windows * eval_fraction))
    train = corpus.n_windows - held_out
    if train < shards:
        raise CorpusError(
            f"corpus {corpus.name!r} holds {corpus.n_windows} windows of {corpus.window} tokens, {held_out} of them "
            f"held out: too few for {shards} shard(s) (one training window each at least): give more data, "
            "a smaller --block-size or fewer learners"
        )
    return Split(train, held_out)


class WindowDeal:
    """Which training window is at each position of a shard's sequence (module docstring). With
    ``non_iid`` a shard owns a contiguous ``1/count`` of the windows, which it permutes each epoch."""

    def __init__(self, train_windows: int, shard: Shard, seed: int, non_iid: bool = False) -> None:
        self.train_windows, self.shard, self.non_iid = train_windows, shard, non_iid
        self.seed = seed % (1 << 64)  # numpy seeds are non-negative
        if non_iid:
            self._low = shard.index * train_windows // shard.count
            self.length = (shard.index + 1) * train_windows // shard.count - self._low
        else:
            self.length = len(range(shard.index, train_windows, shard.count))
        if self.length < 1:
            raise CorpusError(
                f"{train_windows} training windows leave none for shard {shard.index} of {shard.count}"
            )
        self._epochs: dict[int, np.ndarray] = {}

    def epoch(self, e: int) -> np.ndarray:
        """The shard's windows in epoch ``e``, in the order it trains on them."""
        if e not in self._epochs:
            if self.non_iid:
                rng = np.random.default_rng([self.seed, e, self.shard.index])
                order = self._low + rng.permutation(self.length)
            else:
                perm = np.random.default_rng([self.seed, e]).permutation(self.train_windows)
                order = perm[self.shard.index :: self.shard.count].copy()
            self._epochs = {k: v for k, v in self._epochs.items() if k == e - 1}  # the batch may straddle
            self._epochs[e] = order
        return self._epochs[e]

    def windows(self, positions: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(positions, self.length)
        out = np.empty(len(positions), dtype=np.int64)
        for e in np.unique(epochs):
            at = epochs == e
            out[at] = self.epoch(int(e))[offsets[at]]
        return out


class DealtWindows:
    """The windows of a unit whose data the synchronizer deals (``diloco_core.dealing``): position ``p``
    of the unit's sequence is the position the unit's ranges give in the job's stream, whose epoch ``e``
    is the permutation of the training windows that ``WindowDeal`` takes for one shard."""

    def __init__(
        self, train_windows: int, shard: Shard, seed: int, ranges: UnitRanges, batch_size: int
    ) -> None:
        self.train_windows, self.shard, self.ranges = train_windows, shard, ranges
        self.unit_batch = batch_size * shard.ranks
        self.size = range_size(train_windows, self.unit_batch)
        self._whole = WindowDeal(train_windows, Shard(0, 1, shard.key), seed)

    def windows(self, positions: np.ndarray) -> np.ndarray:
        if len(positions) == 0:
            return np.empty(0, dtype=np.int64)
        # the whole unit batch these positions are in: every rank covers the same span at once
        lo = int(positions[0]) // self.unit_batch * self.unit_batch
        hi = (int(positions[-1]) // self.unit_batch + 1) * self.unit_batch
        self.ranges.cover(lo, hi, self.size)
        stream = np.array([self.ranges.stream(int(p)) for p in positions], dtype=np.int64)
        return self._whole.windows(stream)


class SampleLog:
    """``--sample-log``: one JSON line per batch drawn, appended by a single write (processes sharing
    the file never interleave within a line): the process id, shard, batch index, the step it belongs
    to (1-based) and its samples' window ids."""

    def __init__(self, path: str, shard: Shard, grad_accum: int) -> None:
        self.path, self.shard, self.grad_accum = path, shard, grad_accum

    def write(self, batch: int, samples: np.ndarray) -> None:
        line = json.dumps(
            {
                "pid": os.getpid(),
                "shard": self.shard.index,
                "rank": self.shard.rank,
                "batch": batch,
                "step": batch // self.grad_accum + 1,
                "samples": [int(s) for s in samples],
            }
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def make_batch(rows: np.ndarray, device: torch.device, as_dict: bool) -> Any:
    """``(inputs, targets)``, or for a Hugging Face model ``{"input_ids", "labels"}``: the window less
    its last token, and the same ids as labels (the model shifts them itself)."""
    x, y = to_batch(rows, device)
    return {"input_ids": x, "labels": x.clone()} if as_dict else (x, y)


class TokenStream(Iterator[Any]):
    """Training batches of one shard; ``cursor`` is the index of the next batch."""

    def __init__(
        self,
        corpus: TokenCorpus,
        deal: WindowDeal | DealtWindows,
        *,
        batch_size: int,
        start: int = 0,
        device: torch.device | None = None,
        as_dict: bool = False,
        sample_log: SampleLog | None = None,
    ) -> None:
        self.corpus, self.deal, self.batch_size, self.cursor = corpus, deal, batch_size, start
        self.device, self.as_dict, self.sample_log = device or torch.device("cpu"), as_dict, sample_log

    def sample_ids(self, i: int) -> np.ndarray:
        """The global window ids of this process's batch ``i`` (its unit's batch ``i*ranks + rank``)."""
        shard = self.deal.shard
        first = (i * shard.ranks + shard.rank) * self.batch_size
        return self.deal.windows(np.arange(first, first + self.batch_size, dtype=np.int64))

    def __next__(self) -> Any:
        ids = self.sample_ids(self.cursor)
        batch = make_batch(self.corpus.rows(ids), self.device, self.as_dict)
        if self.sample_log is not None:
            self.sample_log.write(self.cursor, ids)
        self.cursor += 1
        return batch


def eval_windows(split: Split, batch_size: int, max_batches: int = EVAL_BATCHES) -> np.ndarray:
    """Evenly spaced held-out windows (all of them if there are fewer), the same for every learner."""
    count = min(batch_size * max_batches, split.held_out)
    return split.train + np.linspace(0, split.held_out - 1, num=count).round().astype(np.int64)


def token_eval_batches(
    corpus: TokenCorpus,
    split: Split,
    *,
    batch_size: int,
    device: torch.device | None = None,
    as_dict: bool = False,
    max_batches: int = EVAL_BATCHES,
) -> list[Any]:
    windows = eval_windows(split, batch_size, max_batches)
    dev = device or torch.device("cpu")
    return [
        make_batch(corpus.rows(windows[i : i + batch_size]), dev, as_dict)
        for i in range(0, len(windows), batch_size)
    ]


def open_token_corpus(data: DataSettings, *, block_size: int, vocab_size: int) -> TokenCorpus:
    """The corpus ``data`` describes as token files: ``.bin`` files as they are, Parquet/Arrow or text
    (with ``data.tokenizer``) through the token cache."""
    if not uses_tokens(data):
        raise CorpusError("a text corpus without --tokenizer is read as bytes (diloco_worker.data)")
    if data.corpus == "stdlib" and data.format != "text":
        raise CorpusError(f"'stdlib' is a text corpus: point --corpus at your {data.format} files")
    cache_dir = resolve_cache_dir(data.cache_dir)
    if data.format == "tokens":
        dtype = np.dtype(data.token_dtype)
        what = "point --corpus at nanoGPT-style .bin files of token ids (a file, a folder or an s3:// prefix)"
        files = [TokenFile(f, dtype, vocab_size) for f in list_files(data.corpus, (".bin",), cache_dir, what)]
        return _opened(TokenCorpus(files, block_size, data.corpus))
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    chunks: Callable[[], Any]
    if data.format == "parquet":
        what = "point --corpus at .parquet or .arrow files (datasets' to_parquet or save_to_disk)"
        sources = list_files(data.corpus, (".parquet", ".arrow"), cache_dir, what)
        key = cache_key(sources, "parquet", data.column, data.eos_token, vocab_size)

        def chunks() -> Any:
            return table_chunks(sources, data.column, data.eos_token)

    else:
        tokenizer_file = one_file(str(data.tokenizer), cache_dir, "point --tokenizer at a tokenizer.json")
        tokenizer = load_tokenizer(tokenizer_file.local(), tokenizer_file.name)
        if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
            raise CorpusError(
                f"tokenizer {tokenizer_file.name} has {tokenizer.get_vocab_size(with_added_tokens=True)} ids but "
                f"vocab_size is {vocab_size}: set --vocab-size to at least that"
            )
        eos = data.eos_token if data.eos_token is not None else tokenizer_eos(tokenizer, tokenizer_file.name)
        sources = list_files(data.corpus, (), cache_dir, "point --corpus at a folder of text files")
        key = cache_key(sources, "text", tokenizer_file.name, tokenizer_file.version, eos, vocab_size)

        def chunks() -> Any:
            return text_chunks(sources, tokenizer, eos)

    path = cached_tokens(cache_dir, key, chunks, dtype, vocab_size, data.corpus)
    return _opened(TokenCorpus([TokenFile(local_file(path), dtype, vocab_size)], block_size, data.corpus))


def _opened(corpus: TokenCorpus) -> TokenCorpus:
    log.info(
        "corpus %s: %d windows of %d tokens in %d file(s)",
        corpus.name,
        corpus.n_windows,
        corpus.window,
        len(corpus.files),
    )
    return corpus


class TokenBatches(NamedTuple):
    make_batches: Callable[[int], TokenStream]
    eval_batches: list[Any]


def token_batches(ctx: TaskContext, *, as_dict: bool = False, vocab_size: int | None = None) -> TokenBatches:
    """The training batches (``make_batches(start)``) and the held-out batches of ``ctx.data`` for
    this process's shard, for an entry point: ``(x, y)`` pairs, or with ``as_dict`` Hugging Face batches
    ``{"input_ids", "labels"}``. Ids must be below ``vocab_size`` (default ``ctx.model.vocab_size``)."""
    vocab = vocab_size if vocab_size is not None else ctx.model.vocab_size
    corpus = open_token_corpus(ctx.data, block_size=ctx.model.block_size, vocab_size=vocab)
    ranges = None if ctx.data.non_iid else ctx.ranges  # a non-IID shard is the unit's own
    split = split_windows(corpus, ctx.data.eval_fraction, 1 if ranges is not None else ctx.shard.count)
    deal: WindowDeal | DealtWindows
    if ranges is not None:
        deal = DealtWindows(split.train, ctx.shard, ctx.model.seed, ranges, ctx.train.batch_size)
    else:
        deal = WindowDeal(split.train, ctx.shard, ctx.model.seed, ctx.data.non_iid)
    sample_log = (
        SampleLog(ctx.data.sample_log, ctx.shard, ctx.train.grad_accum) if ctx.data.sample_log else None
    )
    batch_size, device = ctx.train.batch_size, ctx.device

    def make_batches(start: int) -> TokenStream:
        return TokenStream(
            corpus,
            deal,
            batch_size=batch_size,
            start=start,
            device=device,
            as_dict=as_dict,
            sample_log=sample_log,
        )

    evals = token_eval_batches(corpus, split, batch_size=batch_size, device=device, as_dict=as_dict)
    return TokenBatches(make_batches, evals)
