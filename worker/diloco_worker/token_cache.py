"""Parquet, Arrow and tokenized text turned into one local token file, streamed.

Sampling windows without replacement needs random access to the token stream, which a Parquet or Arrow
file (rows of id lists) or a text file (to be tokenized) does not give. So the corpus is read once, a
record batch (or a text file) at a time, into one flat file of ids in the cache folder, which is then
memory-mapped like a nanoGPT ``.bin`` file. The file's name is a hash of the sources' names and versions
and of the settings that shape it, so a restarted learner, or another process on the same machine,
reuses it; a new version of a source makes a new file.

pyarrow and tokenizers come with the ``data`` extra (``pip install 'diloco-k8s[data]'``); they are
imported only when such a corpus is read.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .data import CorpusError, check_text
from .data_sources import SourceFile, file_key

log = logging.getLogger("diloco_worker.data")
RECORD_BATCH_ROWS = 1024  # rows of a Parquet file read at once
# end-of-text tokens of common tokenizers, looked up when --eos-token is not given
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
_DATA_EXTRA = "install the data extra: pip install 'diloco-k8s[data]'"


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise CorpusError(f"reading this corpus needs the {name} package: {_DATA_EXTRA}") from None


def id_lists(column: Any, eos: int | None, name: str, column_name: str) -> np.ndarray:
    """The ids of a column of id lists (one list per row), concatenated, ``eos`` after each row when set."""
    pa = _import("pyarrow")
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    kind = column.type
    if not (
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    ) or not (pa.types.is_integer(kind.value_type)):
        raise CorpusError(
            f"column {column_name!r} of {name} is {kind}, not lists of integer token ids: name the column of "
            "token ids with --data-column (tokenize the text first, e.g. with datasets' map)"
        )
    values = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
    if eos is None:
        return values
    lengths = _import("pyarrow.compute").list_value_length(column).fill_null(0)
    lengths = np.asarray(lengths.to_numpy(zero_copy_only=False), dtype=np.int64)
    out = np.empty(len(values) + len(lengths), dtype=np.int64)
    ends = np.cumsum(lengths + 1) - 1  # where each row's eos goes
    is_value = np.ones(len(out), dtype=bool)
    is_value[ends] = False
    out[is_value] = values
    out[ends] = eos
    return out


def parquet_chunks(
    path: Path, name: str, column: str, eos: int | None, batch_rows: int = RECORD_BATCH_ROWS
) -> Iterator[np.ndarray]:
    """The ids of a Parquet file, one record batch (at most ``batch_rows`` rows) at a time."""
    pq = _import("pyarrow.parquet")
    try:
        file = pq.ParquetFile(path)
    except Exception as exc:
        raise CorpusError(f"{name} is not a readable Parquet file: {exc}") from None
    if column not in file.schema_arrow.names:
        raise CorpusError(_no_column(name, column, file.schema_arrow.names))
    for batch in file.iter_batches(batch_size=batch_rows, columns=[column]):
        yield id_lists(batch.column(0), eos, name, column)


def arrow_chunks(path: Path, name: str, column: str, eos: int | None) -> Iterator[np.ndarray]:
    """The ids of an Arrow IPC file (the stream format ``datasets.save_to_disk`` writes, or the file
    format), one record batch at a time."""
    pa = _import("pyarrow")
    ipc = _import("pyarrow.ipc")
    with pa.memory_map(str(path)) as source:
        try:
            reader = ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                file_reader = ipc.open_file(source)
            except pa.ArrowInvalid as exc:
                raise CorpusError(f"{name} is not an Arrow IPC stream or file: {exc}") from None
            reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            names = file_reader.schema.names
        else:
            names = reader.schema.names
        if column not in names:
            raise CorpusError(_no_column(name, column, names))
        for batch in reader:
            yield id_lists(batch.column(column), eos, name, column)


def _no_column(name: str, column: str, names: Sequence[str]) -> str:
    return (
        f"{name} has no column {column!r} (it has {', '.join(names)}): name the token ids with --data-column"
    )


def table_chunks(files: Iterable[SourceFile], column: str, eos: int | None) -> Iterator[np.ndarray]:
    """The ids of Parquet (``.parquet``) and Arrow (``.arrow``) files in order, one record batch at a time."""
    for f in files:
        read = arrow_chunks if f.name.endswith(".arrow") else parquet_chunks
        yield from read(f.local(), f.name, column, eos)


def load_tokenizer(path: Path, name: str) -> Any:
    tokenizers = _import("tokenizers")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:
        raise CorpusError(f"{name} is not a tokenizers tokenizer.json: {exc}") from None


def tokenizer_eos(tokenizer: Any, name: str) -> int:
    """The id of the tokenizer's end-of-text token (one of :data:`EOS_NAMES`)."""
    for token in EOS_NAMES:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    raise CorpusError(
        f"tokenizer {name} has none of the end-of-text tokens {', '.join(EOS_NAMES)}: give the id to put "
        "between documents with --eos-token"
    )


def text_chunks(files: Iterable[SourceFile], tokenizer: Any, eos: int) -> Iterator[np.ndarray]:
    """Each text file tokenized (one file in memory at a time), followed by ``eos``."""
    for f in files:
        blob = f.local().read_bytes()
        check_text(f.name, blob)
        ids = tokenizer.encode(blob.decode("utf-8"), add_special_tokens=False).ids
        yield np.asarray([*ids, eos], dtype=np.int64)


def cached_tokens(
    cache_dir: Path,
    key: str,
    chunks: Callable[[], Iterator[np.ndarray]],
    dtype: np.dtype,
    vocab_size: int,
    what: str,
) -> Path:
    """The token file named ``key`` in the cache, written from ``chunks`` unless it is there already
    (written under a temporary name, then renamed). An id not below ``vocab_size`` is an error."""
    path = cache_dir / "tokens" / f"{key}.{dtype.name}"
    if path.is_file():
        log.info("%s: token file %s from the cache", what, path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    total = 0
    try:
        with open(part, "wb") as out:
            for chunk in chunks():
                if len(chunk) and (int(chunk.min()) < 0 or int(chunk.max()) >= vocab_size):
                    bad = int(chunk.max()) if int(chunk.max()) >= vocab_size else int(chunk.min())
                    raise CorpusError(
                        f"{what}: token id {bad} (near token {total + int(np.argmax(chunk == bad))}) is outside "
                        f"0..{vocab_size - 1}: set --vocab-size above the largest id"
                    )
                out.write(chunk.astype(dtype).tobytes())
                total += len(chunk)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    log.info("%s: %d tokens written to %s", what, total, path)
    return path


def cache_key(files: Sequence[SourceFile], *settings: object) -> str:
    return file_key(*(f"{f.name}\0{f.version}" for f in files), *settings)
