"""The outer gradients a checkpoint holds because the synchronizer had not durably taken them: kept
in it, read back, and sent again first by the learner that resumes from it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from diloco_core import protocol as proto
from diloco_core.auth import learner_token
from diloco_core.codec import encode
from diloco_core.fragments import build_plan
from diloco_core.storage import FilesystemStore
from diloco_worker.checkpoint import load_latest, save_checkpoint
from diloco_worker.comms import CommSettings, Communicator
from diloco_worker.entry import TrainingTask
from diloco_worker.fragment_state import FragmentState, Outgoing, StoredPayload
from diloco_worker.learner import _resume
from diloco_worker.sync_client import SyncClient
from diloco_worker.train import LoopState
from diloco_worker.unacknowledged import Unacknowledged, kept_parts, parts_to_resend
from torch import nn

from tests.worker.helpers import SECRET, Synchronizer

PLAN = build_plan([("w", (8,))], 1, 4, 1)
CODEC = "int8"


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8))


class _FailingPayload:
    def encode(self, *, fragment: int, base_version: int, quantizer: str) -> bytes:
        raise RuntimeError("the copy to the host failed")


def _part(p: int, seq: int, tensors: object = None, base: int = 0) -> Outgoing:
    arrays = {"w": np.full(8, 0.25 * seq, np.float32)}
    return Outgoing(p, base, 4, 64, seq, tensors or arrays, since=4 * (seq - 1))  # type: ignore[arg-type]


def _task(model: nn.Module) -> TrainingTask:
    return TrainingTask(model, lambda m, b: torch.zeros(()), lambda cursor: iter(()))


def _train(model: _Model, fs: FragmentState, steps: int) -> None:
    for _ in range(steps):
        with torch.no_grad():
            model.w -= 0.01
        fs.advance(16)


def _save(
    root: Path, model: _Model, fs: FragmentState, step: int, outgoing: Unacknowledged | None
) -> FilesystemStore:
    """The learner's checkpoint of ``step`` (what ``_Saver`` writes)."""
    store = FilesystemStore(root)
    opt = torch.optim.AdamW(model.parameters())
    meta = {
        "step": step,
        "loop": LoopState(step=step, tokens=16 * step, cursor=step).to_dict(),
        "fragments": fs.meta(),
        "plan_hash": PLAN.hash(),
    }
    save_checkpoint(store, model=model, optimizer=opt, anchors=fs.anchors, meta=meta, outgoing=outgoing)
    return store


def _resumed(store: FilesystemStore) -> tuple[_Model, FragmentState, list[Outgoing]]:
    """A new learner's model, fragment state and parts to send again, from the newest checkpoint (as
    ``learner._resume`` builds them)."""
    ckpt = load_latest(store)
    assert ckpt is not None
    model = _Model()
    fs = FragmentState.for_model(PLAN, model)
    _, _, outgoing = _resume(ckpt, _task(model), torch.optim.AdamW(model.parameters()), fs, PLAN.hash())
    return model, fs, outgoing


def test_the_oldest_parts_of_each_fragment_are_kept_in_sequence_order() -> None:
    parts = [_part(1, 2), _part(0, 3), _part(0, 1), _part(0, 2), _part(1, 1)]
    kept = kept_parts(parts, per_fragment=2)
    assert [(c.fragment, c.seq) for c in kept] == [(0, 1), (0, 2), (1, 1), (1, 2)]


def test_the_parts_round_trip_through_a_checkpoint_as_the_payloads_they_were(tmp_path: Path) -> None:
    model = _Model()
    fs = FragmentState.for_model(PLAN, model)
    parts = (_part(0, 1), _part(0, 2))
    store = _save(tmp_path, model, fs, 8, Unacknowledged(CODEC, parts))
    _, _, back = _resumed(store)
    assert [(c.fragment, c.base_version, c.steps, c.tokens, c.seq, c.since) for c in back] == [
        (0, 0, 4, 64, 1, 0),
        (0, 0, 4, 64, 2, 4),
    ]
    assert [c.encode(CODEC) for c in back] == [c.encode(CODEC) for c in parts]
    with pytest.raises(ValueError, match="int4"):
        back[0].encode("int4")


def test_a_part_whose_payload_fails_is_left_out_with_the_later_parts_of_its_fragment(tmp_path: Path) -> None:
    model = _Model()
    fs = FragmentState.for_model(PLAN, model)
    parts = (_part(0, 1), _part(0, 2, _FailingPayload()), _part(0, 3))
    store = _save(tmp_path, model, fs, 8, Unacknowledged(CODEC, parts))
    _, _, back = _resumed(store)
    assert [c.seq for c in back] == [1]


