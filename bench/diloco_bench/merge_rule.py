"""Benchmark `merge-rule`: plain (weighted) mean vs Radial-Directional Averaging at M = 4, 8, 16.

Decoupled DiLoCo with K = M (every learner in every merge, equal speeds) so each merge sees all M
outer gradients. Reported: ||merged outer gradient|| / mean ||per-learner outer gradient|| over the
dense fragments (RDA keeps it at 1 by construction; the mean shrinks it towards 1/sqrt(M) when the
outer gradients are nearly orthogonal) and the held-out loss. The paper (text avg): direct average
M = 8: 54.1, M = 16: 52.7; RDA (non-embedding) + average (embedding): 55.4 and 54.5.
"""

from __future__ import annotations

import math
import statistics
import sys

from diloco_bench import experiment, harness, plots, runs, workload

PAPER = {("mean", 8): "54.1", ("mean", 16): "52.7", ("rda", 8): "55.4", ("rda", 16): "54.5"}


def main(argv: list[str]) -> int:
    p = experiment.parser("diloco bench merge-rule", __doc__, steps=64)
    p.add_argument("--learners", default="4,8,16", help="comma-separated M values (default %(default)s)")
    p.add_argument("--inner-steps", type=int, default=16, help="H (default %(default)s)")
    a = p.parse_args(argv)
    experiment.check_inner_steps(p, a.inner_steps)
    try:
        sizes = [int(x) for x in a.learners.split(",") if x.strip()]
    except ValueError:
        p.error(f"--learners must be comma-separated integers, got {a.learners!r}")
    if not sizes or min(sizes) < 2:
        p.error("--learners needs values of at least 2")
    w, seeds = experiment.workload_from(a), experiment.seeds_from(a.seeds)
    corpus = workload.Corpus(w)
    timing = runs.Timing(steps=a.steps)
    results: dict[tuple[str, int], list[runs.RunResult]] = {}
    for m in sizes:
        for rule in ("mean", "rda"):
            for seed in seeds:
                method = runs.decoupled(
                    m, name=f"{rule} M={m}", quorum=0, merge_rule=rule, inner_steps=a.inner_steps
                )
                (method,) = experiment.with_outer([method], a)
                r = harness.run(method, w, timing, corpus, seed)
                results.setdefault((rule, m), []).append(r)
                print(
                    f"{rule:<4} M={m:<3} seed {seed}: norm ratio {_ratio(r):.3f}, loss {r.eval_loss:.4f} "
                    f"({r.wall_s:.0f} s)",
                    flush=True,
                )
    print(report(results))
    experiment.write_json(a.json, {f"{rule} M={m}": rs for (rule, m), rs in results.items()})
    plots.emit(a, "merge-rule", lambda: plots.merge_rule(*curves(results)))
    return 0


def _ratio(r: runs.RunResult) -> float:
    return statistics.fmean(r.norm_ratios) if r.norm_ratios else float("nan")


def curves(
    results: dict[tuple[str, int], list[runs.RunResult]],
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, list[float]]]]:
    """Per rule and M: the mean norm ratio, and the held-out loss per seed."""
    ratios: dict[str, dict[int, float]] = {}
    losses: dict[str, dict[int, list[float]]] = {}
    for (rule, m), rs in results.items():
        ratios.setdefault(rule, {})[m] = statistics.fmean(_ratio(r) for r in rs)
        losses.setdefault(rule, {})[m] = [r.eval_loss for r in rs]
    return ratios, losses


def report(results: dict[tuple[str, int], list[runs.RunResult]]) -> str:
    rows = []
    for (rule, m), rs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rows.append(
            [
                rule,
                m,
                f"{statistics.fmean(_ratio(r) for r in rs):.3f}",
                f"{1 / math.sqrt(m):.3f}",
                experiment.mean_std([r.eval_loss for r in rs]),
                PAPER.get((rule, m), "-"),
            ]
        )
    headers = ["rule", "M", "merged norm / mean norm", "1/sqrt(M)", "held-out loss", "paper text avg"]
    return experiment.table(headers, rows)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
