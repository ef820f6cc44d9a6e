"""`diloco bench learner-scale`: what a learner's step boundaries cost its training thread as the model
grows, on this machine's device.

For each model size (the built-in GPT at the shapes of ``SHAPES``) one DiLoCo learner trains against
a real synchronizer process (quorum 1, file storage, the job's codecs), in a process of its own so
its peak resident memory is its own. The learner's metrics give, over the steps after a warm-up:

- the step time (wall clock, step-boundary work included);
- the training thread's synchronisation time (``blocked_s``: applying global fragments, the outer
  gradient's ``anchor - params`` and its hand-off to the sender, the per-step bookkeeping) per
  fragment synchronisation, i.e. divided by the ``steps x P / H`` fragments that fell due, and as a
  share of the step time;
- bytes at the socket, up and down, over the whole run (the first upload of the initial parameters
  and the first download included).

Peak resident memory of the learner and of the synchronizer are read from the kernel (``VmHWM``) and
shown against the model's fp32 size, with the learner's resident memory (sampled twice a second) at
the first measured step and at its last (the nearest sample: at 2 M parameters the whole window
lasts about a second): before and after its fragments have been through rounds. Every size runs
with the same batch so that the step's work grows with the model and the boundary's share is
comparable.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_core.config import DiLoCoSettings
from diloco_core.heap import limit_heap
from diloco_worker.learner import run_learner
from diloco_worker.metrics import read_metrics

from diloco_bench import proc_stats
from diloco_bench.worker import _settings, start_synchronizer

# name -> (n_layer, n_head, n_embd) of the built-in GPT (byte vocabulary): about 2 M, 20 M, 200 M, 500 M
SHAPES: dict[str, tuple[int, int, int]] = {
    "2M": (4, 3, 192),
    "20M": (8, 7, 448),
    "200M": (16, 16, 1024),
    "500M": (20, 24, 1536),
}
GB = 1e9
RSS_EVERY_S = 0.5


@dataclass(frozen=True)
class Window:
    """What a learner's metrics say of the steps after the warm-up."""

    steps: int
    start: float  # wall time of its first logged step
    end: float  # and of its last
    blocked_s: float
    fragment_syncs: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps

    @property
    def blocked_ms_per_sync(self) -> float:
        return 1e3 * self.blocked_s / self.fragment_syncs

    @property
    def blocked_fraction(self) -> float:
        return self.blocked_s / self.seconds


def window(records: list[dict[str, Any]], warmup: int, fragments: int, inner_steps: int) -> Window:
    """The measured window: from the first logged step at or after ``warmup`` to the last; a fragment
    falls due ``fragments / inner_steps`` times per step (each fragment once every H steps)."""
    recs = [r for r in records if r.get("step", -1) >= warmup and "blocked_s" in r]
    if len(recs) < 2:
        raise ValueError(f"fewer than two logged steps at or after step {warmup}")
    first, last = recs[0], recs[-1]
    steps = int(last["step"] - first["step"])
    return Window(
        steps=steps,
        start=float(first["time"]),
        end=float(last["time"]),
        blocked_s=float(last["blocked_s"] - first["blocked_s"]),
        fragment_syncs=steps * fragments / inner_steps,
    )


def parameters(n_layer: int, n_head: int, n_embd: int, block_size: int) -> int:
    """The built-in GPT's parameter count at this shape (built on the meta device: nothing allocated)."""
    import torch
    from diloco_worker.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
    return sum(p.numel() for p in model.parameters())


def _child_argv(args: argparse.Namespace, name: str, url: str, metrics: Path) -> list[str]:
    n_layer, n_head, n_embd = SHAPES[name]
    child = ["--child", "--sync-url", url, "--metrics", str(metrics)]
    shape = ["--n-layer", str(n_layer), "--n-head", str(n_head), "--n-embd", str(n_embd)]
    return [sys.executable, "-m", "diloco_bench.learner_scale", *child, *shape, *_shared_argv(args)]


def _shared_argv(args: argparse.Namespace) -> list[str]:
    """The options the child takes as they were given to this run."""
    names = ("steps", "warmup", "log_every", "block_size", "batch_size", "inner_steps", "fragments",
             "overlap", "codec", "down_codec", "threads", "device")  # fmt: skip
    argv = [part for n in names for part in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]
    return [*argv, "--error-feedback" if args.error_feedback else "--no-error-feedback"]


def rss_at(samples: list[tuple[float, int]], t: float) -> int | None:
    """The resident memory of the sample taken nearest to wall time ``t`` (None without samples)."""
    return min(samples, key=lambda s: abs(s[0] - t))[1] if samples else None


