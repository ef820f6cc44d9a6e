"""`diloco bench gpu`: the learner's inner step and DiLoCo step boundary on a device.

Default size: the built-in GPT at 12 layers x 768, context 1024, batch 16 (GPT-2 small's shape
over bytes), bf16 autocast, the worker's optimizer (fused AdamW on CUDA). Measures, in one run:

1. the plain inner step, eager and under ``torch.compile`` (``--no-compile`` skips it): ms per
   step, tokens/s and MFU against the device's dense bf16 peak (``--peak-tflops`` to set it), and
   the compiler's start-up time. The loop is the worker's: no host synchronisation within a step,
   the loss read once at the end, batches from pinned memory.
2. the step boundary of the learner's device path (``diloco_worker.device_anchors.DeviceAnchors``) for
   every fragment of a ``--fragments`` plan: the training thread's time to queue ``anchor -
   params`` + quantization + the copy to pinned memory, the time until that is done (side
   stream), hence G parameters/s of the quantizer; and applying a global version (the poller's
   staging, the training thread's part). Next to it the numpy path (``HostAnchors``): copying the
   parameters to the host and subtracting (training thread) and quantizing them (sender thread).
3. a short training run (``--train-steps``; 0 skips it): held-out loss before and after.

``--device cpu`` runs every part on the CPU (pass a small model: the defaults are sized for a
GPU); without a CUDA device ``--device cuda`` says so and exits 0 without measuring anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diloco_core import codec
from diloco_core.config import ModelSettings, TrainSettings
from diloco_core.fragments import build_plan
from diloco_worker.anchors import HostAnchors
from diloco_worker.data import BatchStream, Shard, eval_batches, load_corpus, split_corpus
from diloco_worker.device_anchors import DeviceAnchors
from diloco_worker.hardware import peak_flops
from diloco_worker.model import EMBEDDING_NAMES, build_gpt, flops_per_token, lm_loss
from diloco_worker.train import autocast_for, lr_at, make_optimizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="diloco bench gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed steps before each timing")
    p.add_argument("--timed-steps", type=int, default=20, help="steps timed for tokens/s")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile measurement")
    p.add_argument("--fragments", type=int, default=4, help="P of the boundary measurement")
    p.add_argument("--codec", default="int4", help="quantizer of the boundary measurement")
    p.add_argument("--boundaries", type=int, default=5, help="boundaries timed per fragment")
    p.add_argument("--train-steps", type=int, default=0, help="steps of a short training run (0: none)")
    p.add_argument(
        "--peak-tflops", type=float, default=0.0, help="peak TFLOP/s for MFU (default: known GPUs)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: PyTorch's default)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    i: int,
    cfg: TrainSettings,
    device: torch.device,
) -> torch.Tensor:
    """The worker's inner step (one micro-batch): the loss stays on the device."""
    for g in opt.param_groups:
        g["lr"] = lr_at(i, cfg)
    with autocast_for(device):
        loss = lm_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    out: torch.Tensor = loss.detach()
    return out


def time_steps(
    a: argparse.Namespace,
    model: torch.nn.Module,
    device: torch.device,
    stream: BatchStream,
    cfg: TrainSettings,
) -> dict[str, float]:
    """Warm-up (the first step compiles a compiled model), then the timed steps."""
    opt = make_optimizer(model, cfg)
    t0 = time.perf_counter()
    _step(model, opt, next(stream), 0, cfg, device)
    _sync(device)
    first = time.perf_counter() - t0
    for i in range(1, a.warmup_steps):
        _step(model, opt, next(stream), i, cfg, device)
    _sync(device)
    t0 = time.perf_counter()
    losses = [_step(model, opt, next(stream), a.warmup_steps + i, cfg, device) for i in range(a.timed_steps)]
    float(torch.stack(losses).sum())  # the host waits for the device once, here
    dt = time.perf_counter() - t0
    return {
        "first_step_s": first,
        "step_ms": 1000 * dt / a.timed_steps,
        "tokens_per_s": a.timed_steps * a.batch_size * a.block_size / dt,
    }


def _median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def time_boundaries(
    a: argparse.Namespace, model: torch.nn.Module, device: torch.device
) -> list[dict[str, Any]]:
    """Per fragment: the device path's and the numpy path's costs at a step boundary."""
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = build_plan(named, a.fragments, 16, 1, embedding_names=EMBEDDING_NAMES)
    params = dict(model.named_parameters())
    dev, host = DeviceAnchors(plan, params, device), HostAnchors(plan, params)
    rows = []
    for f in plan.fragments:
        queue, done, stage, apply, to_host, encode = [], [], [], [], [], []
        for _ in range(a.boundaries):
            _sync(device)
            t0 = time.perf_counter()
            snap = dev.outer_gradient(f.index, a.codec)
            t1 = time.perf_counter()
            if snap.done is not None:
                snap.done.synchronize()
            t2 = time.perf_counter()
            queue.append(t1 - t0)
            done.append(t2 - t0)
            glob = dev.arrays(f.index)
            t0 = time.perf_counter()
            staged = dev.stage(f.index, glob)
            if staged.ready is not None:
                staged.ready.synchronize()
            t1 = time.perf_counter()
            dev.apply(f.index, staged, 0.0)
            t2 = time.perf_counter()
            _sync(device)
            stage.append(t1 - t0)
            apply.append(t2 - t1)
            t0 = time.perf_counter()
            delta = host.outer_gradient(f.index, a.codec)
            t1 = time.perf_counter()
            codec.encode(
                delta, fragment=f.index, base_version=0, kind="outer_grad", quantizer=a.codec, level=1
            )
            t2 = time.perf_counter()
            to_host.append(t1 - t0)
            encode.append(t2 - t1)
        rows.append(
            {
                "fragment": f.index,
                "params": f.numel,
                "anchor_memory": dev.placement,
                "device_queue_ms": _median_ms(queue),
                "device_done_ms": _median_ms(done),
                "device_gparams_per_s": f.numel / statistics.median(done) / 1e9,
                "stage_ms": _median_ms(stage),
                "apply_ms": _median_ms(apply),
                "numpy_training_thread_ms": _median_ms(to_host),
                "numpy_encode_with_zstd_ms": _median_ms(encode),
            }
        )
    return rows


