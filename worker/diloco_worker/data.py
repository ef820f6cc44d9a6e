"""The byte-level text pipeline: a corpus from local files or S3, deterministic shards, a resumable cursor.

Batches are drawn by index: batch ``i`` of a shard depends only on (seed, shard, i), so the cursor is a
plain integer and resuming at cursor ``k`` yields exactly the batches a run without a restart would see.
"""

from __future__ import annotations

import functools
import logging
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
Batch = tuple[Tensor, Tensor]

log = logging.getLogger("diloco_worker.data")


class CorpusError(ValueError):
    """The corpus cannot be read or is too small."""


class DataStopped(RuntimeError):
    """The learner was asked to stop while it waited for its data (its next range of the job's stream)."""


@dataclass(frozen=True)
class Shard:
    """Which part of the training data a process reads: shard ``index`` of ``count`` (a learner's, one
    per learner unit), and within it ``rank`` of ``ranks`` (the unit's processes, which take turns
    batch by batch along the shard's sequence); ``key`` seeds it."""

    index: int
    count: int
    key: str
    rank: int = 0
    ranks: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} is outside 0..{self.count - 1}")
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"rank {self.rank} is outside 0..{self.ranks - 1}")

    def seed(self, base_seed: int) -> int:
        return zlib.crc32(f"{base_seed}/{self.index}/{self.count}/{self.key}".encode())


_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def local_files(root: Path) -> Iterator[Path]:
    """Files under ``root`` in a deterministic (sorted, depth-first) order, lazily."""
    if root.is_file():
        yield root
        return
    if not root.is_dir():
        raise CorpusError(f"corpus path {str(root)!r} does not exist")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            yield Path(dirpath, name)


def check_text(name: str, blob: bytes) -> None:
    """A file of a text corpus must be text (UTF-8, no NUL byte): the built-in model reads bytes, and
    a binary file (an Arrow or a tokenized shard in the folder) would be trained on as if it were."""
    if b"\x00" in blob:
        raise CorpusError(f"corpus file {name} is binary (it holds NUL bytes), not text: {_TEXT_ONLY}")
    try:
        blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"corpus file {name} is not UTF-8 text (byte {exc.start}): {_TEXT_ONLY}") from None


_TEXT_ONLY = (
    "the built-in byte-level model trains on text files; move it out of the corpus, or train on "
    "tokenized data through your own entry point (docs/user-models.md)"
)


def _cut(blob: bytes, source: str, max_bytes: int, more: bool) -> bytes:
    """The first ``max_bytes`` of the corpus, saying so when that leaves some of it out."""
    if len(blob) > max_bytes or more:
        log.info(
            "corpus %s: the first %d bytes are used (--corpus-max-bytes); the rest is left out",
            source,
            max_bytes,
        )
    return blob[:max_bytes]


CorpusFile = tuple[str, Callable[[], bytes]]  # a file's name, and how to read it


def _gather(files: Iterable[CorpusFile], source: str, max_bytes: int, *, text: bool) -> bytes:
    """The files' bytes in order up to ``max_bytes`` (whole files read, then cut, saying so); with
    ``text`` each must be text; one that cannot be read is left out with a warning."""
    parts: list[bytes] = []
    total = 0
    for name, read in files:
        if total >= max_bytes:
            return _cut(b"".join(parts), source, max_bytes, more=True)
        try:
            blob = read()
        except OSError as exc:
            log.warning("corpus file %s cannot be read and is left out: %s", name, exc)
            continue
        if text:
            check_text(name, blob)
        parts.append(blob)
        total += len(blob)
    return _cut(b"".join(parts), source, max_bytes, more=False)


def _local(paths: Iterator[Path], suffix: str = "") -> Iterator[CorpusFile]:
    for path in paths:
        if not suffix or path.suffix == suffix:
            yield str(path), path.read_bytes


