"""Parquet, Arrow (as the real `datasets` library writes them) and tokenized text, streamed into one token file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pytest
from diloco_core.config import DataSettings
from diloco_worker.data import CorpusError
from diloco_worker.token_cache import arrow_chunks, parquet_chunks
from diloco_worker.tokens import TokenCorpus, open_token_corpus
from tokenizers import Tokenizer, models, pre_tokenizers

EOS = 0


def rows(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 500, int(rng.integers(1, 20))).tolist() for _ in range(n)]


def stream_of(docs: list[list[int]], eos: int | None) -> list[int]:
    return [t for doc in docs for t in [*doc, *([eos] if eos is not None else [])]]


def dataset(docs: list[list[int]]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(len(docs))], "input_ids": docs})


def open_corpus(path: Path, tmp: Path, vocab_size: int = 512, **kw: Any) -> TokenCorpus:
    settings = {"format": "parquet", "cache_dir": str(tmp / "cache")} | kw
    return open_token_corpus(DataSettings(corpus=str(path), **settings), block_size=7, vocab_size=vocab_size)


def all_ids(corpus: TokenCorpus) -> list[int]:
    assert len(corpus.files) == 1
    ids = corpus.files[0].ids()
    assert isinstance(ids, np.memmap)
    return [int(t) for t in ids]


@pytest.mark.parametrize("eos", [EOS, None])
def test_a_datasets_parquet_file_is_read_back_exactly(tmp_path: Path, eos: int | None) -> None:
    docs = rows(300)
    dataset(docs).to_parquet(str(tmp_path / "train.parquet"))
    assert all_ids(open_corpus(tmp_path / "train.parquet", tmp_path, eos_token=eos)) == stream_of(docs, eos)


def test_a_datasets_save_to_disk_folder_of_arrow_shards_is_read_back_exactly(tmp_path: Path) -> None:
    docs = rows(500, seed=1)
    dataset(docs).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    shards = sorted(p.name for p in (tmp_path / "saved").glob("*.arrow"))
    assert len(shards) == 3  # plus dataset_info.json and state.json, which are not data
    assert all_ids(open_corpus(tmp_path / "saved", tmp_path, eos_token=EOS)) == stream_of(docs, EOS)


def test_parquet_is_read_one_record_batch_at_a_time(tmp_path: Path) -> None:
    docs = rows(95)
    dataset(docs).to_parquet(str(tmp_path / "t.parquet"))
    chunks = list(parquet_chunks(tmp_path / "t.parquet", "t.parquet", "input_ids", EOS, batch_rows=10))
    assert len(chunks) == 10  # 9 of 10 rows and one of 5: never more than one record batch at once
    for i, chunk in enumerate(chunks):
        assert chunk.tolist() == stream_of(docs[i * 10 : (i + 1) * 10], EOS)


def test_an_arrow_file_is_read_one_record_batch_at_a_time(tmp_path: Path) -> None:
    docs = rows(2500, seed=2)
    dataset(docs).save_to_disk(str(tmp_path / "saved"))
    (path,) = (tmp_path / "saved").glob("*.arrow")
    with pa.memory_map(str(path)) as source:
        batch_rows = [b.num_rows for b in pa.ipc.open_stream(source)]
    assert len(batch_rows) > 1
    chunks = list(arrow_chunks(path, path.name, "input_ids", None))
    assert [len(c) for c in chunks] == [
        sum(len(d) for d in docs[start : start + n])
        for start, n in zip(np.cumsum([0, *batch_rows]), batch_rows)
    ]


def test_a_missing_or_wrong_column_and_an_empty_folder_are_errors_naming_the_file(tmp_path: Path) -> None:
    dataset(rows(10)).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(
        CorpusError, match=r"t\.parquet has no column 'tokens' \(it has text, input_ids\): name the"
    ):
        open_corpus(tmp_path / "t.parquet", tmp_path, column="tokens")
    with pytest.raises(
        CorpusError, match=r"column 'text' of .*t\.parquet is string, not lists of integer token ids"
    ):
        open_corpus(tmp_path / "t.parquet", tmp_path, column="text")
    dataset(rows(10)).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(CorpusError, match=r"data-00000-of-00001\.arrow has no column 'ids'"):
        open_corpus(tmp_path / "saved", tmp_path, column="ids")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"holds no \*\.parquet or \*\.arrow files"):
        open_corpus(tmp_path / "empty", tmp_path)


def test_an_id_beyond_the_vocabulary_stops_the_conversion(tmp_path: Path) -> None:
    dataset([[1, 2], [3, 900, 4]]).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(
        CorpusError, match=r"token id 900 \(near token 3\) is outside 0\.\.511: set --vocab-size"
    ):
        open_corpus(tmp_path / "t.parquet", tmp_path)
    assert not list((tmp_path / "cache" / "tokens").iterdir())  # nothing half-written is left


def test_the_token_file_is_reused_until_a_source_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dataset(rows(20)).to_parquet(str(tmp_path / "t.parquet"))
    first = open_corpus(tmp_path / "t.parquet", tmp_path).files[0].name
    with caplog.at_level(logging.INFO, logger="diloco_worker.data"):
        again = open_corpus(tmp_path / "t.parquet", tmp_path).files[0].name
    assert again == first
    assert any("from the cache" in r.getMessage() for r in caplog.records)
    docs = rows(25, seed=5)
    dataset(docs).to_parquet(str(tmp_path / "t.parquet"))
    changed = open_corpus(tmp_path / "t.parquet", tmp_path)
    assert changed.files[0].name != first
    assert all_ids(changed) == stream_of(docs, None)


VOCAB = {"[UNK]": 0, "<|endoftext|>": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6, ".": 7}


def write_tokenizer(path: Path, vocab: dict[str, int]) -> Path:
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def text_corpus(tmp: Path) -> Path:
    (tmp / "text" / "sub").mkdir(parents=True)
    (tmp / "text" / "b.txt").write_text("the mat sat.")
    (tmp / "text" / "a.txt").write_text("the cat sat on the mat.\n")
    (tmp / "text" / "sub" / "c.txt").write_text("cat dog")
    return tmp / "text"


def test_a_text_folder_is_tokenized_file_by_file_with_the_tokenizers_end_of_text_between(
    tmp_path: Path,
) -> None:
    tok = write_tokenizer(tmp_path / "tokenizer.json", VOCAB)
    data = DataSettings(
        corpus=str(text_corpus(tmp_path)), tokenizer=str(tok), cache_dir=str(tmp_path / "cache")
    )
    corpus = open_token_corpus(data, block_size=3, vocab_size=8)
    assert all_ids(corpus) == [2, 3, 4, 5, 2, 6, 7, 1, 2, 6, 4, 7, 1, 3, 0, 1]  # a.txt, b.txt, sub/c.txt
    explicit = open_token_corpus(data.model_copy(update={"eos_token": 7}), block_size=3, vocab_size=8)
    assert all_ids(explicit)[7] == 7


def test_tokenizer_errors_say_what_to_set(tmp_path: Path) -> None:
    folder = text_corpus(tmp_path)
    data = DataSettings(
        corpus=str(folder), tokenizer=str(tmp_path / "missing.json"), cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(
        CorpusError, match=r"missing\.json' is not a file: point --tokenizer at a tokenizer\.json"
    ):
        open_token_corpus(data, block_size=3, vocab_size=8)
    no_eos = write_tokenizer(
        tmp_path / "no-eos.json", {k: v for k, v in VOCAB.items() if k != "<|endoftext|>"}
    )
    with pytest.raises(
        CorpusError, match=r"no-eos\.json has none of the end-of-text tokens .*: give the id .* --eos-token"
    ):
        open_token_corpus(data.model_copy(update={"tokenizer": str(no_eos)}), block_size=3, vocab_size=8)
    tok = write_tokenizer(tmp_path / "tokenizer.json", VOCAB)
    with pytest.raises(CorpusError, match="has 8 ids but vocab_size is 6: set --vocab-size to at least that"):
        open_token_corpus(data.model_copy(update={"tokenizer": str(tok)}), block_size=3, vocab_size=6)