@torch.no_grad()
def held_out_loss(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> float:
    model.eval()
    with autocast_for(device):
        losses = [float(lm_loss(model, b)) for b in batches]
    model.train()
    return sum(losses) / len(losses)


def _mfu(tokens_per_s: float, fpt: float, peak: float | None) -> str:
    return f"{100 * tokens_per_s * fpt / peak:.1f} %" if peak else "n/a (peak unknown: --peak-tflops)"


def open_device(prog: str, name: str, threads: int) -> torch.device | None:
    """The device a benchmark asked for, or None (after saying so) when it is a GPU and there is none;
    ``threads`` torch CPU threads (0: PyTorch's default)."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: no CUDA device visible to PyTorch here; nothing measured (skipped)")
        return None
    if threads:
        torch.set_num_threads(threads)
    return device


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    device = open_device("diloco bench gpu", a.device, a.threads)
    if device is None:
        return 0
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    ms = ModelSettings(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size)
    cfg = TrainSettings(batch_size=a.batch_size, lr=a.lr, warmup_steps=10, max_steps=max(100, a.train_steps))
    train, held = split_corpus(load_corpus("stdlib", 16 * 1024 * 1024), 0.02)

    def stream() -> BatchStream:
        return BatchStream(
            train, Shard(0, 1, "gpu"), batch_size=a.batch_size, block_size=a.block_size, seed=0, device=device
        )

    model = build_gpt(ms).to(device)
    fpt, peak = flops_per_token(model), peak_flops(device, a.peak_tflops)
    n_params = sum(p.numel() for p in model.parameters())
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    print(
        f"device: {name}; PyTorch {torch.__version__}; model {a.n_layer}x{a.n_embd}, context {a.block_size}, "
        f"batch {a.batch_size}: {n_params:,} parameters, {fpt / 1e6:,.1f} MFLOP per token"
    )
    figures: dict[str, Any] = {"device": name, "params": n_params, "flops_per_token": fpt, "peak_flops": peak}
    eager = time_steps(a, model, device, stream(), cfg)
    figures["eager"] = eager
    print(
        f"\ninner step, eager: {eager['step_ms']:.1f} ms, {eager['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {_mfu(eager['tokens_per_s'], fpt, peak)}"
    )
    if not a.no_compile:
        compiled_model = torch.compile(build_gpt(ms).to(device))
        compiled = time_steps(a, compiled_model, device, stream(), cfg)  # type: ignore[arg-type]
        figures["compiled"] = compiled
        print(
            f"inner step, torch.compile: {compiled['step_ms']:.1f} ms, {compiled['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {_mfu(compiled['tokens_per_s'], fpt, peak)}; start-up (first step) {compiled['first_step_s']:.1f} s"
        )
        del compiled_model
    rows = time_boundaries(a, model, device)
    figures["boundary"] = rows
    print(f"\nstep boundary, {a.codec}, P = {a.fragments} (medians of {a.boundaries}; ms):")
    print(
        "| fragment | params | anchors | device path: training thread | until in pinned memory | quantizer G params/s "
        "| apply: staging (poller) | apply: training thread | numpy path: training thread | numpy: quantize + zstd (sender) |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['fragment']} | {r['params']:,} | {r['anchor_memory']} | {r['device_queue_ms']:.2f} | "
            f"{r['device_done_ms']:.2f} | {r['device_gparams_per_s']:.3f} | {r['stage_ms']:.2f} | {r['apply_ms']:.2f} | "
            f"{r['numpy_training_thread_ms']:.1f} | {r['numpy_encode_with_zstd_ms']:.1f} |"
        )
    if a.train_steps:
        figures["training"] = short_run(a, ms, cfg, device, stream(), held)
    if a.json:
        a.json.write_text(json.dumps(figures, indent=2))
    return 0


def short_run(
    a: argparse.Namespace,
    ms: ModelSettings,
    cfg: TrainSettings,
    device: torch.device,
    batches: BatchStream,
    held: np.ndarray,
) -> dict[str, float]:
    model = build_gpt(ms).to(device)
    opt = make_optimizer(model, cfg)
    evals = eval_batches(held, batch_size=a.batch_size, block_size=a.block_size, max_batches=8, device=device)
    start = held_out_loss(model, evals, device)
    step: Callable[[int], torch.Tensor] = lambda i: _step(model, opt, next(batches), i, cfg, device)  # noqa: E731
    for i in range(a.train_steps):
        step(i)
    end = held_out_loss(model, evals, device)
    print(
        f"\nheld-out loss: {start:.4f} -> {end:.4f} after {a.train_steps} steps "
        f"({a.train_steps * a.batch_size * a.block_size:,} tokens)"
    )
    return {"start_loss": start, "end_loss": end, "steps": float(a.train_steps)}


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
