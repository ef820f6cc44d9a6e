from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from diloco_core.storage import FilesystemStore, StorageError
from diloco_worker.checkpoint import (
    CheckpointWriter,
    common_step,
    list_checkpoints,
    load_latest,
    restore,
    save_checkpoint,
    snapshot_checkpoint,
)
from diloco_worker.learner import run_learner
from diloco_worker.model import build_gpt
from diloco_worker.settings import WorkerSettings
from diloco_worker.train import make_optimizer

from tests.worker.helpers import CORPUS_BYTES, TINY, tiny_train


def _settings(ckpt: Path, **kw: object) -> WorkerSettings:
    return WorkerSettings(
        standalone=True,
        model=TINY,
        train=tiny_train(max_steps=12),
        checkpoint_dir=str(ckpt),
        corpus_max_bytes=CORPUS_BYTES,
        threads=1,
        **kw,  # type: ignore[arg-type]
    )


def _final_params(ckpt: Path) -> dict[str, torch.Tensor]:
    loaded = load_latest(FilesystemStore(ckpt))
    assert loaded is not None
    return {k: v for k, v in loaded.tensors.items() if k.startswith(("param/", "optim/"))}


def test_k_steps_restart_and_the_rest_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_learner(_settings(straight), {}, threading.Event()) == 0
    assert run_learner(_settings(split, stop_at_step=5), {}, threading.Event()) == 0
    assert list_checkpoints(FilesystemStore(split)) == [5]
    assert run_learner(_settings(split), {}, threading.Event()) == 0  # a new learner resumes at step 5
    assert list_checkpoints(FilesystemStore(split))[-1] == 12
    a, b = _final_params(straight), _final_params(split)
    assert a.keys() == b.keys()
    assert any(k.startswith("optim/") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    meta_a, meta_b = load_latest(FilesystemStore(straight)), load_latest(FilesystemStore(split))
    assert meta_a is not None
    assert meta_b is not None
    assert meta_a.meta["loop"]["cursor"] == meta_b.meta["loop"]["cursor"] == 12
    assert meta_a.meta["fragments"] == meta_b.meta["fragments"]


def test_round_trip_restores_params_optimizer_anchors_and_rng(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    model = build_gpt(TINY)
    opt = make_optimizer(model, tiny_train())
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()
    anchors = {0: {"wte.weight": np.full((256, 32), 0.5, dtype=np.float32)}}
    torch.manual_seed(7)
    save_checkpoint(store, model=model, optimizer=opt, anchors=anchors, meta={"step": 3, "note": "x"})
    expected_rand = torch.rand(2)

    other = build_gpt(TINY.model_copy(update={"seed": 9}))
    other_opt = make_optimizer(other, tiny_train())
    ckpt = load_latest(store)
    assert ckpt is not None
    assert ckpt.step == 3
    assert ckpt.meta["note"] == "x"
    restore(ckpt, other, other_opt)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])
    assert np.array_equal(ckpt.anchors()[0]["wte.weight"], anchors[0]["wte.weight"])
    assert torch.equal(torch.rand(2), expected_rand)


