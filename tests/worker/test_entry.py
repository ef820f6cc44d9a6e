from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from diloco_core.config import DataSettings, DiLoCoSettings
from diloco_testbed.process import ManagedProcess
from diloco_testbed.waiting import wait_for
from diloco_worker.data import Shard
from diloco_worker.entry import EntryPointError, TaskContext, TrainingTask, count_tokens, load_task
from diloco_worker.learner import run_learner
from diloco_worker.settings import WorkerSettings

from tests.worker.helpers import SECRET, TINY, TINY_FLAGS, Synchronizer, clean_env, tiny_train

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

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
        diloco=DiLoCoSettings(inner_steps=4, fragments=1, overlap=1),
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


@pytest.mark.integration
@pytest.mark.slow
def test_the_example_user_model_trains_through_diloco_worker_against_a_synchronizer(tmp_path: Path) -> None:
    """examples/user_model.py, named on the command line, trains with a real synchronizer: the loop
    counts its tokens with its own ``tokens_of``, evaluates its held-out batches, and its outer
    gradients are merged into new global versions."""
    from diloco_worker.metrics import read_metrics

    # outer lr 1 without momentum or warm-up, nothing quantized: with a single learner every merge is
    # that learner's own parameters, so the held-out loss must fall (Nesterov on one learner's rounds
    # overshoots on a run this short; the outer optimizer and the codecs have their own tests)
    flat = ["--outer-lr", "1", "--outer-momentum", "0", "--outer-warmup", "0", "--codec", "fp32",
            "--no-error-feedback", "--down-codec", "fp32"]  # fmt: skip
    sync = Synchronizer(tmp_path, inner_steps=8, fragments=2, extra=flat)
    sync.start()
    metrics = tmp_path / "user.jsonl"
    path = os.pathsep.join(p for p in (str(EXAMPLES), os.environ.get("PYTHONPATH", "")) if p)
    argv = [
        sys.executable, "-m", "diloco", "worker", "--sync-url", sync.url, "--learner-id", "user",
        "--job-secret", SECRET, "--metrics-file", str(metrics), *TINY_FLAGS,
        "--entry-point", "user_model:build", "--block-size", "8", "--n-embd", "64",
        "--inner-steps", "8", "--fragments", "2", "--overlap", "1",
        "--max-steps", "120", "--lr", "3e-3", "--warmup-steps", "5", "--eval-every", "20",
    ]  # fmt: skip
    learner = ManagedProcess("user", argv, tmp_path / "user.log", env=clean_env({"PYTHONPATH": path}))
    try:
        learner.start()
        wait_for(lambda: not learner.running() or None, timeout=400, what="the learner finishes")
        assert learner.returncode() == 0, learner.failure_report()
        records = read_metrics(metrics)
        last = records[-1]
        assert last["step"] == 120
        assert last["tokens"] == 120 * 8  # one predicted byte per row: --batch-size 8 per step
        evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
        assert len(evals) >= 2
        assert evals[-1] < evals[0]
        assert min(sync.versions().values()) >= 2
        (status,) = sync.status()["learners"]
        assert (status["learner_id"], status["state"], status["step"]) == ("user", "left", 120)
        assert status["bytes_sent"] > 0
    finally:
        learner.stop()
        sync.stop()


DICT_BATCH_MODULE = """
import itertools
from types import SimpleNamespace
import torch

class CausalLM(torch.nn.Module):
    # the Hugging Face calling convention: model(**batch) returns an object with .loss
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 8)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.view(-1, 8), labels.view(-1)))

def build(ctx):
    torch.manual_seed(ctx.model.seed)

    def batches(start):
        for i in itertools.count(start):
            ids = torch.randint(0, 8, (4, 6), generator=torch.Generator().manual_seed(i))
            yield {"input_ids": ids, "labels": (ids + 1) % 8}

    return CausalLM(), lambda m, batch: m(**batch).loss, batches
"""


def test_dict_batches_and_model_call_loss_train_as_in_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "dict_task.py").write_text(DICT_BATCH_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    metrics = tmp_path / "m.jsonl"
    settings = WorkerSettings(
        standalone=True,
        model=TINY.model_copy(update={"entry_point": "dict_task:build"}),
        train=tiny_train(max_steps=60).model_copy(update={"lr": 0.05}),
        diloco=DiLoCoSettings(inner_steps=4, fragments=1, overlap=1),
        metrics_file=str(metrics),
        log_every=10,
    )
    assert run_learner(settings, {}, threading.Event()) == 0
    from diloco_worker.metrics import read_metrics

    records = read_metrics(metrics)
    assert records[-1]["tokens"] == 60 * 4 * 6  # input_ids counted
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    # what a tracker shows next to the loss: the step's learning rate and gradient norm (before clipping)
    from diloco_worker.train import lr_at

    assert records[-1]["lr"] == pytest.approx(lr_at(59, settings.train))
    assert all(r["grad_norm"] > 0 for r in records)


@pytest.mark.parametrize(
    ("batch", "tokens"),
    [
        ({"input_ids": torch.zeros(2, 5), "attention_mask": torch.ones(2, 5)}, 10),
        ({"x": torch.zeros(3, 4)}, 12),
        ((torch.zeros(2, 7), torch.zeros(2, 7)), 14),
        (torch.zeros(6), 6),
    ],
)
def test_tokens_are_counted_from_the_inputs(batch: object, tokens: int) -> None:
    assert count_tokens(batch) == tokens


def test_a_batch_whose_tokens_cannot_be_counted_says_what_to_give() -> None:
    with pytest.raises(TypeError, match="give the task a tokens_of"):
        count_tokens({"text": "not a tensor"})