def test_parts_on_a_superseded_version_or_in_another_quantizer_are_not_sent_again() -> None:
    stored = StoredPayload(b"x", CODEC)
    parts = [
        _part(0, 1, stored, base=2),
        _part(0, 2, stored, base=3),
        _part(1, 1, StoredPayload(b"x", "int4")),
    ]
    assert [(c.fragment, c.seq) for c in parts_to_resend(parts, {0: 3, 1: 0}, CODEC)] == [(0, 2)]


def test_a_checkpoint_written_without_outgoing_parts_still_resumes(tmp_path: Path) -> None:
    """A checkpoint from before the parts were kept: its meta.json has no ``outgoing``."""
    model = _Model()
    fs = FragmentState.for_model(PLAN, model)
    fs.set_base(0, 0, {"w": np.zeros(8, np.float32)})
    _train(model, fs, 4)
    fs.take_contribution(0, CODEC)
    store = _save(tmp_path, model, fs, 4, None)
    meta_path = tmp_path / "ckpt-0000000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert "outgoing" not in meta
    resumed_model, resumed_fs, outgoing = _resumed(store)
    assert outgoing == []
    assert torch.equal(resumed_model.w, model.w)
    assert resumed_fs.meta() == fs.meta()


def _registered(sync: Synchronizer, name: str) -> SyncClient:
    client = SyncClient(sync.url, name, learner_token(SECRET, name))
    client.register(
        proto.RegisterRequest(learner_id=name, plan=PLAN.to_dict(), plan_hash=PLAN.hash(), tokens_per_step=16)
    )
    return client


@pytest.mark.integration
def test_a_resumed_learner_sends_the_parts_its_checkpoint_holds_first_and_goes_on_in_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two parts queued, not sent, when the checkpoint is taken; the first is taken by the synchronizer
    just before the learner crashes. The learner resumed from the checkpoint sends both again (the
    first is a duplicate, the second is taken), then its next part is taken in order: nothing is
    refused and no fragment is fetched again."""
    sync = Synchronizer(tmp_path, inner_steps=4, fragments=1, quorum=2)  # one learner: no round merges
    sync.start()
    try:
        client = _registered(sync, "a")
        client.init_fragment(
            0,
            encode(
                {"w": np.zeros(8, np.float32)}, fragment=0, base_version=-1, kind="params", quantizer="fp32"
            ),
        )
        model = _Model()
        fs = FragmentState.for_model(PLAN, model)
        fs.set_base(0, 0, {"w": np.zeros(8, np.float32)})
        before = Communicator(client, PLAN, CommSettings(codec=CODEC), versions=fs.versions())  # not started
        _train(model, fs, 4)
        first = fs.take_contribution(0, CODEC)
        before.submit(first)
        _train(model, fs, 4)
        before.submit(fs.take_contribution(0, CODEC))
        store = _save(tmp_path / "ckpt", model, fs, 8, Unacknowledged(CODEC, tuple(before.unacknowledged())))
        taken = client.contribute(
            0, first.encode(CODEC), base_version=0, steps=first.steps, tokens=first.tokens, seq=first.seq
        )
        assert taken.status == "accepted"
        client.close()

        model, fs, outgoing = _resumed(store)
        assert [(c.seq, c.since) for c in outgoing] == [(1, 0), (2, 4)]
        comm = Communicator(
            _registered(sync, "a"), PLAN, CommSettings(codec=CODEC, poll_wait_s=1.0), versions=fs.versions()
        )
        for c in parts_to_resend(outgoing, fs.versions(), CODEC):
            comm.submit(c)
        with caplog.at_level(logging.INFO, logger="diloco_worker.comms"):
            comm.start()
            try:
                _train(model, fs, 4)
                nxt = fs.take_contribution(0, CODEC)
                assert (nxt.seq, nxt.since) == (3, 8)
                comm.submit(nxt)
                assert comm.flush(30)
            finally:
                comm.stop()
        answers = [
            r.getMessage().rsplit(": ", 1)[1].split()[0] for r in caplog.records if " sent " in r.getMessage()
        ]
        assert answers == ["duplicate", "accepted", "accepted"]
        assert (comm.sent, comm.rejected) == (3, 0)
        assert comm.poller.known_version(0) == 0  # never asked to fetch the fragment again
    finally:
        sync.stop()
