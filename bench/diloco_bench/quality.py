"""Benchmark `quality`: held-out loss of the global model, data-parallel vs DiLoCo vs Decoupled DiLoCo.

Same model, same data shards, same total tokens (data-parallel takes M x batch per step), several
seeds. Decoupled: M = 4, K = 1 with the grace window, token weighting, RDA, int4 outer gradients,
P = 4 fragments, tau = 2. Synchronous DiLoCo: K = M, P = 1, tau = 0, fp32, plain mean.
The paper reports near-parity (64.1% vs 64.4% benchmark accuracy for Decoupled vs conventional).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from diloco_bench import experiment, harness, plots, runs, workload


def _parser() -> argparse.ArgumentParser:
    p = experiment.parser("diloco bench quality", __doc__, steps=128, seeds="0,1,2")
    p.add_argument("--learners", type=int, default=4, help="M (default %(default)s)")
    p.add_argument("--inner-steps", type=int, default=16, help="H (default %(default)s)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also evaluate the global model every this many inner steps per learner (0: at the end)",
    )
    p.add_argument(
        "--delayed-nesterov", type=int, default=0, help="decoupled's Delayed Nesterov N (0: plain)"
    )
    p.add_argument(
        "--after-version-schedule",
        action="store_true",
        help="add a decoupled row whose fragments fall due H steps after their new version arrived "
        "next to the default one (t mod H = t_p, the papers' schedule)",
    )
    p.add_argument(
        "--defaults",
        action="store_true",
        help="the decoupled row runs the job's defaults (codec, error feedback, download codec, H, outer "
        "optimizer and warm-up, as DiLoCoSettings declares them); H and the outer optimizer flags default "
        "to them too",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated methods to run, of dp, sync, decoupled (default all); with --combine, "
        "a data-parallel run's JSON stays the baseline of the tables",
    )
    p.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        help="run nothing: report on the --json files of earlier runs (e.g. one per seed, run in parallel)",
    )
    return p


def main(argv: list[str]) -> int:
    p = _parser()
    if "--defaults" in argv:
        d = runs.product_defaults().settings
        p.set_defaults(
            inner_steps=d.inner_steps,
            outer_lr=d.outer_lr,
            outer_momentum=d.outer_momentum,
            outer_warmup=d.outer_warmup,
        )
    a = p.parse_args(argv)
    if a.combine:
        return summarize(a, combine(a.combine))
    experiment.check_inner_steps(p, a.inner_steps)
    w, seeds = experiment.workload_from(a), experiment.seeds_from(a.seeds)
    decoupled = (
        runs.product_defaults(a.learners).but(inner_steps=a.inner_steps)
        if a.defaults
        else runs.decoupled(a.learners, inner_steps=a.inner_steps)
    )
    decoupled = decoupled.but(delayed_nesterov=a.delayed_nesterov or decoupled.settings.delayed_nesterov)
    by_key = {
        "dp": [runs.data_parallel(a.learners)],
        "sync": [runs.diloco_sync(a.learners, a.inner_steps)],
        "decoupled": [decoupled],
    }
    if a.after_version_schedule:
        by_key["decoupled"].append(
            decoupled.but(f"{decoupled.name}, after-version schedule", schedule="after-version")
        )
    keys = [k.strip() for k in a.only.split(",") if k.strip()] or list(by_key)
    if unknown := sorted(set(keys) - set(by_key)):
        p.error(f"--only: unknown methods {unknown}; choose from {sorted(by_key)}")
    methods = [m for k in by_key if k in keys for m in by_key[k]]
    methods = experiment.with_outer(methods, a)
    corpus = workload.Corpus(w)
    timing = runs.Timing(steps=a.steps, eval_every=a.eval_every)
    results: dict[str, list[runs.RunResult]] = {m.name: [] for m in methods}
    for seed in seeds:
        for m in methods:
            r = harness.run(m, w, timing, corpus, seed)
            results[m.name].append(r)
            print(f"seed {seed} {m.name:<22} loss {r.eval_loss:.4f}  ({r.wall_s:.0f} s)", flush=True)
    return summarize(a, results)


def summarize(a: argparse.Namespace, results: dict[str, list[runs.RunResult]]) -> int:
    """Print the tables, write the JSON and the plots (the loss curve when the runs have one)."""
    print(report(results))
    if len(seeds := per_seed(results)) > 1:
        print(seeds)
    curves = all(len(r.curve) > 1 for rs in results.values() for r in rs)
    if curves:
        print(trend(results))
    experiment.write_json(a.json, results)
    plots.emit(
        a, "quality", lambda: plots.quality({n: [r.eval_loss for r in rs] for n, rs in results.items()})
    )
    if curves:
        plots.emit(a, "quality-curve", lambda: plots.loss_curves(mean_curves(results)))
    return 0


def combine(paths: list[Path]) -> dict[str, list[runs.RunResult]]:
    """The results of several ``--json`` files, per method, in file order."""
    out: dict[str, list[runs.RunResult]] = {}
    for path in paths:
        for name, rows in json.loads(path.read_text()).items():
            for row in rows:
                row["curve"] = [tuple(point) for point in row.get("curve", [])]
                out.setdefault(name, []).append(runs.RunResult(**row))
    return out


def mean_curves(results: dict[str, list[runs.RunResult]]) -> dict[str, list[tuple[int, float]]]:
    """Per method: (tokens, held-out loss averaged over the seeds) at every evaluation point all seeds share."""
    out = {}
    for name, rs in results.items():
        shared = sorted(set.intersection(*({t for t, _ in r.curve} for r in rs)))
        by_seed = [dict(r.curve) for r in rs]
        out[name] = [(t, statistics.fmean(c[t] for c in by_seed)) for t in shared]
    return out


def trend(results: dict[str, list[runs.RunResult]]) -> str:
    """The gap to the first method (data-parallel) at every evaluation point: mean loss and ratio."""
    curves = mean_curves(results)
    names = list(curves)
    base = dict(curves[names[0]])
    points = [t for t, _ in curves[names[0]] if all(t in dict(curves[n]) for n in names)]
    rows = [
        [f"{t:,}"]
        + [
            f"{dict(curves[n])[t]:.4f}" + ("" if n == names[0] else f" ({dict(curves[n])[t] / base[t]:.4f}x)")
            for n in names
        ]
        for t in points
    ]
    return experiment.table(["tokens", *names], rows)


def per_seed(results: dict[str, list[runs.RunResult]]) -> str:
    """With a data-parallel baseline: each seed's loss per method and its ratio to data-parallel's on
    the same seed, then the mean ratio with its 95 % confidence interval over the seeds."""
    first = next(iter(results))
    if not first.startswith("data-parallel"):
        return ""
    base = {r.seed: r.eval_loss for r in results[first]}
    others = [n for n in results if n != first]
    by_seed = {n: {r.seed: r.eval_loss for r in results[n]} for n in results}
    rows = [
        [
            str(seed),
            f"{loss:.4f}",
            *(
                f"{by_seed[n][seed]:.4f} ({by_seed[n][seed] / loss:.3f}x)" if seed in by_seed[n] else "-"
                for n in others
            ),
        ]
        for seed, loss in base.items()
    ]
    ratios = {n: [by_seed[n][s] / base[s] for s in base if s in by_seed[n]] for n in others}
    summary = ["mean ratio (95 % CI)", "1x", *(
        "{:.4f}x ({:.4f}-{:.4f})".format(*experiment.interval95(ratios[n])) if ratios[n] else "-"
        for n in others)]  # fmt: skip
    return experiment.table(["seed", first, *others], [*rows, summary])


def report(results: dict[str, list[runs.RunResult]]) -> str:
    """One row per method; the ratio column when the first method is data-parallel (the baseline)."""
    first = next(iter(results))
    base = (
        statistics.fmean(r.eval_loss for r in results[first]) if first.startswith("data-parallel") else None
    )
    rows = []
    for name, rs in results.items():
        losses = [r.eval_loss for r in rs]
        ratio = [] if base is None else [f"{100 * (statistics.fmean(losses) / base - 1):+.1f}%"]
        rows.append(
            [
                name,
                experiment.mean_std(losses),
                *ratio,
                f"{rs[0].tokens:,}",
                f"{statistics.fmean(r.goodput for r in rs):.0%}",
                f"{statistics.fmean(r.wall_s for r in rs):.0f}",
            ]
        )
    headers = ["method", "held-out loss (mean ± std)", *([] if base is None else ["vs data-parallel"]),
               "tokens", "goodput", "wall s/run"]  # fmt: skip
    return experiment.table(headers, rows)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
