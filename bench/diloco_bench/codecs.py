"""Benchmark `codecs`: the outer-gradient codec ablation — held-out loss vs bytes on the wire.

Decoupled DiLoCo (M = 4, K = 1 + grace, RDA, token weights, P = 4, tau = 2) with each quantizer of
``diloco_core.codec``. The paper's ablation (text avg): bf16 55.4, int4 55.3 (nearly lossless),
2-bit 42.6, 1-bit 37.3. The codec has no 2-bit or 1-bit quantizer, so those rows are not measured.
"""

from __future__ import annotations

import statistics
import sys

from diloco_core.quantize import QUANTIZERS

from diloco_bench import experiment, harness, plots, runs, workload

CODECS = ("fp32", "bf16", "int8", "int4", "e3m0")
PAPER = {"bf16": "55.4", "int4": "55.3", "int2": "42.6", "int1": "37.3"}  # the paper's 2-bit and 1-bit


def main(argv: list[str]) -> int:
    p = experiment.parser("diloco bench codecs", __doc__, steps=128, seeds="0")
    p.add_argument("--learners", type=int, default=4, help="M (default %(default)s)")
    p.add_argument(
        "--codecs", default=",".join(CODECS), help="comma-separated quantizers (default %(default)s)"
    )
    a = p.parse_args(argv)
    codecs = [c.strip() for c in a.codecs.split(",") if c.strip()]
    unknown = sorted(set(codecs) - set(QUANTIZERS))
    if unknown:
        p.error(f"unknown codec(s) {unknown}; choose from {', '.join(QUANTIZERS)}")
    w, seeds = experiment.workload_from(a), experiment.seeds_from(a.seeds)
    corpus = workload.Corpus(w)
    timing = runs.Timing(steps=a.steps)
    results: dict[str, list[runs.RunResult]] = {}
    for codec in codecs:
        for seed in seeds:
            (method,) = experiment.with_outer([runs.decoupled(a.learners, codec)], a)
            r = harness.run(method, w, timing, corpus, seed)
            results.setdefault(codec, []).append(r)
            print(
                f"{codec:<5} seed {seed}: loss {r.eval_loss:.4f}, {r.bytes_per_token:.3f} B/token ({r.wall_s:.0f} s)",
                flush=True,
            )
    print(report(results))
    experiment.write_json(a.json, results)
    plots.emit(a, "codecs", lambda: plots.codecs(points(results)))
    return 0


def points(results: dict[str, list[runs.RunResult]]) -> dict[str, tuple[float, list[float]]]:
    """Per codec: (mean bytes per token, held-out loss per seed)."""
    return {
        c: (statistics.fmean(r.bytes_per_token for r in rs), [r.eval_loss for r in rs])
        for c, rs in results.items()
    }


def report(results: dict[str, list[runs.RunResult]]) -> str:
    ref = statistics.fmean(r.eval_loss for r in results.get("fp32", next(iter(results.values()))))
    rows = []
    for codec, rs in results.items():
        losses = [r.eval_loss for r in rs]
        bpt = statistics.fmean(r.bytes_per_token for r in rs)
        rows.append(
            [
                codec,
                experiment.mean_std(losses),
                f"{100 * (statistics.fmean(losses) / ref - 1):+.2f}%",
                f"{bpt:.3f}",
                PAPER.get(codec, "-"),
            ]
        )
    rows += [
        [name, "not measured", "-", "-", PAPER[name]] for name in ("int2", "int1") if name not in results
    ]
    headers = ["codec", "held-out loss", "vs fp32", "bytes up / token", "paper text avg (bf16 = 55.4)"]
    return experiment.table(headers, rows)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
