from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from diloco_worker.data import BatchStream, CorpusError, Shard, eval_batches, load_corpus, split_corpus


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    return load_corpus("stdlib", 200_000)


def stream(data: np.ndarray, shard: Shard, start: int = 0, non_iid: bool = False) -> BatchStream:
    return BatchStream(data, shard, batch_size=4, block_size=16, seed=0, start=start, non_iid=non_iid)


def test_stdlib_corpus_is_python_source(corpus: np.ndarray) -> None:
    assert corpus.dtype == np.uint8
    assert len(corpus) == 200_000
    text = bytes(corpus[:50_000]).decode("utf-8", errors="replace")
    assert "def " in text
    assert "import " in text


def test_local_folder_corpus_reads_files_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"B" * 700)
    (tmp_path / "a.txt").write_bytes(b"A" * 700)
    (tmp_path / "sub" / "c.txt").write_bytes(b"C" * 700)
    data = bytes(load_corpus(str(tmp_path), 10_000))
    assert data == b"A" * 700 + b"B" * 700 + b"C" * 700


def test_missing_or_tiny_corpus_gives_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))
    (tmp_path / "small.txt").write_bytes(b"x" * 10)
    with pytest.raises(CorpusError, match="only 10 bytes"):
        load_corpus(str(tmp_path / "small.txt"))


def test_targets_are_inputs_shifted_by_one(corpus: np.ndarray) -> None:
    x, y = next(stream(corpus, Shard(0, 1, "a")))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_cursor_resumes_exactly(corpus: np.ndarray) -> None:
    s = stream(corpus, Shard(0, 2, "a"))
    first = [next(s) for _ in range(6)]
    assert s.cursor == 6
    resumed = stream(corpus, Shard(0, 2, "a"), start=3)
    for expected in first[3:]:
        got = next(resumed)
        assert torch.equal(got[0], expected[0])
        assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("non_iid", [False, True])
def test_shards_use_disjoint_windows(corpus: np.ndarray, non_iid: bool) -> None:
    starts = []
    for index in range(3):
        s = stream(corpus, Shard(index, 3, "k"), non_iid=non_iid)
        starts.append({int(v) for i in range(20) for v in s._starts(i)})
    assert not starts[0] & starts[1]
    assert not starts[1] & starts[2]


def test_learners_with_the_same_index_still_see_different_batches(corpus: np.ndarray) -> None:
    a = next(stream(corpus, Shard(0, 1, "learner-a/0")))
    b = next(stream(corpus, Shard(0, 1, "learner-b/0")))
    assert not torch.equal(a[0], b[0])


def test_held_out_split_is_the_tail_and_eval_batches_are_fixed(corpus: np.ndarray) -> None:
    train, held = split_corpus(corpus, 0.1)
    assert len(train) + len(held) == len(corpus)
    assert np.array_equal(held, corpus[len(train) :])
    one, two = (
        eval_batches(held, batch_size=4, block_size=16),
        eval_batches(held, batch_size=4, block_size=16),
    )
    assert len(one) == 4
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, two, strict=True))


def test_shard_index_is_checked() -> None:
    with pytest.raises(ValueError, match="outside 0..1"):
        Shard(2, 2, "x")


def test_a_binary_file_in_a_text_corpus_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text " * 400)
    (tmp_path / "data.arrow").write_bytes(b"ARROW1\x00\x00" + bytes(range(256)) * 8)
    with pytest.raises(CorpusError, match=r"data\.arrow is binary"):
        load_corpus(str(tmp_path))
    (tmp_path / "data.arrow").unlink()
    (tmp_path / "latin.txt").write_bytes("caf\xe9 ".encode("latin-1") * 400)
    with pytest.raises(CorpusError, match=r"latin\.txt is not UTF-8 text"):
        load_corpus(str(tmp_path))


def test_a_corpus_cut_at_its_limit_says_so_and_one_within_it_does_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a.txt").write_text("a" * 3000)
    (tmp_path / "b.txt").write_text("b" * 3000)
    with caplog.at_level(logging.INFO, logger="diloco_worker.data"):
        whole = load_corpus(str(tmp_path), max_bytes=8000)
    assert len(whole) == 6000
    assert not [r for r in caplog.records if "left out" in r.getMessage()]
    with caplog.at_level(logging.INFO, logger="diloco_worker.data"):
        cut = load_corpus(str(tmp_path), max_bytes=2000)
    assert len(cut) == 2000
    assert any("the first 2000 bytes are used" in r.getMessage() for r in caplog.records)
