"""A learner on the torch (device) path against a real synchronizer, on the CPU: it trains exactly
as a learner on the numpy path does (its payloads are the same bytes, so the global versions are
too), and k steps + a restart from its checkpoint + the rest give the same result as one run.

Synchronous DiLoCo with one learner (``--blocking-sync``, quorum 1, no overlap) makes a run
deterministic: every fragment is merged and taken back at the step it falls due. The restart is at
a step where a round just closed (fragment 0's second): a learner that rejoins a synchronous job
takes its place in the round cycle from the global versions (``lockstep``), which put it just after
the newest merge, so a restart between two merges would repeat the steps since then.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from diloco_core.auth import learner_token
from diloco_core.config import DiLoCoSettings
from diloco_core.storage import FilesystemStore
from diloco_worker.checkpoint import load_latest
from diloco_worker.learner import run_learner
from diloco_worker.settings import WorkerSettings

from tests.worker.helpers import CORPUS_BYTES, SECRET, TINY, Synchronizer, tiny_train

pytestmark = [pytest.mark.integration, pytest.mark.slow]
H, P, STEPS = 4, 2, 14


def _settings(sync_url: str, ckpt: Path, compute: str, **kw: object) -> WorkerSettings:
    return WorkerSettings(
        sync_url=sync_url,
        learner_id="a",
        token=learner_token(SECRET, "a"),
        diloco=DiLoCoSettings(inner_steps=H, fragments=P, overlap=0),
        model=TINY,
        train=tiny_train(max_steps=STEPS),
        corpus_max_bytes=CORPUS_BYTES,
        checkpoint_dir=str(ckpt),
        threads=1,
        blocking_sync=True,
        poll_wait_s=2.0,
        sync_compute=compute,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _run(tmp: Path, name: str, compute: str, codec: str, *, split_at: int = 0) -> dict[str, torch.Tensor]:
    """Train STEPS steps (leaving and resuming at ``split_at`` when given) against a fresh
    synchronizer; the learner's final parameters, optimizer state and anchors."""
    folder = tmp / name
    sync = Synchronizer(folder, inner_steps=H, fragments=P, overlap=0, quorum=1, extra=["--codec", codec])
    sync.start()
    try:
        ckpt = folder / "ckpt"
        if split_at:
            assert (
                run_learner(_settings(sync.url, ckpt, compute, stop_at_step=split_at), {}, threading.Event())
                == 0
            )
        assert run_learner(_settings(sync.url, ckpt, compute), {}, threading.Event()) == 0
        assert min(sync.versions().values()) >= 2  # every fragment went through rounds
    finally:
        sync.stop()
    loaded = load_latest(FilesystemStore(ckpt))
    assert loaded is not None
    assert loaded.step == STEPS
    return {k: v for k, v in loaded.tensors.items() if k.startswith(("param/", "optim/", "anchor/"))}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("codec", ["int4", "e3m0"])
def test_the_device_path_trains_exactly_as_the_reference_and_resumes_exactly(
    tmp_path: Path, codec: str
) -> None:
    reference = _run(tmp_path, "numpy", "numpy", codec)
    device = _run(tmp_path, "torch", "torch", codec)
    _assert_same(reference, device)
    resumed = _run(tmp_path, "torch-split", "torch", codec, split_at=8)
    _assert_same(device, resumed)
