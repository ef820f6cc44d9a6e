"""Benchmark `bandwidth`: bytes on the wire per token in both directions, and the held-out loss they
buy, per method and candidate, against data-parallel with bf16 gradients (the paper's baseline).

Bytes are the real encoded sizes (``diloco_core.codec``, zstd included). Up: what each learner sends
(a gradient every step for data-parallel, an outer gradient per fragment every H steps for DiLoCo).
Down: what each learner receives (data-parallel: the reduced gradient every step; DiLoCo: every new
global version of every fragment, whole in fp32 or, with a download codec, as the quantized
difference to the previous version, ``diloco_core.downlink``). All methods train the same tokens.

The candidates (one ablation row each, on top of today's decoupled int4 at H): a larger H with its
own outer learning rate; error feedback (``diloco_core.feedback``) with int4, int2, int1 and top-k;
compressed downloads; and all of them together. The paper: 198 Gbit/s (data-parallel) -> 0.84 Gbit/s
(about 235x); Streaming DiLoCo about 400x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import get_args

from diloco_core.config import Quantizer

from diloco_bench import experiment, harness, plots, runs, workload


def methods(a: argparse.Namespace) -> list[runs.Method]:
    """Data-parallel (fp32, bf16), today's decoupled int4 at H, and one row per candidate; the larger-H
    row and the combined row once per value of ``--large-h``, in its order."""
    M, H = a.learners, a.inner_steps
    base = experiment.with_outer([runs.decoupled(M, inner_steps=H)], a)[0]
    lr, mom = a.large_h_outer_lr, a.large_h_outer_momentum
    mom = base.settings.outer_momentum if mom is None else mom
    outer = f"outer lr {lr:g}" + (f", momentum {mom:g}" if mom != base.settings.outer_momentum else "")
    rows = [
        *(base.but(f"H = {big}, {outer} (int4)", inner_steps=big, outer_lr=lr, outer_momentum=mom)
          for big in a.large_h),
        base.but("int4 + error feedback", error_feedback=True),
        base.but("int2 + error feedback", codec="int2", error_feedback=True),
        base.but("int1 + error feedback", codec="int1", error_feedback=True),
        base.but(f"top-k (8/{a.quant_block}) + error feedback", codec="topk", block_size=a.quant_block,
                error_feedback=True),
        base.but(f"int4, down {a.down_codec}", down_codec=a.down_codec),
        *(base.but(f"H = {big}: {a.up_codec} + EF up, {a.down_codec} down", codec=a.up_codec,
                  down_codec=a.down_codec, block_size=a.quant_block, error_feedback=True, inner_steps=big,
                  outer_lr=lr, outer_momentum=mom) for big in a.large_h),
    ]  # fmt: skip
    return [
        runs.data_parallel(M, "fp32"),
        runs.data_parallel(M, "bf16"),
        base.but(f"decoupled (int4), H = {H}"),
        *rows,
    ]


def parser() -> argparse.ArgumentParser:
    """The experiment's flags: the common ones, the candidates' settings, the rows to run."""
    p = experiment.parser("diloco bench bandwidth", __doc__, steps=128)
    p.add_argument("--learners", type=int, default=4, help="M (default %(default)s)")
    p.add_argument("--inner-steps", type=int, default=16, help="H of today's run (default %(default)s)")
    p.add_argument(
        "--large-h",
        type=_counts,
        default=(64,),
        help="the larger H candidate, or several comma-separated: one larger-H row and one combined row each "
        "(default 64)",
    )
    p.add_argument(
        "--large-h-outer-lr", type=float, default=0.7, help="its outer learning rate (default %(default)s)"
    )
    p.add_argument(
        "--large-h-outer-momentum",
        type=float,
        default=None,
        help="its outer momentum (default: --outer-momentum, as for today's run)",
    )
    p.add_argument(
        "--up-codec", default="int1", help="upload codec of the combined row (default %(default)s)"
    )
    p.add_argument(
        "--down-codec",
        default="int1",
        choices=get_args(Quantizer),
        help="download codec of the compressed rows (default %(default)s)",
    )
    p.add_argument(
        "--quant-block",
        type=int,
        default=256,
        help="quantizer block of the top-k and combined rows (default %(default)s)",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated row numbers to run, in the order of the table (1 = data-parallel fp32); default all",
    )
    p.add_argument(
        "--step-time", type=float, default=1.0, help="seconds per inner step for the Mbit/s column"
    )
    return p


def main(argv: list[str]) -> int:
    p = parser()
    a = p.parse_args(argv)
    experiment.check_inner_steps(p, a.inner_steps)
    if min(a.large_h) < runs.BENCH_SETTINGS.fragments:
        p.error(
            f"--large-h must be at least {runs.BENCH_SETTINGS.fragments} (one offset per fragment), got {a.large_h}"
        )
    if a.steps < max(a.inner_steps, *a.large_h):
        p.error(f"--steps ({a.steps}) must be at least --inner-steps and --large-h to see a sync")
    w = experiment.workload_from(a)
    corpus = workload.Corpus(w)
    timing = runs.Timing(steps=a.steps)
    seed = experiment.seeds_from(a.seeds)[0]
    chosen = methods(a)
    if a.only:
        keep = {int(i) for i in a.only.split(",") if i.strip()} | {2}  # the bf16 baseline is always run
        chosen = [m for i, m in enumerate(chosen, start=1) if i in keep]
    results = []
    for m in chosen:
        r = harness.run(m, w, timing, corpus, seed)
        results.append(r)
        print(
            f"{m.name:<44} up {r.bytes_per_token:9.3f} B/token, down {down_per_token(r):9.3f}, loss "
            f"{r.eval_loss:.4f} ({r.wall_s:.0f} s)",
            flush=True,
        )
    base = next(r for r in results if r.method == "data-parallel (bf16)")
    print(report(results, base, a.step_time))
    experiment.write_json(a.json, results)
    plots.emit(
        a,
        "bandwidth",
        lambda: plots.codecs(
            {r.method: (r.bytes_per_token + down_per_token(r), [r.eval_loss]) for r in results},
            title="Bandwidth: held-out loss vs bytes up + down per token (same tokens)",
            xlabel="bytes up + down per token, all learners (log)",
        ),
    )
    return 0


def _counts(text: str) -> tuple[int, ...]:
    """``"32,64"`` -> ``(32, 64)``: positive integers, at least one."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def down_per_token(r: runs.RunResult) -> float:
    return r.bytes_down / max(r.tokens, 1)


