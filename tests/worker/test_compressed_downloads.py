"""Compressed downloads against a real synchronizer: a learner's poller applies each update to the
copy of the previous version it holds and gets the synchronizer's version bit for bit; a learner
that holds nothing, or the wrong version, gets the whole version."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from diloco_core import protocol as proto
from diloco_core.auth import learner_token
from diloco_core.codec import decode, encode, encode_params
from diloco_core.fragments import FragmentPlan, build_plan
from diloco_testbed.waiting import wait_for
from diloco_worker.comms import CommSettings, Communicator
from diloco_worker.data import Shard
from diloco_worker.entry import TaskContext, load_task
from diloco_worker.learner import plan_for
from diloco_worker.settings import parse_settings
from diloco_worker.sync_client import GlobalFragment, SyncClient

from tests.worker.helpers import SECRET, TINY_FLAGS, Synchronizer, iter_logs, learner_process

pytestmark = pytest.mark.integration
PLAN = build_plan([("w", (64, 32)), ("b", (32,))], 1, 4, 1)


def _client(sync: Synchronizer, name: str) -> SyncClient:
    client = SyncClient(sync.url, name, learner_token(SECRET, name))
    req = proto.RegisterRequest(
        learner_id=name, plan=PLAN.to_dict(), plan_hash=PLAN.hash(), tokens_per_step=4
    )
    reg = client.register(req)
    assert reg.diloco["down_codec"] == "int2"
    return client


def _whole(client: SyncClient) -> tuple[int, dict[str, np.ndarray]]:
    got = client.fetch(0, newer_than=-1, wait_s=0)
    assert isinstance(got, GlobalFragment)
    payload = decode(got.payload, fragment=PLAN.fragments[0])
    assert payload.kind == "params"
    return got.version, payload.tensors


def _initialised(
    sync: Synchronizer, rng: np.random.Generator
) -> tuple[SyncClient, SyncClient, dict[str, np.ndarray]]:
    """Learners x (which uploads the initial parameters) and y, and version 0 as x takes it at start."""
    x, y = _client(sync, "x"), _client(sync, "y")
    init = {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": np.zeros(32, np.float32)}
    x.init_fragment(0, encode(init, fragment=0, base_version=-1, kind="params", quantizer="fp32"))
    _, version0 = _whole(x)
    return x, y, version0


def _contribute(y: SyncClient, rng: np.random.Generator, base: int) -> None:
    """y's outer gradient on version ``base`` (sequence number base + 1): with quorum 1, version base + 1."""
    delta = {"w": 0.01 * rng.standard_normal((64, 32)).astype(np.float32),
             "b": 0.01 * rng.standard_normal(32).astype(np.float32)}  # fmt: skip
    y.contribute(0, encode(delta, fragment=0, base_version=base, kind="outer_grad", quantizer="fp32"),
                 base_version=base, steps=4, tokens=16, seq=base + 1)  # fmt: skip


def test_the_learner_follows_every_version_through_updates_bit_for_bit(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=4, fragments=1, extra=["--down-codec", "int2"])
    sync.start()
    rng = np.random.default_rng(0)
    try:
        x, y, version0 = _initialised(sync, rng)
        settings = CommSettings(codec="fp32", poll_wait_s=1.0, hold_versions=True)
        comm = Communicator(x, PLAN, settings, versions={0: 0}, held={0: (0, version0)})
        comm.start()
        try:
            for r in range(6):
                _contribute(y, rng, r)
                version, tensors = wait_for(comm.take_arrivals, timeout=30, what=f"version {r + 1}")[0]
                assert version == r + 1
                whole_version, whole = _whole(y)
                assert whole_version == version
                for name, value in whole.items():
                    np.testing.assert_array_equal(tensors[name], value)
            assert comm.updates == 6  # every version came as an update
            whole_size = len(encode_params(version0, 0, 0))
            received = {x["learner_id"]: x["bytes_received"] for x in sync.status()["learners"]}
            assert 0 < received["x"] - whole_size < 6 * whole_size / 8  # its first fetch, then 6 updates
        finally:
            comm.stop()

        # an update is smaller than the version; a learner holding another version gets the whole one
        assert x.fetch(0, newer_than=6, wait_s=0, have=6) is None  # nothing newer than 6 yet
        _contribute(y, rng, 6)
        wait_for(lambda: sync.versions()[0] == 7, timeout=30, what="version 7")
        as_update = x.fetch(0, newer_than=6, wait_s=0, have=6)
        as_whole = x.fetch(0, newer_than=6, wait_s=0, have=3)
        assert isinstance(as_update, GlobalFragment)
        assert isinstance(as_whole, GlobalFragment)
        assert decode(as_update.payload).kind == "update"
        assert decode(as_whole.payload).kind == "params"
        assert len(as_update.payload) * 8 < len(as_whole.payload)
    finally:
        sync.stop()


