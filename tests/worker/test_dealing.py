"""A unit's ranges of the job's data (diloco_worker.dealing) and, with real processes, units added,
removed and restarted while the job trains: no training window is dealt to two learners, and a learner
resumed from its checkpoint continues on its own ranges."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from diloco_core.dealing import DealRecord, DealtRange, deal
from diloco_core.protocol import RangeResponse
from diloco_testbed.ports import free_port
from diloco_testbed.process import ManagedProcess, stop_all
from diloco_testbed.waiting import wait_for
from diloco_worker.data import Shard
from diloco_worker.dealing import UnitRanges, range_size
from diloco_worker.distributed import Unit
from diloco_worker.sync_client import SyncUnavailable
from diloco_worker.tokens import WindowDeal

from tests.worker.helpers import Synchronizer, learner_process
from tests.worker.test_tokens import PLAN, _wait_step, write_bin

WINDOWS = 48_000  # of 33 tokens: enough that the job stays within one epoch


class Dealer:
    """The synchronizer's side in memory (the pure ``deal``), failing the first ``failures`` calls as a
    synchronizer that is down would."""

    def __init__(self, unit: str, failures: int = 0) -> None:
        self.unit, self.failures, self.record, self.calls = unit, failures, DealRecord(), 0

    def data_range(self, position: int, size: int) -> RangeResponse:
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise SyncUnavailable("connection refused")
        self.record, got = deal(self.record, self.unit, position, size)
        return RangeResponse(offset=got.offset, start=got.start, size=got.size)


def test_range_sizes_are_whole_unit_batches_and_a_small_corpus_gets_small_ranges() -> None:
    assert range_size(100_000, 16) == 16 * 32
    assert range_size(1_000, 16) == 16 * 7  # 1000 // (8 * 16)
    assert range_size(40, 8) == 8


def test_a_unit_asks_once_per_range_and_again_after_an_outage() -> None:
    dealer = Dealer("a", failures=2)
    ranges = UnitRanges(dealer, Unit(), threading.Event())  # type: ignore[arg-type]
    ranges.cover(0, 8, 16)
    assert ranges.stream(5) == 5
    ranges.cover(8, 16, 16)
    assert dealer.calls == 3  # two failures, then one range of 16 positions for both batches
    ranges.cover(16, 24, 16)
    assert ranges.ranges[-1] == DealtRange(offset=16, start=16, size=16)
    with pytest.raises(KeyError):
        ranges.stream(40)


def _windows(path: Path) -> list[tuple[int, list[int]]]:
    return [(r["batch"], r["samples"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.integration
@pytest.mark.slow
def test_units_added_removed_and_resumed_never_train_a_window_twice(tmp_path: Path) -> None:
    """a trains alone; b joins; a stops (SIGTERM: its checkpoint) and c joins; a comes back from its
    checkpoint. Each learner logs the windows of every batch it draws. The job stays within one epoch,
    so no window may appear twice over all learners; each learner's batches run 0, 1, 2, ... with a
    restart at its checkpoint's batch. Without dealing every learner read the same shard (the whole
    corpus), and b and c started at a's first windows."""
    block, vocab = 32, 300
    write_bin(
        tmp_path / "corpus" / "train.bin", np.random.default_rng(3).integers(0, vocab, WINDOWS * (block + 1))
    )
    sync = Synchronizer(tmp_path, inner_steps=8, fragments=2)
    sync.start()
    procs: dict[str, ManagedProcess] = {}

    def start(name: str) -> ManagedProcess:
        flags = [
            *PLAN, "--data-format", "tokens", "--corpus", str(tmp_path / "corpus"), "--vocab-size", str(vocab),
            "--eval-fraction", "0.1", "--sample-log", str(tmp_path / f"{name}.samples"),
            "--data-cache-dir", str(tmp_path / "cache"), "--max-steps", "100000", "--checkpoint-every", "5",
            "--checkpoint-dir", str(tmp_path / f"ck-{name}"), "--speed-factor", "4",
        ]  # fmt: skip
        procs[name] = learner_process(tmp_path, name, sync.url, flags)
        procs[name].start()
        return procs[name]

    try:
        a = start("a")
        _wait_step(a, tmp_path / "a.jsonl", 10)
        b = start("b")
        _wait_step(b, tmp_path / "b.jsonl", 10)
        a.stop(timeout=90)
        assert a.returncode() == 0, a.failure_report()
        c = start("c")
        _wait_step(c, tmp_path / "c.jsonl", 10)
        a = start("a")
        stepped = _wait_step(a, tmp_path / "a.jsonl", 1)
        _wait_step(a, tmp_path / "a.jsonl", stepped + 10)
    finally:
        stop_all(list(procs.values()))
        sync.stop()

    trained: list[int] = []
    for name in ("a", "b", "c"):
        history: list[tuple[int, list[int]]] = []
        for batch, samples in _windows(tmp_path / f"{name}.samples"):
            if history and batch <= history[-1][0]:  # a restart: from its checkpoint's batch on
                assert batch % 5 == 0, (name, batch)
                assert [s for b, s in history if b >= batch][:1] in ([], [samples]), name
                history = [(b, s) for b, s in history if b < batch]
            history.append((batch, samples))
        assert [b for b, _ in history] == list(range(len(history))), name
        trained += [w for _, s in history for w in s]
    assert len(trained) < WINDOWS * 9 // 10  # within one epoch of the training windows (10% held out)
    assert len(trained) == len(set(trained)), "a window was trained by two learners, or twice by one"
    deal_record = json.loads(next((tmp_path).rglob("deal.json")).read_text())
    assert sorted(deal_record["units"]) == ["a", "b", "c"]