def report(results: list[runs.RunResult], base: runs.RunResult, step_time: float) -> str:
    """Bytes per token both ways, the ratio to ``base`` (data-parallel bf16) each way, peak, loss."""
    rows = []
    ref = next((r.eval_loss for r in results if r.method.startswith("decoupled (int4)")), base.eval_loss)
    for r in results:
        per_step = statistics.fmean(b / s for b, s in zip(r.bytes_up, r.steps, strict=True))
        rows.append(
            [
                r.method,
                f"{r.bytes_per_token:.4f}",
                f"{base.bytes_per_token / r.bytes_per_token:,.0f}x",
                f"{down_per_token(r):.4f}",
                f"{down_per_token(base) / down_per_token(r):,.0f}x",
                experiment.human_bytes(max(r.peak_up)),
                f"{per_step * 8 / step_time / 1e6:.4f}",
                f"{r.eval_loss:.4f}",
                f"{100 * (r.eval_loss / ref - 1):+.1f}%",
            ]
        )
    headers = [
        "method", "bytes up / token", "up vs DP bf16", "bytes down / token", "down vs DP bf16",
        "peak up / learner-step", f"mean Mbit/s up per learner at {step_time:g} s/step", "held-out loss",
        "loss vs decoupled int4",
    ]  # fmt: skip
    return experiment.table(headers, rows)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
