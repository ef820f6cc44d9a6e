"""The inner step's options keep resume exact and the CPU's numbers as they were: fused or foreach
AdamW, the loss read only at logged steps, torch.compile; step times, FLOPs and MFU."""

from __future__ import annotations

import logging
import math
import shutil
import threading
from pathlib import Path

import pytest
import torch
from diloco_core.config import TrainSettings
from diloco_core.storage import FilesystemStore
from diloco_worker.checkpoint import list_checkpoints, load_latest
from diloco_worker.data import BatchStream, Shard, load_corpus
from diloco_worker.hardware import peak_flops, peak_tflops_of
from diloco_worker.learner import run_learner
from diloco_worker.metrics import read_metrics
from diloco_worker.model import build_gpt, flops_per_token
from diloco_worker.settings import WorkerSettings
from diloco_worker.train import (
    LoopState,
    StepClock,
    _clip_and_step,
    adamw_impl,
    autocast_dtype,
    lr_at,
    make_grad_scaler,
    make_optimizer,
)

from tests.worker.helpers import CORPUS_BYTES, TINY, tiny_train


def _settings(ckpt: Path, **kw: object) -> WorkerSettings:
    return WorkerSettings(
        standalone=True,
        model=TINY,
        train=kw.pop("train", tiny_train(max_steps=12, grad_accum=2)),
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


# --- learning-rate schedules: warm-up end, plateau, decay start and end -------------------------


def _schedule(name: str, **kw: object) -> TrainSettings:
    return TrainSettings(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, max_steps=110, lr_schedule=name, **kw)  # type: ignore[arg-type]


def test_the_cosine_schedule_is_the_one_it_always_was() -> None:
    cfg = _schedule("cosine")
    assert TrainSettings().lr_schedule == "cosine"
    assert [lr_at(s, cfg) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # warm-up
    assert lr_at(10, cfg) == 1.0  # decay starts at the warm-up's end
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half way: the mean of lr and its floor
    assert lr_at(110, cfg) == pytest.approx(0.1)
    for step in (0, 9, 10, 37, 60, 109, 110, 500):  # byte for byte the formula it has always been
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        floor = cfg.lr * cfg.min_lr_ratio
        want = floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))
        assert lr_at(step, cfg) == (cfg.lr * (step + 1) / cfg.warmup_steps if step < 10 else want)


def test_wsd_holds_lr_then_decays_linearly_over_the_last_decay_fraction() -> None:
    cfg = _schedule("wsd", decay_fraction=0.2)  # the decay takes steps 88..110
    assert [lr_at(s, cfg) for s in (0, 9)] == pytest.approx([0.1, 1.0])  # the same warm-up
    assert lr_at(10, cfg) == 1.0  # the plateau
    assert lr_at(50, cfg) == 1.0
    assert lr_at(87, cfg) == 1.0
    assert lr_at(88, cfg) == 1.0  # the decay starts
    assert lr_at(99, cfg) == pytest.approx(1.0 - 0.9 * 11 / 22)  # linear
    assert lr_at(110, cfg) == pytest.approx(0.1)  # ends at lr x min_lr_ratio
    assert lr_at(1000, cfg) == pytest.approx(0.1)
    whole = _schedule("wsd", decay_fraction=1.0)  # no plateau: the decay starts where the warm-up ends
    assert lr_at(10, whole) == 1.0
    assert lr_at(60, whole) == pytest.approx(0.55)
    assert lr_at(110, whole) == pytest.approx(0.1)


def test_the_constant_schedule_stays_at_lr_after_the_warm_up() -> None:
    cfg = _schedule("constant")
    assert [lr_at(s, cfg) for s in (0, 9)] == pytest.approx([0.1, 1.0])
    assert {lr_at(s, cfg) for s in (10, 60, 109, 110, 5000)} == {1.0}


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_the_decay_fraction_is_a_share_of_the_steps(bad: float) -> None:
    with pytest.raises(ValueError, match="decay_fraction"):
        TrainSettings(decay_fraction=bad)


# --- precision -----------------------------------------------------------------------------------


