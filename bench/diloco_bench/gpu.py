"""Benchmark `gpu`: the built-in model on a CUDA device — training tokens/s and a short real run.

Measures inner-step throughput (AdamW, bf16 autocast, the worker's training step) of a larger
built-in GPT, the cost of one DiLoCo sync of the whole model on the learner side (outer gradient to
host memory + int4 encoding with ``diloco_core.codec``), and trains for ``--train-steps`` steps on the
stdlib corpus reporting the held-out loss before and after. Without a CUDA device it says so and
exits 0 without measuring anything.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from diloco_core import codec
from diloco_core.config import ModelSettings, TrainSettings
from diloco_worker.data import BatchStream, Shard, eval_batches, load_corpus, split_corpus
from diloco_worker.model import build_gpt, lm_loss
from diloco_worker.train import lr_at, make_optimizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco bench gpu", description=__doc__)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--timed-steps", type=int, default=30, help="steps timed for tokens/s (after 5 warm-up)")
    p.add_argument("--train-steps", type=int, default=300, help="steps of the short training run")
    p.add_argument("--codec", default="int4", help="quantizer of the timed sync")
    return p


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
         i: int, cfg: TrainSettings) -> None:  # fmt: skip
    for g in opt.param_groups:
        g["lr"] = lr_at(i, cfg)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = lm_loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = [float(lm_loss(model, b)) for b in batches]
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("diloco bench gpu: no CUDA device visible to PyTorch here; nothing measured (skipped)")
        return 0
    dev = torch.device("cuda")
    ms = ModelSettings(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size)
    model = build_gpt(ms).to(dev)
    cfg = TrainSettings(batch_size=a.batch_size, lr=a.lr, warmup_steps=min(50, a.train_steps // 5),
                        max_steps=a.train_steps)  # fmt: skip
    opt = make_optimizer(model, cfg)
    train, held = split_corpus(load_corpus("stdlib", 16 * 1024 * 1024), 0.02)
    stream = BatchStream(train, Shard(0, 1, "gpu"), batch_size=a.batch_size, block_size=a.block_size, seed=0, device=dev)
    evals = eval_batches(held, batch_size=a.batch_size, block_size=a.block_size, max_batches=8, device=dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device: {torch.cuda.get_device_name(dev)}; model {a.n_layer}x{a.n_embd}, {n_params:,} parameters")
    start_loss = held_out_loss(model, evals)
    for i in range(a.train_steps):
        if i == 5:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        step(model, opt, next(stream), i, cfg)
        if i == 5 + a.timed_steps:
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tps = a.timed_steps * a.batch_size * a.block_size / dt
            print(f"inner step: {1000 * dt / a.timed_steps:.1f} ms, {tps:,.0f} tokens/s", flush=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    anchor = {n: p.detach().float().cpu().numpy() for n, p in model.named_parameters()}
    blob = codec.encode(anchor, fragment=0, base_version=0, kind="outer_grad", quantizer=a.codec)
    sync_s = time.perf_counter() - t1
    print(f"whole-model sync on the learner (to host + {a.codec} encode): {sync_s:.2f} s, {len(blob):,} bytes")
    end_loss = held_out_loss(model, evals)
    print(f"held-out loss: {start_loss:.4f} -> {end_loss:.4f} after {a.train_steps} steps "
          f"({a.train_steps * a.batch_size * a.block_size:,} tokens)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