def _learner(
    argv: list[str], tmp: Path, name: str, timeout_s: float
) -> tuple[dict[str, Any], list[tuple[float, int]]]:
    """Run the learner process to its end, its resident memory sampled twice a second; what it printed
    (its peak and CPU seconds) and the samples. A learner still running after ``timeout_s``, or when
    this process is interrupted, is killed."""
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    samples: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout_s
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr)
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {name} learner ran past {timeout_s:.0f} s (--timeout-s)")
                rss = proc_stats.rss_bytes(proc.pid)
                if rss is not None:
                    samples.append((time.time(), rss))
                time.sleep(RSS_EVERY_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the {name} learner exited with {proc.returncode}: {err.read_text()[-2000:]}")
    return json.loads(out.read_text().strip().splitlines()[-1]), samples


def run_size(args: argparse.Namespace, name: str, tmp: Path) -> dict[str, Any]:
    """One learner of this size against a synchronizer of its own; the figures of ``window``, the
    learner's memory after the warm-up and at its last step, and the two processes' peaks."""
    sync = start_synchronizer(args, tmp / f"store-{name}")
    metrics = tmp / f"{name}.jsonl"
    try:
        child, samples = _learner(_child_argv(args, name, sync.url, metrics), tmp, name, args.timeout_s)
        sync_rss = proc_stats.peak_rss_bytes(sync.proc.pid) if sync.proc else None
    finally:
        sync.stop()
    records = read_metrics(metrics)
    w = window(records, args.warmup, args.fragments, args.inner_steps)
    n_layer, n_head, n_embd = SHAPES[name]
    params = parameters(n_layer, n_head, n_embd, args.block_size)
    last = records[-1]
    return {
        "params": params,
        "fragment_params": params / args.fragments,
        "steps": w.steps,
        "step_s": w.step_s,
        "blocked_ms_per_sync": w.blocked_ms_per_sync,
        "blocked_ms_per_m": w.blocked_ms_per_sync / (params / args.fragments / 1e6),  # per M fragment params
        "blocked_fraction": w.blocked_fraction,
        "learner_peak_rss": child["peak_rss"],
        "learner_rss_after_warmup": rss_at(samples, w.start),
        "learner_rss_at_end": rss_at(samples, w.end),
        "learner_cpu_s": child["cpu_s"],
        "sync_peak_rss": sync_rss,
        "wire_sent": float(last.get("wire_sent", 0)),
        "wire_received": float(last.get("wire_received", 0)),
    }


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'size':<6} {'params':>8} {'step s':>8} {'sync ms':>8} {'ms/M frag':>9} {'blocked %':>9} "
        f"{'learner GB':>10} {'x fp32':>6} {'at warm-up':>10} {'at end':>6} {'sync GB':>8} {'x fp32':>6} "
        f"{'up MB':>8} {'down MB':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        fp32 = 4 * r["params"]
        sync_rss = r["sync_peak_rss"] or float("nan")
        lines.append(
            f"{name:<6} {r['params'] / 1e6:>7.1f}M {r['step_s']:>8.3f} {r['blocked_ms_per_sync']:>8.1f} "
            f"{r['blocked_ms_per_m']:>9.2f} "
            f"{100 * r['blocked_fraction']:>9.2f} {r['learner_peak_rss'] / GB:>10.2f} "
            f"{r['learner_peak_rss'] / fp32:>6.1f} {_times(r['learner_rss_after_warmup'], fp32):>10} "
            f"{_times(r['learner_rss_at_end'], fp32):>6} {sync_rss / GB:>8.2f} {sync_rss / fp32:>6.1f} "
            f"{r['wire_sent'] / 1e6:>8.1f} {r['wire_received'] / 1e6:>8.1f}"
        )
    return "\n".join(lines)


def _times(value: float | None, unit: float) -> str:
    return "-" if value is None else f"{value / unit:.1f}"


def child(args: argparse.Namespace) -> int:
    """The learner itself (``--child``): trains, then prints its peak RSS and CPU seconds as JSON."""
    limit_heap()  # as the worker's command does first
    settings = _settings(args, args.metrics, args.sync_url, "scale")
    rc = run_learner(settings, {}, threading.Event())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"peak_rss": usage.ru_maxrss * 1024, "cpu_s": usage.ru_utime + usage.ru_stime}))
    return int(rc)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="diloco bench learner-scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--sizes", nargs="+", default=["2M", "20M", "200M"], choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--steps", type=int, default=32, help="inner steps per run")
    ap.add_argument("--warmup", type=int, default=8, help="steps left out of the measurement")
    ap.add_argument("--log-every", type=int, default=4, help="steps between the learner's logged steps")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--inner-steps", type=int, default=16)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--overlap", type=int, default=2)
    job = DiLoCoSettings()  # the product's defaults
    ap.add_argument("--codec", default=job.codec, help="outer gradients up (default: the product's)")
    ap.add_argument("--down-codec", default=job.down_codec, help="versions down (default: the product's)")
    ap.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=job.error_feedback)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: PyTorch's default)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="the most one learner may run")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sync-url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--metrics", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n-layer", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--n-head", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--n-embd", type=int, default=128, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps <= args.warmup + 2 * args.log_every:
        ap.error("--steps must exceed --warmup by more than two --log-every intervals")
    # what the worker benchmark's settings read and this one keeps at the worker's own defaults
    args.sync_compute, args.compile, args.peak_tflops = "auto", False, 0.0
    return args


def main(argv: list[str]) -> int:
    args = parse_args(list(argv))
    if args.child:
        return child(args)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="diloco-bench-learner-scale-") as d:
        for name in args.sizes:
            rows[name] = run_size(args, name, Path(d))
            print(table({name: rows[name]}).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    per_m = statistics.median(r["blocked_ms_per_m"] for r in rows.values())
    print(f"\ntraining-thread ms per million fragment parameters: median {per_m:.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"sizes": rows, "settings": {k: str(v) for k, v in vars(args).items()}})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
