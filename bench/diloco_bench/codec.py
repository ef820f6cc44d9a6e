"""Benchmark `codec`: wire size, speed and error of each quantizer on real outer gradients.

Trains a small byte-level model on the Python standard library's sources (warm-up steps, then H
inner steps from an anchor), takes the outer gradient ``anchor - params`` of every tensor, and for
each quantizer reports bytes per parameter after zstd, encode and decode throughput in MB/s of
float32 input, and the relative error ``||decode(encode(g)) - g|| / ||g||``. A ``tensor.clone()`` and
a numpy copy of the same float32 data are timed in the same run, on one thread like the codec, as a
memory-bandwidth baseline. Timings keep the best of ``--repeats`` runs. ``--levels``: each format
at each of these zstd levels as well, in the same run (by default only at the format's own,
``payload_frame.payload_level``).
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diloco_core import codec
from diloco_core.payload_frame import payload_level
from diloco_core.stored_frame import Level
from torch import nn

from diloco_bench import experiment

QUANTIZERS = ("fp32", "bf16", "fp16", "int8", "int4", "e3m0", "int2", "int1", "topk")
CTX = 16


def stdlib_bytes(limit: int) -> torch.Tensor:
    """Up to ``limit`` bytes of the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.tensor(list(b"".join(chunks)[:limit]), dtype=torch.long)


def make_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Embedding(256, 64),
        nn.Flatten(),
        nn.Linear(64 * CTX, width),
        nn.GELU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 256),
    )


def outer_gradients(args: argparse.Namespace) -> dict[str, np.ndarray]:
    torch.manual_seed(args.seed)
    text = stdlib_bytes(2_000_000)
    model = make_model(args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    anchor: dict[str, torch.Tensor] = {}
    loss = torch.tensor(0.0)
    for step in range(args.warmup + args.inner_steps):
        if step == args.warmup:
            anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
        starts = torch.randint(0, len(text) - CTX - 1, (args.batch,), generator=gen)
        x = torch.stack([text[s : s + CTX] for s in starts])
        y = text[starts + CTX]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"trained {args.warmup}+{args.inner_steps} steps, final loss {loss.item():.3f}", file=sys.stderr)
    return {n: (anchor[n] - p.detach()).float().numpy() for n, p in model.named_parameters()}


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(
    grads: dict[str, np.ndarray], repeats: int, levels: Sequence[Level | None] = (None,)
) -> list[dict[str, Any]]:
    numel = sum(g.size for g in grads.values())
    mb = numel * 4 / 1e6
    flat = np.concatenate([g.ravel() for g in grads.values()])
    t = torch.from_numpy(flat)
    rows: list[dict[str, Any]] = [
        {"format": "baseline tensor.clone()", "encode_mb_s": mb / best_seconds(t.clone, repeats)},
        {"format": "baseline numpy copy", "encode_mb_s": mb / best_seconds(flat.copy, repeats)},
    ]
    for q in QUANTIZERS:
        for level in levels:
            encode = partial(
                codec.encode, grads, fragment=0, base_version=0, kind="outer_grad", quantizer=q, level=level
            )
            blob = encode()
            out = codec.decode(blob).tensors
            err = np.sqrt(sum(float(np.sum((out[n] - g) ** 2)) for n, g in grads.items())) / np.linalg.norm(
                flat
            )
            rows.append(
                {
                    "format": q,
                    "level": payload_level(q) if level is None else level,
                    "bytes_per_param": len(blob) / numel,
                    "encode_mb_s": mb / best_seconds(encode, repeats),
                    "decode_mb_s": mb / best_seconds(partial(codec.decode, blob), repeats),
                    "rel_error": float(err),
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]], numel: int) -> None:
    print(
        f"outer gradient: {numel:,} parameters ({numel * 4 / 1e6:.1f} MB in float32); MB/s of float32 input"
    )
    print(
        f"{'format':<24} {'level':>6} {'bytes/param':>11} {'encode MB/s':>12} {'decode MB/s':>12} {'rel. error':>11}"
    )
    for r in rows:
        bpp = f"{r['bytes_per_param']:.3f}" if "bytes_per_param" in r else "-"
        dec = f"{r['decode_mb_s']:.0f}" if "decode_mb_s" in r else "-"
        err = f"{r['rel_error']:.2e}" if "rel_error" in r else "-"
        level = str(r.get("level", "-"))
        print(f"{r['format']:<24} {level:>6} {bpp:>11} {r['encode_mb_s']:>12.0f} {dec:>12} {err:>11}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="diloco bench codec", description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512, help="hidden width of the model")
    parser.add_argument("--warmup", type=int, default=100, help="steps before the anchor")
    parser.add_argument("--inner-steps", type=int, default=50, help="H: steps from the anchor")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timings keep the best of this many runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--levels",
        nargs="+",
        type=int,
        default=None,
        help="zstd levels to run each format at as well as its own (default: its own only)",
    )
    experiment.output_flags(parser, plot=False)
    args = parser.parse_args(argv)
    grads = outer_gradients(args)
    torch.set_num_threads(1)  # the codec runs on one core: compare it with a one-core copy
    rows = measure(grads, args.repeats, [None, *(args.levels or [])])
    numel = sum(g.size for g in grads.values())
    print_table(rows, numel)
    experiment.write_json(args.json, {"num_params": numel, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
