"""`diloco bench quantize`: the numpy quantizers (``diloco_core.quantize``, the reference the
synchronizer uses) next to the learner's torch ones (``diloco_worker.torch_quantize``), same run.

For every wire format: parameters per second to quantize (``encode``, until the bytes are in host
memory: for torch on a GPU that includes the copy into pinned memory) and to dequantize
(``decode``, float32 on the device) one fragment of ``--params`` float32 values (default 28 M, a quarter of a 12-layer,
768-wide GPT), with the bytes checked identical. numpy runs on the host; torch on ``--device``
(``cpu``: the synchronizer's question, whether torch would decode contributions faster on its
CPU; ``cuda``: the learner's quantizer, timed with the device synchronised, data already on the
device). zstd is not included: it is the same for both. Best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diloco_core import quantize as q
from diloco_core.fragments import TensorSpec
from diloco_worker import torch_quantize as tq

from diloco_bench.gpu import open_device


def best_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(n: int, device: torch.device, repeats: int, formats: list[str]) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 1e-3).astype(np.float32)  # an outer gradient's scale
    layout = tq.FlatLayout.of([TensorSpec("fragment", (n,))])
    flat = torch.zeros(layout.total, dtype=torch.float32, device=device)
    flat[:n] = torch.from_numpy(x).to(device)
    return [measure_format(name, x, flat, layout, repeats) for name in formats]


def measure_format(
    name: str, x: np.ndarray, flat: torch.Tensor, layout: tq.FlatLayout, repeats: int
) -> dict[str, Any]:
    """One format's four figures (G parameters/s) and whether both wrote the same bytes."""
    device, n = flat.device, x.size

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    values, scales = q.quantize(x, name, layout.block_size)
    out = tq.quantize_flat(flat, name, layout)
    part = layout.parts(name, out.values.cpu().numpy(), out.scales.cpu().numpy())["fragment"]
    identical = bytes(part.values) == values and bytes(part.scales) == scales
    host_v = torch.empty(out.values.numel(), dtype=torch.uint8, pin_memory=device.type == "cuda")
    host_s = torch.empty(out.scales.numel(), dtype=torch.uint8, pin_memory=device.type == "cuda")

    def torch_encode() -> None:  # like numpy's, the result ends as bytes in host memory
        got = tq.quantize_flat(flat, name, layout)
        host_v.copy_(got.values, non_blocking=True)
        host_s.copy_(got.scales, non_blocking=True)

    def as_tensor(b: bytes) -> torch.Tensor:
        return (
            torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
        ).to(device)

    dv, ds = as_tensor(values), as_tensor(scales)
    timings = {
        "numpy_encode": best_seconds(lambda: q.quantize(x, name, layout.block_size), repeats, sync),
        "torch_encode": best_seconds(torch_encode, repeats, sync),
        "numpy_decode": best_seconds(lambda: q.dequantize(values, scales, name, n, layout.block_size), repeats, sync),
        "torch_decode": best_seconds(lambda: tq.dequantize(dv, ds, name, n, layout.block_size), repeats, sync),
    }  # fmt: skip
    return {"format": name, "identical": identical, **{k: n / v / 1e9 for k, v in timings.items()}}


def table(rows: list[dict[str, Any]], device: torch.device) -> str:
    head = (
        f"| format | numpy encode | torch encode ({device.type}) | numpy decode | torch decode ({device.type}) "
        "| bytes identical |\n|---|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['numpy_encode']:.3f} | {r['torch_encode']:.3f} | {r['numpy_decode']:.3f} | "
            f"{r['torch_decode']:.3f} | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n\n(G parameters per second, best of the repeats)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="diloco bench quantize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cpu", help="where the torch quantizers run: cpu or cuda")
    ap.add_argument("--params", type=int, default=28_000_000, help="values in the fragment")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (numpy uses one); 0: PyTorch's default"
    )
    ap.add_argument("--formats", default=",".join(tq.FORMATS), help="the formats with a torch implementation")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    device = open_device("diloco bench quantize", a.device, a.threads)
    if device is None:
        return 0
    formats = [f for f in a.formats.split(",") if f]
    unknown = [f for f in formats if f not in tq.FORMATS]
    if unknown:
        print(
            f"diloco bench quantize: formats without a torch implementation {unknown}; expected some of {tq.FORMATS}",
            file=sys.stderr,
        )
        return 2
    rows = measure(a.params, device, a.repeats, formats)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} torch threads"
    )
    print(f"fragment of {a.params:,} float32 values; torch on {where}; PyTorch {torch.__version__}\n")
    print(table(rows, device))
    if a.json:
        a.json.write_text(json.dumps({"device": str(device), "params": a.params, "rows": rows}, indent=2))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
