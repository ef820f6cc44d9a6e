"""The inner step's options keep resume exact and the CPU's numbers as they were: fused or foreach
AdamW, the loss read only at logged steps, torch.compile; step times, FLOPs and MFU."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import pytest
import torch
from diloco_core.storage import FilesystemStore
from diloco_worker.checkpoint import list_checkpoints, load_latest
from diloco_worker.data import BatchStream, Shard, load_corpus
from diloco_worker.hardware import peak_flops, peak_tflops_of
from diloco_worker.learner import run_learner
from diloco_worker.metrics import read_metrics
from diloco_worker.model import build_gpt, flops_per_token
from diloco_worker.settings import WorkerSettings
from diloco_worker.train import LoopState, StepClock, adamw_impl, make_optimizer

from tests.worker.helpers import CORPUS_BYTES, TINY, tiny_train


def _settings(ckpt: Path, **kw: object) -> WorkerSettings:
    return WorkerSettings(
        standalone=True,
        model=TINY,
        train=tiny_train(max_steps=12, grad_accum=2),
        checkpoint_dir=str(ckpt),
        corpus_max_bytes=CORPUS_BYTES,
        threads=1,
        metrics_file=str(ckpt.parent / f"{ckpt.name}.jsonl"),
        **kw,  # type: ignore[arg-type]
    )


def _final(ckpt: Path) -> dict[str, torch.Tensor]:
    loaded = load_latest(FilesystemStore(ckpt))
    assert loaded is not None
    return {k: v for k, v in loaded.tensors.items() if k.startswith(("param/", "optim/"))}


def _straight_and_split(tmp: Path, **kw: object) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    straight, split = tmp / "straight", tmp / "split"
    assert run_learner(_settings(straight, **kw), {}, threading.Event()) == 0
    assert run_learner(_settings(split, stop_at_step=5, **kw), {}, threading.Event()) == 0
    assert list_checkpoints(FilesystemStore(split)) == [5]
    assert run_learner(_settings(split, **kw), {}, threading.Event()) == 0
    return _final(straight), _final(split)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert any(k.startswith("optim/") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("adamw", ["fused", "foreach"])
def test_fused_and_foreach_adamw_with_the_loss_read_every_few_steps_resume_exactly(
    tmp_path: Path, adamw: str
) -> None:
    a, b = _straight_and_split(tmp_path, adamw=adamw, log_every=4)
    _assert_same(a, b)


def test_reading_the_loss_only_at_logged_steps_changes_no_number(tmp_path: Path) -> None:
    every = tmp_path / "every"
    third = tmp_path / "third"
    assert run_learner(_settings(every, log_every=1), {}, threading.Event()) == 0
    assert run_learner(_settings(third, log_every=3), {}, threading.Event()) == 0
    by_step = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "every.jsonl")}
    logged = read_metrics(tmp_path / "third.jsonl")
    assert [r["step"] for r in logged] == [1, 3, 6, 9, 12]  # a process's first step carries its start-up
    assert all(r["loss"] == by_step[r["step"]] for r in logged)
    _assert_same(_final(every), _final(third))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile on a CPU needs a C++ compiler (g++ or cc) on PATH")  # fmt: skip
def test_a_compiled_model_resumes_exactly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="diloco_worker.train"):
        a, b = _straight_and_split(tmp_path, compile_model=True, log_every=4)
    _assert_same(a, b)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch.compile")]
    assert len(compiled) == 3  # one per process: straight, first part, rest
    assert "s (compilation included)" in compiled[0]


def test_adamw_is_fused_on_cuda_the_unchanged_loop_on_a_cpu_and_foreach_elsewhere() -> None:
    assert adamw_impl(torch.device("cuda", 0)) == "fused"
    assert adamw_impl(torch.device("cpu")) == "loop"
    assert adamw_impl(torch.device("meta")) == "foreach"
    assert adamw_impl(torch.device("cpu"), "fused") == "fused"
    model = build_gpt(TINY)
    for impl, fused, foreach in (("auto", None, False), ("fused", True, False), ("foreach", None, True)):
        group = make_optimizer(model, tiny_train(), impl).param_groups[0]  # type: ignore[arg-type]
        assert (group["fused"], group["foreach"]) == (fused, foreach), impl


def test_step_clock_reports_each_step_on_a_cpu_and_window_means_elsewhere() -> None:
    state = LoopState()
    cpu, gpu = StepClock(per_step=True, state=state), StepClock(per_step=False, state=state)
    assert gpu.step_time(0.25) == 0.25  # no window closed yet
    state.step, state.tokens = 4, 4000
    gpu.close_window(state)
    cpu.close_window(state)
    assert gpu.window_step_time is not None
    assert gpu.window_step_time > 0
    assert gpu.window_tokens_per_s is not None
    assert gpu.step_time(123.0) == gpu.window_step_time
    assert cpu.step_time(0.5) == 0.5


def test_flops_per_token_of_the_builtin_gpt() -> None:
    model = build_gpt(TINY)
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    c = model.config
    assert flops_per_token(model) == 6 * n + 12 * c.n_layer * c.n_embd * c.block_size
    other = torch.nn.Sequential(torch.nn.Linear(4, 3))
    assert flops_per_token(other) == 6 * 15


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_peak_of_known_gpus(name: str, tflops: float | None) -> None:
    assert peak_tflops_of(name) == tflops


def test_no_peak_on_a_cpu_unless_configured() -> None:
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), 2.5) == 2.5e12


@pytest.mark.gpu
def test_cuda_batches_come_from_pinned_memory_and_equal_the_cpu_ones() -> None:
    data = load_corpus("stdlib", CORPUS_BYTES)
    cpu = BatchStream(data, Shard(0, 1, "a"), batch_size=4, block_size=32, seed=0)
    cuda = BatchStream(
        data, Shard(0, 1, "a"), batch_size=4, block_size=32, seed=0, device=torch.device("cuda")
    )
    for _ in range(3):
        (x, y), (cx, cy) = next(cpu), next(cuda)
        assert cx.is_cuda
        assert torch.equal(x, cx.cpu())
        assert torch.equal(y, cy.cpu())


@pytest.mark.gpu
def test_a_learner_on_cuda_trains_with_fused_adamw_and_reports_mfu_on_a_known_gpu(tmp_path: Path) -> None:
    ckpt = tmp_path / "cuda"
    assert (
        run_learner(_settings(ckpt, device="cuda", log_every=4, peak_tflops=100.0), {}, threading.Event())
        == 0
    )
    records = read_metrics(tmp_path / "cuda.jsonl")
    assert [r["step"] for r in records] == [1, 4, 8, 12]  # a process's first step carries its start-up
    assert all(0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 for r in records)
    loaded = load_latest(FilesystemStore(ckpt))
    assert loaded is not None
    assert loaded.meta["optimizer_groups"][0]["fused"] is True