def s3_listing(url: str) -> tuple[Any, str, list[dict[str, Any]]]:
    """(a client, the bucket, the objects sorted by key, folder markers left out) of ``s3://bucket/prefix``."""
    import boto3  # the worker image has it; imported late so local runs need no AWS set-up

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not bucket:
        raise CorpusError(f"corpus URL {url!r} names no bucket")
    client = boto3.client("s3")
    objects: list[dict[str, Any]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objects.extend(page.get("Contents", []))
    return (
        client,
        bucket,
        sorted((o for o in objects if not str(o["Key"]).endswith("/")), key=lambda o: str(o["Key"])),
    )


def _s3_files(url: str) -> Iterator[CorpusFile]:
    client, bucket, objects = s3_listing(url)
    for obj in objects:
        key = obj["Key"]
        yield f"s3://{bucket}/{key}", functools.partial(_s3_object, client, bucket, key)


def _s3_object(client: Any, bucket: str, key: str) -> bytes:
    body: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


def load_corpus(source: str, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """The corpus as uint8 bytes: ``stdlib`` (this Python's standard library ``.py`` files), a file or
    folder, or ``s3://bucket/prefix``; files are concatenated in sorted order, capped at ``max_bytes``
    (a logged line says when that leaves some out). A file of a folder or prefix that is not text is
    an error (:func:`check_text`); one that cannot be read is left out with a warning."""
    if max_bytes < 1024:
        raise CorpusError(f"max_bytes must be at least 1024, got {max_bytes}")
    if source == "stdlib":
        files = _local(local_files(Path(sysconfig.get_paths()["stdlib"])), ".py")
    elif source.startswith("s3://"):
        files = _s3_files(source)
    else:
        files = _local(local_files(Path(source)))
    blob = _gather(files, source, max_bytes, text=source != "stdlib")
    if len(blob) < 1024:
        raise CorpusError(f"corpus {source!r} holds only {len(blob)} bytes; at least 1024 are needed")
    return np.frombuffer(blob, dtype=np.uint8).copy()


def split_corpus(data: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out): the held-out split is the last ``eval_fraction`` of the bytes."""
    cut = int(len(data) * (1.0 - eval_fraction))
    return data[:cut], data[cut:]


def _windows(data: np.ndarray, starts: np.ndarray, block_size: int, device: torch.device) -> Batch:
    return to_batch(np.stack([data[s : s + block_size + 1] for s in starts]), device)


def to_batch(rows: np.ndarray, device: torch.device) -> Batch:
    """(inputs, targets) on ``device`` from windows of ``block_size + 1`` ids, one per row: the targets
    are the inputs shifted by one."""
    rows = rows.astype(np.int64)
    block_size = rows.shape[1] - 1
    if device.type == "cuda":  # pinned host memory: the copies run without the host waiting for them
        x = torch.empty((len(rows), block_size), dtype=torch.int64, pin_memory=True)
        y = torch.empty((len(rows), block_size), dtype=torch.int64, pin_memory=True)
        x.numpy()[:] = rows[:, :-1]
        y.numpy()[:] = rows[:, 1:]
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    t = torch.from_numpy(rows)
    return t[:, :-1].to(device), t[:, 1:].to(device)


class BatchStream(Iterator[Batch]):
    """Training batches of one shard. iid: window ``j`` of the corpus belongs to shard ``j % count``;
    non-iid: each shard is a contiguous slice. ``cursor`` is the index of the next batch."""

    def __init__(
        self,
        data: np.ndarray,
        shard: Shard,
        *,
        batch_size: int,
        block_size: int,
        seed: int,
        non_iid: bool = False,
        start: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self.data, self.shard, self.batch_size, self.block_size = data, shard, batch_size, block_size
        self.non_iid, self.cursor, self.device = non_iid, start, device or torch.device("cpu")
        self._seed = shard.seed(seed)
        self._stride = max(1, block_size // 2)
        n_windows = (len(data) - block_size - 1) // self._stride
        per_shard = n_windows // shard.count
        if per_shard < 1:
            raise CorpusError(
                f"corpus of {len(data)} bytes is too small for {shard.count} shards of {block_size}"
            )
        self._per_shard = per_shard

    def _starts(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self._seed, i])
        j = rng.integers(0, self._per_shard, size=self.batch_size)
        if self.non_iid:
            return (self.shard.index * self._per_shard + j) * self._stride
        return (j * self.shard.count + self.shard.index) * self._stride

    def __next__(self) -> Batch:
        batch = _windows(self.data, self._starts(self.cursor), self.block_size, self.device)
        self.cursor += 1
        return batch


def eval_batches(
    data: np.ndarray,
    *,
    batch_size: int,
    block_size: int,
    max_batches: int = 4,
    device: torch.device | None = None,
) -> list[Batch]:
    """Fixed, evenly spaced windows of the held-out split (the same for every learner)."""
    last = len(data) - block_size - 1
    if last < 1:
        raise CorpusError(f"held-out split of {len(data)} bytes is shorter than one window of {block_size}")
    starts = np.linspace(0, last, num=batch_size * max_batches).astype(np.int64)
    dev = device or torch.device("cpu")
    return [
        _windows(data, starts[i : i + batch_size], block_size, dev) for i in range(0, len(starts), batch_size)
    ]