def test_autocast_dtype_of_each_precision() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert TrainSettings().precision == "auto"
    assert (autocast_dtype(cpu), autocast_dtype(cuda)) == (None, torch.bfloat16)  # what it always was
    assert {p: autocast_dtype(cpu, p) for p in ("bf16", "fp16", "fp32")} == {
        "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None,
    }  # fmt: skip
    assert autocast_dtype(cuda, "fp32") is None
    assert make_grad_scaler(cpu, "bf16") is None
    assert make_grad_scaler(cpu, "fp16") is not None


def test_fp32_on_a_cpu_is_the_auto_default_exactly(tmp_path: Path) -> None:
    auto, fp32 = tmp_path / "auto", tmp_path / "fp32"
    fp32_train = tiny_train(12, grad_accum=2, precision="fp32")
    assert run_learner(_settings(auto, eval_every=6), {}, threading.Event()) == 0
    assert run_learner(_settings(fp32, eval_every=6, train=fp32_train), {}, threading.Event()) == 0
    _assert_same(_final(auto), _final(fp32))
    losses = [
        [(r["step"], r["loss"], r["eval_loss"]) for r in read_metrics(tmp_path / f"{name}.jsonl")]
        for name in ("auto", "fp32")
    ]
    assert losses[0] == losses[1]
    assert any(e is not None for _, _, e in losses[0])  # evaluate() ran, in the same precision


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(path)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_learner_trains_in_half_precision_on_a_cpu(tmp_path: Path, precision: str) -> None:
    ckpt = tmp_path / precision
    train = tiny_train(30, grad_accum=1, precision=precision)
    assert run_learner(_settings(ckpt, train=train, log_every=1, eval_every=10), {}, threading.Event()) == 0
    losses = _losses(tmp_path / f"{precision}.jsonl")
    assert len(losses) == 30
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    loaded = load_latest(FilesystemStore(ckpt))
    assert loaded is not None
    assert all(v.dtype == torch.float32 for k, v in loaded.tensors.items() if k.startswith("param/"))
    scaler = loaded.meta["loop"]["grad_scaler"]
    assert (scaler is None) == (precision == "bf16")


def test_fp16_resumes_exactly_with_its_loss_scale_from_the_checkpoint(tmp_path: Path) -> None:
    a, b = _straight_and_split(tmp_path, train=tiny_train(12, grad_accum=2, precision="fp16"))
    _assert_same(a, b)
    for run in ("straight", "split"):
        loaded = load_latest(FilesystemStore(tmp_path / run))
        assert loaded is not None
        scaler = loaded.meta["loop"]["grad_scaler"]
        assert scaler["_growth_tracker"] == 12  # steps since the scale last changed: 5 + 7 after resuming
        assert scaler["scale"] == 65536.0


def test_fp16_unscales_before_clipping_and_skips_a_step_whose_gradients_overflow() -> None:
    cfg = tiny_train(grad_clip=0.5, precision="fp16")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(8, 4)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    (reference(x) ** 2).mean().backward()
    want_norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_grad_scaler(torch.device("cpu"), "fp16")
    assert scaler is not None
    scaler.scale((model(x) ** 2).mean()).backward()
    norm = _clip_and_step(optimizer, list(model.parameters()), cfg, scaler)
    assert norm is not None
    assert float(norm) == pytest.approx(float(want_norm), rel=1e-5)  # the true norm, not the scaled one
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.data, q.data - 0.1 * q.grad, atol=1e-6)  # type: ignore[operator]

    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale((model(x) ** 2).mean()).backward()
    model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
    _clip_and_step(optimizer, list(model.parameters()), cfg, scaler)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))  # skipped
    assert scaler.get_scale() == 65536.0 / 2  # and the scale backed off
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_a_learner_on_cuda_trains_in_each_precision(tmp_path: Path, precision: str) -> None:
    ckpt = tmp_path / precision
    train = tiny_train(30, grad_accum=1, precision=precision)
    assert run_learner(_settings(ckpt, device="cuda", train=train, log_every=1), {}, threading.Event()) == 0
    losses = _losses(tmp_path / f"{precision}.jsonl")
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    loaded = load_latest(FilesystemStore(ckpt))
    assert loaded is not None
    assert (loaded.meta["loop"]["grad_scaler"] is None) == (precision != "fp16")
