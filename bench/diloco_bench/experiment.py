"""What the experiment modules share: their flags, statistics over seeds, Markdown tables and JSON."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from diloco_bench import plots
from diloco_bench.runs import BENCH_SETTINGS, Method, RunResult
from diloco_bench.workload import Workload


def parser(prog: str, description: str | None, *, steps: int, seeds: str = "0") -> argparse.ArgumentParser:
    """The flags every experiment takes; the defaults are sized for 2 CPU cores."""
    d = Workload()
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--steps", type=int, default=steps, help="inner steps per learner (default %(default)s)")
    p.add_argument("--seeds", default=seeds, help="comma-separated seeds (default %(default)s)")
    p.add_argument("--n-layer", type=int, default=d.n_layer)
    p.add_argument("--n-head", type=int, default=d.n_head)
    p.add_argument("--n-embd", type=int, default=d.n_embd)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per learner step")
    p.add_argument("--lr", type=float, default=d.lr, help="inner AdamW peak learning rate")
    p.add_argument("--corpus", default=d.corpus, help="'stdlib' or a local file/folder")
    p.add_argument(
        "--device",
        default=d.device,
        help="cpu or cuda: where every learner and the data-parallel "
        "baseline train (bf16 autocast on CUDA)",
    )
    p.add_argument("--outer-lr", type=float, default=BENCH_SETTINGS.outer_lr, help="outer SGD learning rate")
    p.add_argument(
        "--outer-momentum", type=float, default=BENCH_SETTINGS.outer_momentum, help="outer Nesterov momentum"
    )
    p.add_argument(
        "--outer-warmup",
        type=int,
        default=BENCH_SETTINGS.outer_warmup,
        help="outer steps per fragment over which the outer learning rate rises to --outer-lr (0: none)",
    )
    output_flags(p)
    return p


def output_flags(p: argparse.ArgumentParser, *, plot: bool = True) -> None:
    """The outputs every benchmark shares: ``--json PATH`` and (``plot``) ``--plot-dir`` / ``--no-plot``."""
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    if plot:
        plots.add_flags(p)


def workload_from(a: argparse.Namespace) -> Workload:
    return Workload(
        n_layer=a.n_layer,
        n_head=a.n_head,
        n_embd=a.n_embd,
        block_size=a.block_size,
        batch_size=a.batch_size,
        lr=a.lr,
        corpus=a.corpus,
        device=a.device,
    )


def with_outer(methods: Sequence[Method], a: argparse.Namespace) -> list[Method]:
    """The DiLoCo methods with the outer optimizer of the flags."""
    return [
        m.but(outer_lr=a.outer_lr, outer_momentum=a.outer_momentum, outer_warmup=a.outer_warmup)
        for m in methods
    ]


def check_inner_steps(p: argparse.ArgumentParser, inner_steps: int) -> None:
    """Decoupled runs use P = 4 fragments with distinct offsets and overlap 2: H must be at least 4."""
    if inner_steps < BENCH_SETTINGS.fragments:
        p.error(
            f"--inner-steps must be at least {BENCH_SETTINGS.fragments} (one offset per fragment), got {inner_steps}"
        )


def seeds_from(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(f"--seeds must be comma-separated integers, got {text!r}") from exc
    if not seeds:
        raise SystemExit("--seeds names no seed")
    return seeds


def mean_std(values: Sequence[float], digits: int = 3) -> str:
    if len(values) < 2:
        return f"{values[0]:.{digits}f}" if values else "-"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


# two-sided 95 % quantiles of Student's t by degrees of freedom (1-30); beyond 30 the normal's 1.96
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
       2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
       2.045, 2.042)  # fmt: skip


def interval95(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and the two ends of its 95 % confidence interval (Student's t over the values, e.g. one per
    seed); one value gives an interval of zero width."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    df = len(values) - 1
    half = (T95[df - 1] if df <= len(T95) else 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path | None, payload: object) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _jsonable(o: object) -> object:
    if isinstance(o, RunResult):
        return asdict(o)
    raise TypeError(f"cannot write {type(o).__name__} as JSON")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"