def test_the_global_versions_held_round_trip_exactly(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    model = build_gpt(TINY)
    opt = make_optimizer(model, tiny_train())
    values = np.random.default_rng(0).standard_normal((256, 32)).astype(np.float32)
    save_checkpoint(store, model=model, optimizer=opt, anchors={}, meta={"step": 1},
                    held={3: (17, {"wte.weight": values})})  # fmt: skip
    ckpt = load_latest(store)
    assert ckpt is not None
    held = ckpt.held()
    assert list(held) == [3]
    assert held[3][0] == 17
    assert np.array_equal(held[3][1]["wte.weight"], values)
    save_checkpoint(store, model=model, optimizer=opt, anchors={}, meta={"step": 2})  # none held
    again = load_latest(store)
    assert again is not None
    assert again.held() == {}


def test_only_the_newest_are_kept_and_incomplete_ones_are_ignored(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    model = build_gpt(TINY)
    opt = make_optimizer(model, tiny_train())
    for step in (1, 2, 3):
        save_checkpoint(store, model=model, optimizer=opt, anchors={}, meta={"step": step}, keep=2)
    assert list_checkpoints(store) == [2, 3]
    store.put("ckpt-0000000009/tensors.safetensors", b"partial write, no meta.json")
    ckpt = load_latest(store)
    assert ckpt is not None
    assert ckpt.step == 3


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    model = build_gpt(TINY)
    opt = make_optimizer(model, tiny_train())
    for step in (1, 2):
        save_checkpoint(store, model=model, optimizer=opt, anchors={}, meta={"step": step})
    store.put("ckpt-0000000002/tensors.safetensors", b"\x00garbage")
    ckpt = load_latest(store)
    assert ckpt is not None
    assert ckpt.step == 1


def test_python_random_state_is_kept_as_json(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    model = build_gpt(TINY)
    opt = make_optimizer(model, tiny_train())
    random.seed(11)
    save_checkpoint(store, model=model, optimizer=opt, anchors={}, meta={"step": 1})
    expected = [random.random() for _ in range(3)]
    random.seed(99)
    ckpt = load_latest(store)
    assert ckpt is not None
    assert json.loads((tmp_path / "ckpt-0000000001" / "meta.json").read_text())["rng"]["python"][0] == 3
    restore(ckpt, model, opt)
    assert [random.random() for _ in range(3)] == expected


@pytest.mark.gpu
def test_cuda_generators_are_saved_and_restored(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    model = build_gpt(TINY)
    opt = make_optimizer(model, tiny_train())
    torch.cuda.manual_seed_all(5)
    save_checkpoint(store, model=model, optimizer=opt, anchors={}, meta={"step": 1})
    expected = torch.rand(4, device="cuda").cpu()
    torch.cuda.manual_seed_all(6)
    ckpt = load_latest(store)
    assert ckpt is not None
    assert sum(1 for k in ckpt.tensors if k.startswith("rng/cuda/")) == torch.cuda.device_count()
    restore(ckpt, model, opt)
    assert torch.equal(torch.rand(4, device="cuda").cpu(), expected)


def test_cuda_generators_of_another_gpu_count_are_skipped(tmp_path: Path) -> None:
    """A checkpoint written where more GPUs were visible than here: the CPU generator and the model
    are restored, the CUDA generators are left alone (their count does not match)."""
    store = FilesystemStore(tmp_path)
    model = build_gpt(TINY)
    opt = make_optimizer(model, tiny_train())
    torch.manual_seed(3)
    save_checkpoint(store, model=model, optimizer=opt, anchors={}, meta={"step": 1})
    expected = torch.rand(2)
    ckpt = load_latest(store)
    assert ckpt is not None
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fake_state = torch.zeros(16, dtype=torch.uint8)
    for i in range(seen + 1):
        ckpt.tensors[f"rng/cuda/{i}"] = fake_state
    restore(ckpt, model, opt)
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.parametrize(
    ("per_rank", "step"),
    [
        ([[10, 20], [20, 30]], 20),
        ([[10, 20], [10, 20]], 20),
        ([[], [10]], 0),
        ([[10], [20]], 0),
        ([[30]], 30),
        ([], 0),
    ],
)
def test_common_step_is_the_newest_every_rank_holds(per_rank: list[list[int]], step: int) -> None:
    assert common_step(per_rank) == step


def test_the_writer_writes_the_state_at_the_snapshot_in_the_background(tmp_path: Path) -> None:
    """What changes after the snapshot (the next steps, an anchor) is not in the checkpoint; close()
    waits for the write; an older checkpoint beyond ``keep`` is removed."""
    store = FilesystemStore(tmp_path)
    model = build_gpt(TINY)
    opt = make_optimizer(model, tiny_train())
    anchors = {0: {"wte.weight": np.full((256, 32), 0.5, dtype=np.float32)}}
    written: list[int] = []
    writer = CheckpointWriter(store, keep=1, on_written=written.append)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    writer.submit(snapshot_checkpoint(model=model, optimizer=opt, anchors=anchors, meta={"step": 1}))
    with torch.no_grad():  # training goes on while the snapshot is written
        for p in model.parameters():
            p.add_(1.0)
    anchors[0]["wte.weight"][:] = 9.0
    writer.submit(snapshot_checkpoint(model=model, optimizer=opt, anchors=anchors, meta={"step": 2}))
    writer.close()
    assert written == [1, 2]
    assert list_checkpoints(store) == [2]
    loaded = load_latest(store)
    assert loaded is not None
    for name, value in expected.items():
        assert torch.equal(loaded.tensors[f"param/{name}"], value + 1.0), name
    assert np.all(loaded.anchors()[0]["wte.weight"] == 9.0)


def test_a_failed_background_write_is_raised_on_the_training_thread(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    (tmp_path / "ckpt-0000000001").write_text("a file where the checkpoint's folder would go")
    writer = CheckpointWriter(store)
    model = build_gpt(TINY)
    snap = snapshot_checkpoint(
        model=model, optimizer=make_optimizer(model, tiny_train()), anchors={}, meta={"step": 1}
    )
    writer.submit(snap)
    with pytest.raises((OSError, StorageError)):
        writer.close()
    writer.close()  # raised once


class _SlowStore(FilesystemStore):
    """A real folder whose writes wait until released (storage slower than training)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release = threading.Event()

    def put(self, key: str, data: bytes | bytearray) -> None:
        assert self.release.wait(30)
        super().put(key, data)


def test_a_periodic_checkpoint_is_skipped_while_one_is_written_and_the_final_one_waits(
    tmp_path: Path,
) -> None:
    store = _SlowStore(tmp_path)
    model = build_gpt(TINY)
    opt = make_optimizer(model, tiny_train())
    writer = CheckpointWriter(store)
    assert writer.takes(final=False)
    writer.submit(snapshot_checkpoint(model=model, optimizer=opt, anchors={}, meta={"step": 10}))
    assert writer.busy
    assert not writer.takes(final=False)  # step 20 comes while step 10 is still being written
    assert writer.takes(final=True)
    store.release.set()
    writer.submit(snapshot_checkpoint(model=model, optimizer=opt, anchors={}, meta={"step": 25}))  # waits
    writer.close()
    assert not writer.busy
    assert list_checkpoints(store) == [10, 25]


def test_the_newest_checkpoints_kept_are_as_many_as_asked_and_no_empty_folder_is_left(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    settings = _settings(ckpt).model_copy(
        update={"train": tiny_train(max_steps=12, checkpoint_every=2, checkpoints_kept=3)}
    )
    assert run_learner(settings, {}, threading.Event()) == 0
    kept = list_checkpoints(FilesystemStore(ckpt))
    assert len(kept) == 3  # a periodic one may be skipped while the one before is written
    assert kept[-1] == 12
    assert all(step % 2 == 0 for step in kept)
    assert sorted(p.name for p in ckpt.iterdir()) == [f"ckpt-{s:010d}" for s in kept]
