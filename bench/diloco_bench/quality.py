"""Benchmark `quality`: held-out loss of the global model, data-parallel vs DiLoCo vs Decoupled DiLoCo.

Same model, same data shards, same total tokens (data-parallel takes M x batch per step), several
seeds. Decoupled: M = 4, K = 1 with the grace window, token weighting, RDA, int4 outer gradients,
P = 4 fragments, tau = 2. Synchronous DiLoCo: K = M, P = 1, tau = 0, fp32, plain mean.
The paper reports near-parity (64.1% vs 64.4% benchmark accuracy for Decoupled vs conventional).
"""

from __future__ import annotations

import statistics
import sys

from diloco_bench import experiment, harness, plots, runs, workload


def main(argv: list[str]) -> int:
    p = experiment.parser("diloco bench quality", __doc__, steps=128, seeds="0,1,2")
    p.add_argument("--learners", type=int, default=4, help="M (default %(default)s)")
    p.add_argument("--inner-steps", type=int, default=16, help="H (default %(default)s)")
    a = p.parse_args(argv)
    experiment.check_inner_steps(p, a.inner_steps)
    w, seeds = experiment.workload_from(a), experiment.seeds_from(a.seeds)
    methods = [
        runs.data_parallel(a.learners),
        runs.diloco_sync(a.learners, a.inner_steps),
        runs.decoupled(a.learners, inner_steps=a.inner_steps),
    ]
    methods = experiment.with_outer(methods, a)
    corpus = workload.Corpus(w)
    timing = runs.Timing(steps=a.steps)
    results: dict[str, list[runs.RunResult]] = {m.name: [] for m in methods}
    for seed in seeds:
        for m in methods:
            r = harness.run(m, w, timing, corpus, seed)
            results[m.name].append(r)
            print(f"seed {seed} {m.name:<22} loss {r.eval_loss:.4f}  ({r.wall_s:.0f} s)", flush=True)
    print(report(results))
    experiment.write_json(a.json, results)
    plots.emit(a, "quality", lambda: plots.quality({n: [r.eval_loss for r in rs] for n, rs in results.items()}))
    return 0


def report(results: dict[str, list[runs.RunResult]]) -> str:
    base = statistics.fmean(r.eval_loss for r in next(iter(results.values())))
    rows = []
    for name, rs in results.items():
        losses = [r.eval_loss for r in rs]
        rows.append([
            name, experiment.mean_std(losses), f"{100 * (statistics.fmean(losses) / base - 1):+.1f}%",
            f"{rs[0].tokens:,}", f"{statistics.fmean(r.goodput for r in rs):.0%}",
            f"{statistics.fmean(r.wall_s for r in rs):.0f}",
        ])  # fmt: skip
    headers = ["method", "held-out loss (mean ± std)", "vs data-parallel", "tokens", "goodput", "wall s/run"]
    return experiment.table(headers, rows)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