def test_a_learner_several_versions_behind_walks_the_chain_of_updates(tmp_path: Path) -> None:
    """Four versions are made while the learner's poller is stopped; started again, it takes the
    four updates one after the other (each answer the next version) and ends on the synchronizer's
    version bit for bit, having received less than one whole version."""
    sync = Synchronizer(tmp_path, inner_steps=4, fragments=1, extra=["--down-codec", "int2"])
    sync.start()
    rng = np.random.default_rng(1)
    try:
        x, y, version0 = _initialised(sync, rng)
        before = {r["learner_id"]: r["bytes_received"] for r in sync.status()["learners"]}["x"]
        for r in range(4):
            _contribute(y, rng, r)
            wait_for(lambda r=r: sync.versions()[0] == r + 1, timeout=30, what=f"version {r + 1}")
        settings = CommSettings(codec="fp32", poll_wait_s=1.0, hold_versions=True)
        comm = Communicator(x, PLAN, settings, versions={0: 0}, held={0: (0, version0)})
        comm.start()
        try:
            newest: dict[str, np.ndarray] = {}

            def at_version_4() -> bool:
                for version, tensors in comm.take_arrivals().values():
                    if version == 4:
                        newest.update(tensors)
                return bool(newest)

            wait_for(at_version_4, timeout=30, what="version 4 through the chain")
        finally:
            comm.stop()
        assert comm.updates == 4  # every link of the chain, none of them whole
        whole_version, whole = _whole(y)
        assert whole_version == 4
        for name, value in whole.items():
            np.testing.assert_array_equal(newest[name], value)
        whole_size = len(encode_params(version0, 0, 0))
        received = {r["learner_id"]: r["bytes_received"] for r in sync.status()["learners"]}["x"] - before
        assert 0 < received < whole_size
    finally:
        sync.stop()


def test_learners_that_built_version_0_take_nothing_at_start(tmp_path: Path) -> None:
    """The learner that initialises a fragment and one that builds the same initial parameters (the
    same seed) hold version 0 already: the synchronizer's digest says so and neither downloads it;
    a learner whose parameters differ (another seed) takes it whole. The inner steps are many, so no
    round makes a version 1 while the three start one after the other, however slow the machine."""
    sync = Synchronizer(tmp_path, inner_steps=1_000_000, fragments=2, extra=["--down-codec", "int2"])
    sync.start()
    flags = ["--inner-steps", "1000000", "--fragments", "2", "--overlap", "1", "--max-steps", "10000000"]
    started = []
    try:
        for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
            proc = learner_process(tmp_path, name, sync.url, [*flags, "--seed", seed])
            proc.start()
            started.append(proc)
            wait_for(lambda p=proc: any("step=2 " in ln for ln in iter_logs(p)), timeout=120,
                     what=f"{name} training", describe=proc.failure_report)  # fmt: skip
        own = {
            p.name: sum("is this learner's initial parameters" in ln for ln in iter_logs(p)) for p in started
        }
        assert own == {"a": 2, "b": 2, "c": 0}
        received = {x["learner_id"]: x["bytes_received"] for x in sync.status()["learners"]}
        assert received["a"] == received["b"] == 0
        assert received["c"] > 0  # both fragments whole
        assert sync.versions() == {0: 0, 1: 0}
    finally:
        for proc in started:
            proc.stop()
        sync.stop()


