"""`diloco bench checkpoint`: what a learner's checkpoint costs its training thread, same run.

A learner's state (the built-in GPT on ``--device``, AdamW after a step, the anchor store the
learner would use there, error-feedback residuals, a held global version of every fragment) is
checkpointed to a local folder ``--repeats`` times in two ways, alternately:

- *whole save on the training thread*: ``checkpoint.save_checkpoint`` (copy, serialise, store), what
  the training loop paid per checkpoint before checkpoints were written in the background;
- *snapshot*: ``checkpoint.snapshot_checkpoint`` handed to a ``CheckpointWriter``, what it pays now
  (the copy); the background write's own time is reported beside it.

Medians of the repeats, and their ratio (the training thread's time per checkpoint before / now).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from diloco_core.config import ModelSettings, TrainSettings
from diloco_core.fragments import build_plan
from diloco_core.storage import FilesystemStore
from diloco_worker.anchors import build_anchor_store
from diloco_worker.checkpoint import CheckpointWriter, save_checkpoint, snapshot_checkpoint
from diloco_worker.fragment_state import FragmentState
from diloco_worker.model import EMBEDDING_NAMES, build_gpt
from diloco_worker.train import make_optimizer

from diloco_bench.gpu import open_device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def learner_state(a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """A learner's checkpointed state after one step and one contribution of every fragment."""
    model = build_gpt(
        ModelSettings(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size)
    )
    model.to(device)
    opt = make_optimizer(model, TrainSettings())
    x = torch.randint(0, 256, (2, a.block_size), device=device)
    model(x).float().mean().backward()
    opt.step()
    named = [(n, tuple(t.shape)) for n, t in model.named_parameters()]
    plan = build_plan(named, a.fragments, 16, 1, embedding_names=EMBEDDING_NAMES)
    fs = FragmentState.for_model(plan, model, lambda pl, params: build_anchor_store(pl, params, device))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    for p in range(len(plan.fragments)):  # residuals exist, as with the default error feedback
        fs.take_contribution(p, "int2", error_feedback=True).encode("int2")
    held = {p: (0, arrays) for p, arrays in fs.anchors.items()}
    params = sum(t.numel() for t in model.parameters())
    return {"model": model, "optimizer": opt, "fs": fs, "held": held, "params": params}


def measure(a: argparse.Namespace, device: torch.device, folder: Path) -> dict[str, Any]:
    st = learner_state(a, device)
    model, opt, fs, held = st["model"], st["optimizer"], st["fs"], st["held"]

    def state(step: int) -> dict[str, Any]:
        return {
            "model": model,
            "optimizer": opt,
            "anchors": fs.anchors,
            "residuals": fs.residuals,
            "held": held,
            "meta": {"step": step},
        }

    store = FilesystemStore(folder)
    writes: list[float] = []
    done = threading.Event()

    writer = CheckpointWriter(store, on_written=lambda _step: done.set())
    whole, snap = [], []
    last = None
    for i in range(a.repeats):
        _sync(device)
        t0 = time.perf_counter()
        save_checkpoint(store, **state(2 * i + 1))
        whole.append(time.perf_counter() - t0)
        _sync(device)
        done.clear()
        t0 = time.perf_counter()
        last = snapshot_checkpoint(**state(2 * i + 2))
        writer.submit(last)
        snap.append(time.perf_counter() - t0)
        done.wait()
        writes.append(time.perf_counter() - t0)
    writer.close()
    before, now = statistics.median(whole), statistics.median(snap)
    return {
        "device": str(device),
        "params": st["params"],
        "repeats": a.repeats,
        "whole_save_s": before,
        "snapshot_s": now,
        "snapshot_to_written_s": statistics.median(writes),
        "ratio": before / now if now > 0 else float("inf"),
        "checkpoint_bytes": sum(t.numel() * t.element_size() for t in last.tensors.values()) if last else 0,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="diloco bench checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: PyTorch's default)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return ap


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    device = open_device("diloco bench checkpoint", a.device, a.threads)
    if device is None:
        return 0
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        r = measure(a, device, Path(tmp))
    print(
        f"device: {r['device']}; model {a.n_layer}x{a.n_embd}: {r['params']:,} parameters; "
        f"{r['checkpoint_bytes'] / 2**20:.1f} MiB of tensors per checkpoint; medians of {r['repeats']}"
    )
    print(f"whole save on the training thread: {1000 * r['whole_save_s']:.1f} ms")
    print(
        f"snapshot (the training thread's part now): {1000 * r['snapshot_s']:.1f} ms; "
        f"written {1000 * r['snapshot_to_written_s']:.1f} ms after it began"
    )
    print(f"training-thread time per checkpoint, before / now: {r['ratio']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