@pytest.mark.integration
@pytest.mark.slow
def test_a_two_process_unit_reads_its_dealt_ranges_and_its_second_rank_never_asks(tmp_path: Path) -> None:
    """Rank 0 asks the synchronizer for the unit's ranges and rank 1, given an address where nothing
    listens, takes them from rank 0: the two ranks take turns along the unit's sequence, share no
    window, and together read exactly the positions their ranges hold, in order."""
    block, vocab, steps = 32, 300, 40
    write_bin(
        tmp_path / "corpus" / "train.bin", np.random.default_rng(4).integers(0, vocab, WINDOWS * (block + 1))
    )
    sync = Synchronizer(tmp_path, inner_steps=8, fragments=2)
    sync.start()
    unit_env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    common = [
        *PLAN, "--data-format", "tokens", "--corpus", str(tmp_path / "corpus"), "--vocab-size", str(vocab),
        "--eval-fraction", "0.1", "--data-cache-dir", str(tmp_path / "cache"), "--max-steps", str(steps),
        "--unit", "unit-a",
    ]  # fmt: skip
    ranks = [
        learner_process(
            tmp_path / f"r{r}",
            "unit-a",
            sync.url if r == 0 else f"http://127.0.0.1:{free_port()}",
            [*common, "--sample-log", str(tmp_path / f"rank{r}.samples")],
            env={**unit_env, "RANK": str(r)},
        )
        for r in (0, 1)
    ]
    try:
        for proc in ranks:
            proc.start()
        for proc in ranks:
            wait_for(lambda proc=proc: not proc.running(), timeout=400, what=f"{proc.name} ends")
            assert proc.returncode() == 0, proc.failure_report()
    finally:
        stop_all(ranks)
        sync.stop()
    logs = [_windows(tmp_path / f"rank{r}.samples") for r in (0, 1)]
    assert [[b for b, _ in log] for log in logs] == [list(range(steps))] * 2
    # unit batch 2i is rank 0's batch i, 2i+1 rank 1's: one sequence, dealt in order from position 0
    sequence = [w for i in range(steps) for r in (0, 1) for w in logs[r][i][1]]
    assert len(sequence) == len(set(sequence))
    # the only unit: its sequence is the job's stream from its start, epoch 0's permutation
    whole = WindowDeal(WINDOWS * 9 // 10, Shard(0, 1, "unit-a/0"), seed=0)
    assert sequence == whole.windows(np.arange(len(sequence), dtype=np.int64)).tolist()
    record = json.loads(next(tmp_path.rglob("deal.json")).read_text())
    assert list(record["units"]) == ["unit-a"]
    size = range_size(WINDOWS * 9 // 10, 2 * 8)
    assert [r["size"] for r in record["units"]["unit-a"]] == [size] * -(-len(sequence) // size)
