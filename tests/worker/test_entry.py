from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from diloco_core.config import DataSettings
from diloco_worker.data import Shard
from diloco_worker.entry import EntryPointError, TaskContext, TrainingTask, load_task
from diloco_worker.learner import run_learner
from diloco_worker.settings import WorkerSettings

from tests.worker.helpers import TINY, tiny_train

USER_MODULE = """
import itertools
import torch

def build(ctx):
    torch.manual_seed(ctx.model.seed)
    model = torch.nn.Linear(4, 1)
    target = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def batches(start):
        for i in itertools.count(start):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(16, 4, generator=g)
            yield x, x @ target

    def loss_fn(m, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(m(x), y)

    return model, loss_fn, batches

def not_a_task(ctx):
    return 42
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_user_task.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_user_task"


def _ctx(entry: str) -> TaskContext:
    return TaskContext(
        TINY.model_copy(update={"entry_point": entry}),
        DataSettings(),
        tiny_train(),
        Shard(0, 1, "a"),
        torch.device("cpu"),
        100_000,
    )


def test_a_user_entry_point_trains_through_the_same_loop(user_module: str, tmp_path: Path) -> None:
    task = load_task(_ctx(f"{user_module}:build"))
    assert isinstance(task, TrainingTask)
    settings = WorkerSettings(
        standalone=True,
        model=TINY.model_copy(update={"entry_point": f"{user_module}:build"}),
        train=tiny_train(max_steps=200).model_copy(update={"lr": 0.1, "weight_decay": 0.0, "grad_clip": 0.0}),
        checkpoint_dir=str(tmp_path / "ck"),
        plan={"inner_steps": 4, "fragments": 1, "overlap": 1},
    )
    assert run_learner(settings, {}, threading.Event()) == 0
    from diloco_core.storage import FilesystemStore
    from diloco_worker.checkpoint import load_latest

    ckpt = load_latest(FilesystemStore(tmp_path / "ck"))
    assert ckpt is not None
    w = ckpt.tensors["param/weight"]
    assert torch.allclose(w, torch.tensor([[1.0, -2.0, 0.5, 3.0]]), atol=0.2)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("no_colon", "must look like 'package.module:function'"),
        ("surely_missing_module_xyz:f", "cannot import module"),
        ("my_user_task:missing", "has no callable 'missing'"),
        ("my_user_task:not_a_task", "returned int"),
    ],
)
def test_bad_entry_points_are_explained(user_module: str, entry: str, message: str) -> None:
    with pytest.raises(EntryPointError, match=message):
        load_task(_ctx(entry))
