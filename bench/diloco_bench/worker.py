"""`diloco bench worker`: learner throughput with DiLoCo next to a plain training loop, same run.

Both runs train the same built-in model on the same data with the worker's own loop
(``diloco_worker.learner.run_learner``); the DiLoCo run talks to a real synchronizer process (quorum 1,
filesystem storage) started for the benchmark. Runs alternate (plain, DiLoCo, plain, DiLoCo, ...) so
drifting machine load affects both alike. Reported per run, over the steps after a warm-up:

- tokens/s (wall clock between the first and the last measured step, including step-boundary work);
- tokens per CPU-second of this process over the whole run (all its threads: training, sender,
  pollers, heartbeats) — on a machine shared with other work this is steadier than wall-clock
  tokens/s, which other processes' load moves by tens of percent from one run to the next;
- for DiLoCo: the fraction of that time the training thread spent on synchronisation at step
  boundaries (applying global fragments, handing outer gradients to the sender) — it never waits on
  the network, so this should be close to zero — and the bytes it sent;
- the model FLOPs utilisation (median of the logged steps) where the device's peak is known.

The learners log (and on CUDA wait for the device) every ``--log-every`` steps; the measurement
runs from the first logged step after the warm-up to the last.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from diloco_core.auth import learner_token
from diloco_core.config import DiLoCoSettings, ModelSettings, TrainSettings
from diloco_worker.learner import run_learner
from diloco_worker.metrics import read_metrics
from diloco_worker.settings import WorkerSettings

from diloco_bench.sync_process import SECRET, BenchSync


def start_synchronizer(args: argparse.Namespace, store: Path) -> BenchSync:
    sync = BenchSync(
        store,
        [
            "--inner-steps",
            str(args.inner_steps),
            "--fragments",
            str(args.fragments),
            "--overlap",
            str(args.overlap),
            "--quorum",
            "1",
            "--codec",
            args.codec,
            "--down-codec",
            args.down_codec,
            "--error-feedback" if args.error_feedback else "--no-error-feedback",
            "--log-level",
            "WARNING",
        ],
    )
    sync.start()
    return sync


def _settings(args: argparse.Namespace, metrics: Path, sync_url: str | None, learner: str) -> WorkerSettings:
    return WorkerSettings(
        standalone=sync_url is None,
        sync_url=sync_url,
        learner_id=learner,
        token=learner_token(SECRET, learner) if sync_url else None,
        diloco=DiLoCoSettings(inner_steps=args.inner_steps, fragments=args.fragments, overlap=args.overlap),
        model=ModelSettings(
            n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size
        ),
        train=TrainSettings(batch_size=args.batch_size, max_steps=args.steps, warmup_steps=10),
        corpus_max_bytes=1_000_000,
        metrics_file=str(metrics),
        log_every=args.log_every,
        device=args.device,
        threads=args.threads,
        poll_wait_s=5.0,
        sync_compute=args.sync_compute,
        compile_model=args.compile,
        peak_tflops=args.peak_tflops,
    )


def measure(metrics: Path, warmup: int) -> dict[str, float]:
    recs = [r for r in read_metrics(metrics) if r["step"] >= warmup]
    first, last = recs[0], recs[-1]
    elapsed = last["time"] - first["time"]
    return {
        "tokens_per_s": (last["tokens"] - first["tokens"]) / elapsed,
        "blocked_fraction": (last["blocked_s"] - first["blocked_s"]) / elapsed,
        "bytes_sent": float(last.get("bytes_sent", 0)),
        "steps": float(last["step"] - first["step"]),
        "mfu": statistics.median(r["mfu"] for r in recs[1:])
        if "mfu" in last and len(recs) > 1
        else float("nan"),
    }


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_once(args: argparse.Namespace, tmp: Path, sync_url: str | None, tag: str) -> dict[str, float]:
    metrics = tmp / f"{tag}.jsonl"
    settings = _settings(args, metrics, sync_url, tag)
    cpu0 = _cpu_seconds()
    rc = run_learner(settings, {}, threading.Event())
    cpu = _cpu_seconds() - cpu0
    if rc != 0:
        raise RuntimeError(f"run {tag} exited with {rc}")
    figures = measure(metrics, args.warmup)
    figures["tokens_per_cpu_s"] = read_metrics(metrics)[-1]["tokens"] / cpu
    return figures


def _percent(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f}"


def table(rows: list[tuple[str, dict[str, float]]]) -> str:
    head = (
        f"{'run':<12} {'tokens/s':>10} {'tokens/CPU-s':>13} {'blocked %':>10} {'bytes sent':>12} {'MFU %':>6}"
    )
    lines = [head, "-" * len(head)]
    for name, r in rows:
        blocked = f"{100 * r['blocked_fraction']:.3f}" if name.startswith("diloco") else "-"
        lines.append(
            f"{name:<12} {r['tokens_per_s']:>10.0f} {r['tokens_per_cpu_s']:>13.0f} {blocked:>10} "
            f"{int(r['bytes_sent']):>12} {_percent(r['mfu']):>6}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="diloco bench worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--steps", type=int, default=50, help="inner steps per run")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the measurement")
    ap.add_argument("--repeats", type=int, default=2, help="plain/DiLoCo pairs")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=16)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--overlap", type=int, default=2)
    job = DiLoCoSettings()  # the product's defaults
    ap.add_argument("--codec", default=job.codec, help="outer gradients up (default: the product's)")
    ap.add_argument(
        "--down-codec", default=job.down_codec, help="global versions down (default: the product's)"
    )
    ap.add_argument(
        "--error-feedback",
        action=argparse.BooleanOptionalAction,
        default=job.error_feedback,
        help="learners' error feedback (default: the product's)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: PyTorch's default)")
    ap.add_argument("--log-every", type=int, default=5, help="steps between the learners' logged steps")
    ap.add_argument(
        "--sync-compute",
        default="auto",
        choices=["auto", "numpy", "torch"],
        help="the learners' outer-gradient path (auto: torch on CUDA, numpy on a CPU)",
    )
    ap.add_argument("--compile", action="store_true", help="learners run the model through torch.compile")
    ap.add_argument(
        "--peak-tflops", type=float, default=0.0, help="peak TFLOP/s for MFU (default: known GPUs)"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup + 2 * args.log_every:
        ap.error("--steps must exceed --warmup by more than two --log-every intervals")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(list(argv))
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="diloco-bench-worker-") as d:
        tmp = Path(d)
        sync = start_synchronizer(args, tmp / "store")
        url = sync.url
        rows: list[tuple[str, dict[str, float]]] = []
        try:
            for i in range(args.repeats):
                rows.append((f"plain-{i}", run_once(args, tmp, None, f"plain-{i}")))
                rows.append((f"diloco-{i}", run_once(args, tmp, url, f"diloco-{i}")))
        finally:
            sync.stop()

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for n, r in rows if n.startswith(kind))

    plain, dl = med("plain", "tokens_per_s"), med("diloco", "tokens_per_s")
    cpu_ratio = med("diloco", "tokens_per_cpu_s") / med("plain", "tokens_per_cpu_s")
    blocked = med("diloco", "blocked_fraction")
    print(table(rows))
    print(
        f"\nDiLoCo / plain tokens/s: {dl / plain:.3f}   (median plain {plain:.0f}, DiLoCo {dl:.0f} tokens/s)"
    )
    print(f"DiLoCo / plain tokens per CPU-second: {cpu_ratio:.3f}")
    print(f"time blocked on synchronisation: {100 * blocked:.3f}% of step time (median)")
    mfu_plain, mfu_dl = med("plain", "mfu"), med("diloco", "mfu")
    if mfu_plain == mfu_plain:  # not NaN: the peak is known
        print(f"MFU: plain {100 * mfu_plain:.1f}%, DiLoCo {100 * mfu_dl:.1f}% (median)")
    summary: dict[str, Any] = {
        "device": args.device,
        "ratio": dl / plain,
        "cpu_ratio": cpu_ratio,
        "plain_tokens_per_s": plain,
        "diloco_tokens_per_s": dl,
        "blocked_fraction": blocked,
        "mfu_plain": mfu_plain,
        "mfu_diloco": mfu_dl,
        "runs": dict(rows),
        "settings": {k: str(v) for k, v in vars(args).items()},
    }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