def test_a_restarted_learner_walks_the_updates_from_the_version_its_checkpoint_holds(tmp_path: Path) -> None:
    """A learner killed with -9 resumes from its checkpoint, which holds the global versions it had
    (with compressed downloads): it takes the updates since, not the whole version."""
    sync = Synchronizer(tmp_path, inner_steps=1000, fragments=2, extra=["--down-codec", "int2"])
    sync.start()
    flags = ["--inner-steps", "1000", "--fragments", "2", "--overlap", "1", "--max-steps", "100000",
             "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
             "--no-partial-contributions"]  # only y's contributions make versions  # fmt: skip
    a = learner_process(tmp_path, "a", sync.url, flags)
    rng = np.random.default_rng(0)
    try:
        a.start()
        wait_for(lambda: any("checkpoint written" in ln for ln in iter_logs(a)), timeout=120,
                 what="a's first checkpoint", describe=a.failure_report)  # fmt: skip
        y = SyncClient(sync.url, "y", learner_token(SECRET, "y"))
        plan = _learner_plan(flags)
        y.register(proto.RegisterRequest(learner_id="y", plan=plan.to_dict(), plan_hash=plan.hash(),
                                         tokens_per_step=4))  # fmt: skip
        shapes = {t.name: t.shape for t in plan.fragments[0].tensors}

        def contribute(base: int) -> None:
            delta = {n: (0.01 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}
            y.contribute(0, encode(delta, fragment=0, base_version=base, kind="outer_grad", quantizer="fp32"),
                         base_version=base, steps=4, tokens=16, seq=base + 1)  # fmt: skip
            wait_for(lambda: sync.versions()[0] == base + 1, timeout=30, what=f"version {base + 1}")

        def a_at(version: int) -> bool:
            row = {x["learner_id"]: x for x in sync.status()["learners"]}.get("a")
            return sync.versions()[0] == version and row is not None and row["staleness"] == 0

        for base in (0, 1):
            contribute(base)
        wait_for(lambda: a_at(2), timeout=60, what="a holding version 2")
        written = sum("checkpoint written" in ln for ln in iter_logs(a))
        wait_for(lambda: sum("checkpoint written" in ln for ln in iter_logs(a)) >= written + 2, timeout=60,
                 what="a checkpoint holding version 2")  # fmt: skip
        os.kill(a.pid or 0, signal.SIGKILL)
        wait_for(lambda: not a.running(), timeout=30, what="a killed")
        for base in (2, 3):
            contribute(base)
        before = {x["learner_id"]: x["bytes_received"] for x in sync.status()["learners"]}["a"]
        a.start()
        wait_for(lambda: a_at(4), timeout=120, what="a back at version 4", describe=a.failure_report)
        walked = [ln for ln in iter_logs(a) if "from the copy held at version" in ln]
        assert walked, a.log_tail()
        assert "fragment=0 version=4 from the copy held at version 2 and 2 update(s)" in walked[-1]
        received = {x["learner_id"]: x["bytes_received"] for x in sync.status()["learners"]}["a"] - before
        whole = 4 * sum(int(np.prod(s)) for s in shapes.values())
        assert 0 < received < whole / 4  # two int2 updates, not the float32 version
    finally:
        a.stop()
        sync.stop()


def _learner_plan(flags: list[str]) -> FragmentPlan:
    """The fragment plan a learner process with these flags (and the tiny model's) builds."""
    settings = parse_settings([*TINY_FLAGS, *flags, "--standalone"])
    task = load_task(TaskContext(settings.model, settings.data, settings.train, Shard(0, 1, "a"),
                                 torch.device("cpu"), settings.corpus_max_bytes))  # fmt: skip
    return plan_for(task, settings)
