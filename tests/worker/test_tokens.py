"""Token data: .bin files memory-mapped, windows dealt without replacement, the exact position on resume."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diloco_core.config import DataSettings, ModelSettings
from diloco_testbed.process import ManagedProcess, stop_all
from diloco_testbed.waiting import wait_for
from diloco_worker.data import CorpusError, Shard
from diloco_worker.entry import TaskContext, builtin_task, count_tokens
from diloco_worker.model import lm_loss
from diloco_worker.tokens import (
    SampleLog,
    Split,
    TokenCorpus,
    TokenStream,
    WindowDeal,
    eval_windows,
    open_token_corpus,
    split_windows,
    token_batches,
)

from tests.worker.helpers import Synchronizer, iter_logs, learner_process, metric_step, tiny_train

BLOCK = 7  # windows of 8 tokens


def write_bin(path: Path, ids: np.ndarray, dtype: str = "uint16") -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    out = np.asarray(ids, dtype=dtype)
    out.tofile(path)
    return out


def tokens(path: Path, tmp: Path, vocab_size: int = 1000, block: int = BLOCK, **kw: Any) -> TokenCorpus:
    data = DataSettings(corpus=str(path), format="tokens", cache_dir=str(tmp / "cache"), **kw)
    return open_token_corpus(data, block_size=block, vocab_size=vocab_size)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_bin_file_is_memory_mapped_and_read_back_exactly(tmp_path: Path, dtype: str) -> None:
    top = 70_000 if dtype == "uint32" else 60_000
    ids = write_bin(tmp_path / "train.bin", np.random.default_rng(0).integers(0, top, 803), dtype)
    corpus = tokens(tmp_path / "train.bin", tmp_path, vocab_size=top, token_dtype=dtype)
    assert corpus.n_windows == 803 // 8  # the 3 ids after the last whole window are not used
    assert isinstance(corpus.files[0].ids(), np.memmap)  # mapped, not read into memory
    rows = corpus.rows(np.arange(corpus.n_windows))
    assert np.array_equal(rows.reshape(-1), ids[: corpus.n_windows * 8].astype(np.int64))


def test_a_folder_of_shards_is_read_in_sorted_order_and_windows_stay_within_a_file(tmp_path: Path) -> None:
    b = write_bin(tmp_path / "shards" / "b.bin", np.arange(100, 120))  # 2 windows, 4 ids left
    a = write_bin(tmp_path / "shards" / "a.bin", np.arange(0, 17))  # 2 windows, 1 id left
    (tmp_path / "shards" / "meta.json").write_text("{}")  # not a .bin file: not part of the corpus
    corpus = tokens(tmp_path / "shards", tmp_path)
    assert [Path(f.name).name for f in corpus.files] == ["a.bin", "b.bin"]
    assert corpus.n_windows == 4
    rows = corpus.rows(np.arange(4))
    assert np.array_equal(rows, np.stack([a[0:8], a[8:16], b[0:8], b[8:16]]).astype(np.int64))


def corpus_of(tmp_path: Path, n_windows: int, seed: int = 0) -> TokenCorpus:
    ids = np.random.default_rng(seed).integers(0, 1000, n_windows * (BLOCK + 1))
    write_bin(tmp_path / "c.bin", ids)
    return tokens(tmp_path / "c.bin", tmp_path)


def stream(
    corpus: TokenCorpus, split: Split, shard: Shard, start: int = 0, non_iid: bool = False
) -> TokenStream:
    return TokenStream(
        corpus, WindowDeal(split.train, shard, seed=3, non_iid=non_iid), batch_size=4, start=start
    )


def test_batches_from_cursor_k_equal_those_of_an_uninterrupted_stream(tmp_path: Path) -> None:
    corpus = corpus_of(tmp_path, 30)
    split = split_windows(corpus, 0.1, 2)
    whole = stream(corpus, split, Shard(1, 2, "learner-b/0"))
    seen = [next(whole) for _ in range(9)]  # 36 windows of a shard of 14: past two epochs
    assert whole.cursor == 9
    for k in (0, 3, 4, 8):
        resumed = stream(corpus, split, Shard(1, 2, "another-key/0"), start=k)
        for i, expected in enumerate(seen[k:], start=k):
            assert np.array_equal(resumed.sample_ids(i), whole.sample_ids(i))
            x, y = next(resumed)
            assert torch.equal(x, expected[0])
            assert torch.equal(y, expected[1])


@pytest.mark.parametrize(("count", "non_iid"), [(1, False), (3, False), (3, True), (4, False)])
def test_every_training_window_is_trained_once_per_epoch_across_shards_and_never_a_held_out_one(
    tmp_path: Path, count: int, non_iid: bool
) -> None:
    corpus = corpus_of(tmp_path, 50)
    split = split_windows(corpus, 0.2, count)
    assert split == Split(40, 10)
    for epoch in range(3):
        dealt: list[int] = []
        for index in range(count):
            deal = WindowDeal(split.train, Shard(index, count, f"learner-{index}/0"), seed=3, non_iid=non_iid)
            positions = np.arange(epoch * deal.length, (epoch + 1) * deal.length)
            dealt.extend(int(w) for w in deal.windows(positions))
        assert sorted(dealt) == list(range(split.train))  # each exactly once; no held-out window
    one = WindowDeal(split.train, Shard(0, count, "a"), seed=3, non_iid=non_iid)
    assert not np.array_equal(one.epoch(0), one.epoch(1))  # a new order each epoch


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_processes_of_a_unit_take_turns_along_its_shard_and_never_share_a_window(
    tmp_path: Path, ranks: int
) -> None:
    """A unit of R processes reads its learner's shard as one process would, batch by batch in turn: rank
    r's batch i is the shard's batch i*R + r. So a unit resized to another R keeps its shard, and no
    window goes to two processes (or to another unit) within an epoch."""
    corpus = corpus_of(tmp_path, 101)
    split = split_windows(corpus, 0.01, 2)  # 100 training windows, 50 per shard
    whole = stream(corpus, split, Shard(1, 2, "b/0"))
    per_rank = [stream(corpus, split, Shard(1, 2, f"b/{r}", rank=r, ranks=ranks)) for r in range(ranks)]
    for i in range(6):
        for r, s in enumerate(per_rank):
            assert np.array_equal(s.sample_ids(i), whole.sample_ids(i * ranks + r))
    epoch = [int(w) for i in range(50 // (4 * ranks)) for s in per_rank for w in s.sample_ids(i)]
    assert len(set(epoch)) == len(epoch)
    other = stream(corpus, split, Shard(0, 2, "a/0"))
    assert not set(epoch) & {int(w) for i in range(12) for w in other.sample_ids(i)}
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        Shard(0, 1, "x", rank=2, ranks=2)


def test_a_batch_straddling_two_epochs_takes_the_end_of_one_and_the_start_of_the_next(tmp_path: Path) -> None:
    corpus = corpus_of(tmp_path, 11)
    split = split_windows(corpus, 0.1, 1)  # 10 training windows, batches of 4
    s = stream(corpus, split, Shard(0, 1, "a"))
    deal = s.deal
    assert np.array_equal(s.sample_ids(2), np.concatenate([deal.epoch(0)[8:], deal.epoch(1)[:2]]))


def test_held_out_batches_are_fixed_the_same_for_every_learner_and_only_held_out_windows(
    tmp_path: Path,
) -> None:
    corpus = corpus_of(tmp_path, 60)
    split = split_windows(corpus, 0.5 - 1e-9, 1)
    assert split.held_out == 29
    chosen = eval_windows(split, batch_size=4)
    assert len(chosen) == len(set(chosen.tolist())) == 16
    assert chosen.min() >= split.train
    assert chosen.max() == corpus.n_windows - 1
    assert np.array_equal(eval_windows(split_windows(corpus_of(tmp_path, 60), 0.5 - 1e-9, 1), 4), chosen)
    few = split_windows(corpus, 0.05, 1)  # 3 held out: all of them
    assert eval_windows(few, batch_size=4).tolist() == [57, 58, 59]


def ctx_for(
    data: DataSettings, model: ModelSettings, shard: Shard = Shard(0, 1, "a/0"), **train: Any
) -> TaskContext:
    return TaskContext(model, data, tiny_train(**train), shard, torch.device("cpu"), 100_000)


def test_the_builtin_model_trains_on_token_data_with_the_configured_vocabulary(tmp_path: Path) -> None:
    ids = np.random.default_rng(1).integers(0, 700, 40 * 33)
    write_bin(tmp_path / "train.bin", ids)
    data = DataSettings(
        corpus=str(tmp_path / "train.bin"), format="tokens", cache_dir=str(tmp_path / "cache")
    )
    model = ModelSettings(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=700)
    task = builtin_task(ctx_for(data, model))
    assert task.model.wte.weight.shape == (700, 16)  # type: ignore[union-attr]
    batch = next(task.make_batches(0))
    assert batch[0].shape == (4, 32)
    assert torch.isfinite(lm_loss(task.model, batch))
    assert len(task.eval_batches) == 1  # 1 held-out window (2% of 40, at least one)
    with pytest.raises(CorpusError, match=r"token id \d+ at token \d+ is not below vocab_size 600"):
        builtin_task(ctx_for(data, model.model_copy(update={"vocab_size": 600})))


def test_an_id_beyond_the_vocabulary_in_the_middle_of_a_file_stops_the_batch_that_meets_it(
    tmp_path: Path,
) -> None:
    ids = np.zeros(200_000, dtype=np.uint16)  # past the ends that are checked when the file is opened
    ids[100_003] = 999
    write_bin(tmp_path / "big.bin", ids)
    corpus = tokens(tmp_path / "big.bin", tmp_path, vocab_size=500)
    corpus.rows(np.array([0, 1]))
    with pytest.raises(
        CorpusError, match=r"big\.bin: token id 999 at token 100003 is not below vocab_size 500"
    ):
        corpus.rows(np.array([100_003 // 8]))


def test_token_batches_gives_hugging_face_batches_for_an_entry_point(tmp_path: Path) -> None:
    write_bin(tmp_path / "t.bin", np.arange(40 * 33) % 300)
    data = DataSettings(corpus=str(tmp_path / "t.bin"), format="tokens", cache_dir=str(tmp_path / "cache"))
    model = ModelSettings(entry_point="mine:build", block_size=32, vocab_size=300)
    make_batches, evals = token_batches(ctx_for(data, model), as_dict=True)
    batch = next(make_batches(5))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (4, 32)
    assert torch.equal(batch["labels"], batch["input_ids"])  # a Hugging Face model shifts them itself
    assert count_tokens(batch) == 128
    assert isinstance(evals[0], dict)


def test_the_sample_log_has_one_line_per_batch_with_its_step_and_sample_ids(tmp_path: Path) -> None:
    corpus = corpus_of(tmp_path, 30)
    split = split_windows(corpus, 0.1, 1)
    log_path = tmp_path / "samples.jsonl"
    deal = WindowDeal(split.train, Shard(0, 1, "a"), seed=0)
    s = TokenStream(
        corpus, deal, batch_size=4, start=2, sample_log=SampleLog(str(log_path), Shard(0, 1, "a"), 2)
    )
    next(s)
    next(s)
    lines = [json.loads(ln) for ln in log_path.read_text().splitlines()]
    assert [(r["batch"], r["step"], r["shard"]) for r in lines] == [(2, 2, 0), (3, 2, 0)]  # grad_accum 2
    assert lines[0]["samples"] == s.sample_ids(2).tolist()
    assert lines[0]["pid"] == os.getpid()


def test_a_byte_level_corpus_refuses_a_sample_log_and_a_vocabulary_below_256() -> None:
    model = ModelSettings(n_layer=1, n_head=2, n_embd=16, block_size=32)
    with pytest.raises(CorpusError, match="--sample-log needs token data"):
        builtin_task(ctx_for(DataSettings(sample_log="x.jsonl"), model))
    with pytest.raises(CorpusError, match="needs vocab_size 256"):
        builtin_task(ctx_for(DataSettings(), model.model_copy(update={"vocab_size": 100})))


def test_errors_name_the_file_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"'.*nope' does not exist: point --corpus at nanoGPT-style \.bin"):
        tokens(tmp_path / "nope", tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no shards here")
    with pytest.raises(CorpusError, match=r"holds no \*\.bin files"):
        tokens(tmp_path / "empty", tmp_path)
    write_bin(tmp_path / "odd.bin", np.arange(11), "uint8")
    with pytest.raises(
        CorpusError, match=r"odd\.bin is 11 bytes, not a whole number of uint16 ids: is --token-dtype"
    ):
        tokens(tmp_path / "odd.bin", tmp_path)
    write_bin(tmp_path / "small.bin", np.arange(8 * 4))  # 4 windows: 1 held out, 3 to train
    corpus = tokens(tmp_path / "small.bin", tmp_path)
    assert split_windows(corpus, 0.1, 3) == Split(3, 1)
    with pytest.raises(
        CorpusError, match=r"small\.bin' holds 4 windows of 8 tokens, 1 of them held out: too few for 4"
    ):
        split_windows(corpus, 0.1, 4)
    with pytest.raises(CorpusError, match="'stdlib' is a text corpus"):
        open_token_corpus(DataSettings(format="tokens"), block_size=8, vocab_size=256)


# ---- a real learner process, killed with SIGKILL and resumed ----------------------------------------

H, P = 8, 2
PLAN = [
    "--inner-steps",
    str(H),
    "--fragments",
    str(P),
    "--overlap",
    "1",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "10",
]


def _wait_step(proc: ManagedProcess, metrics: Path, at_least: int, timeout: float = 240) -> int:
    def probe() -> int | None:
        if not proc.running():
            raise AssertionError(proc.failure_report())
        step = metric_step(metrics)
        return step if step >= at_least else None

    return wait_for(
        probe, timeout=timeout, what=f"{proc.name} at step {at_least}", describe=proc.failure_report
    )


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill (never seen: each is one write)
            continue
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_a_learner_killed_hard_on_token_data_resumes_at_the_exact_sample(tmp_path: Path) -> None:
    """A learner on a .bin corpus logs the sample (window) ids of every batch it draws; it is killed with
    SIGKILL and resumed from its newest checkpoint, at step ``c``.

    What "trained twice" means with a rollback: the resumed learner restarts from the parameters of
    step ``c``, so the steps ``c+1 .. k`` that the killed process ran after that checkpoint are lost to
    it (those samples went through the dead process; fragments it sent in between may have carried their
    effect into the global model, which is the rollback's cost, not the data order's). The learner's
    history that counts is therefore the killed run's steps ``1 .. c`` followed by every step of the
    resumed run. In that history batch ``i`` must be batch ``i`` of an uninterrupted deal (computed here,
    outside the learner), the resumed run must redo steps ``c+1 .. k`` on the very samples the killed run
    had drawn for them, each epoch must contain every training window exactly once (none twice, none
    skipped), and no held-out window may ever appear."""
    n_windows, block, vocab = 44, 32, 300  # 4 windows held out (10%), 40 to train: an epoch is 5 batches of 8
    write_bin(
        tmp_path / "corpus" / "train.bin",
        np.random.default_rng(7).integers(0, vocab, n_windows * (block + 1)),
    )
    sample_log, metrics = tmp_path / "samples.jsonl", tmp_path / "a.jsonl"
    data_flags = [
        "--data-format", "tokens", "--corpus", str(tmp_path / "corpus"), "--vocab-size", str(vocab),
        "--eval-fraction", "0.1", "--sample-log", str(sample_log), "--data-cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=P)
    sync.start()
    flags = [*PLAN, *data_flags, "--max-steps", "100000", "--checkpoint-every", "5"]
    a = learner_process(tmp_path, "a", sync.url, [*flags, "--checkpoint-dir", str(tmp_path / "ck-a")])
    try:
        a.start()
        _wait_step(a, metrics, 12)
        assert a.pid is not None
        killed_pid = a.pid
        os.kill(a.pid, signal.SIGKILL)
        wait_for(lambda: not a.running(), timeout=30, what="a exits after SIGKILL")
        killed_at = metric_step(metrics)
        a.start()
        wait_for(
            lambda: any("resumed from checkpoint" in ln for ln in iter_logs(a)),
            timeout=120, what="a resumes from its checkpoint", describe=a.failure_report,
        )  # fmt: skip
        resumed = [ln for ln in iter_logs(a) if "resumed from checkpoint" in ln][-1]
        c = int(resumed.split("step=")[1].split()[0])
        assert killed_at - 5 <= c <= killed_at
        assert c % 5 == 0
        _wait_step(a, metrics, killed_at + 10)
        a.stop(timeout=90)
        assert a.returncode() == 0, a.failure_report()
    finally:
        stop_all([a])
        sync.stop()

    records = _records(sample_log)
    killed = [r for r in records if r["pid"] == killed_pid]
    after = [r for r in records if r["pid"] != killed_pid]
    assert len({r["pid"] for r in after}) == 1
    assert [r["batch"] for r in killed] == list(range(len(killed)))
    assert len(killed) >= killed_at >= c  # it had drawn every batch it trained on, and perhaps one more
    assert after[0]["batch"] == c  # the checkpoint's cursor: grad_accum 1, one batch per step
    # the steps the resumed run redid are the very samples the killed run had drawn for them
    redone = {r["batch"]: r["samples"] for r in killed if r["step"] > c}
    assert all(after[b - c]["samples"] == s for b, s in redone.items() if b - c < len(after))

    history = [r for r in killed if r["step"] <= c] + after
    assert [r["batch"] for r in history] == list(range(len(history)))
    assert [r["step"] for r in history] == [r["batch"] + 1 for r in history]
    corpus = tokens(tmp_path / "corpus", tmp_path, vocab_size=vocab, block=block)
    split = split_windows(corpus, 0.1, 1)
    assert split == Split(40, 4)
    uninterrupted = TokenStream(corpus, WindowDeal(split.train, Shard(0, 1, "a/0"), seed=0), batch_size=8)
    assert [r["samples"] for r in history] == [uninterrupted.sample_ids(r["batch"]).tolist() for r in history]

    trained = [w for r in history for w in r["samples"]]
    assert max(trained) < split.train  # never a held-out window
    whole_epochs = len(trained) // split.train
    assert whole_epochs >= 4
    for e in range(whole_epochs):
        assert sorted(trained[e * split.train : (e + 1) * split.train]) == list(range(split.train))
    rest = trained[whole_epochs * split.train :]
    assert len(rest) == len(set(rest))
