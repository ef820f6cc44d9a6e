"""Benchmark `hetero`: mixed hardware — half the learners 18% slower, 10% step-time noise.

Three round policies on the same virtual time budget: K = all (lock-step: a learner waits for each
merge of the fragment it pushed), K = 1 without grace (gamma = 0) and K = 1 with the adaptive grace
window (gamma = 0.5, cap one step). Goodput = busy learner-time / allocated learner-time; "merged"
= share of learner-steps whose progress reached the global model through a merge (the rest was
overwritten by a newer global version before the learner pushed it); "pulled" = partial outer
gradients sent because an open round asked for them (``--no-partial`` turns the pull off). The paper
(4 TPU v6e + 4 v5p): goodput 84% / 100% / 100%, text avg 54.4 / 51.4 / 55.3.
"""

from __future__ import annotations

import statistics
import sys

from diloco_bench import experiment, harness, plots, runs, workload

PAPER = {"K=all": ("84%", "54.4"), "K=1, no grace": ("100%", "51.4"), "K=1 + grace": ("100%", "55.3")}


def policies(learners: int, inner_steps: int, partial: bool = True) -> list[runs.Method]:
    return [
        runs.decoupled(
            learners, name="K=all", quorum=0, blocking=True, inner_steps=inner_steps, partial=partial
        ),
        runs.decoupled(
            learners, name="K=1, no grace", grace_gamma=0.0, inner_steps=inner_steps, partial=partial
        ),
        runs.decoupled(learners, name="K=1 + grace", inner_steps=inner_steps, partial=partial),
    ]


def main(argv: list[str]) -> int:
    p = experiment.parser("diloco bench hetero", __doc__, steps=96, seeds="0,1,2")
    p.add_argument("--learners", type=int, default=8, help="M; the last half is slower (default %(default)s)")
    p.add_argument("--inner-steps", type=int, default=16, help="H (default %(default)s)")
    p.add_argument("--slowdown", type=float, default=1.18, help="step-time factor of the slow half")
    p.add_argument("--noise", type=float, default=0.10, help="relative std of every step time")
    p.add_argument("--no-partial", action="store_true", help="rounds do not pull partial progress")
    a = p.parse_args(argv)
    experiment.check_inner_steps(p, a.inner_steps)
    if a.learners < 2:
        p.error("--learners must be at least 2")
    w, seeds = experiment.workload_from(a), experiment.seeds_from(a.seeds)
    half = a.learners // 2
    speeds = (1.0,) * (a.learners - half) + (a.slowdown,) * half
    # every policy gets the virtual time a fast learner needs for --steps steps
    timing = runs.Timing(steps=a.steps, speed_factors=speeds, noise=a.noise, time_budget=float(a.steps))
    corpus = workload.Corpus(w)
    results: dict[str, list[runs.RunResult]] = {}
    for seed in seeds:
        for m in experiment.with_outer(policies(a.learners, a.inner_steps, partial=not a.no_partial), a):
            r = harness.run(m, w, timing, corpus, seed)
            results.setdefault(m.name, []).append(r)
            print(
                f"seed {seed} {m.name:<14} goodput {r.goodput:.0%} loss {r.eval_loss:.4f} ({r.wall_s:.0f} s)",
                flush=True,
            )
    print(report(results))
    experiment.write_json(a.json, results)
    goodput = {n: [r.goodput for r in rs] for n, rs in results.items()}
    plots.emit(
        a,
        "hetero",
        lambda: plots.hetero(goodput, {n: [r.eval_loss for r in rs] for n, rs in results.items()}),
    )
    return 0


def report(results: dict[str, list[runs.RunResult]]) -> str:
    rows = []
    for name, rs in results.items():
        rows.append(
            [
                name,
                f"{statistics.fmean(r.goodput for r in rs):.1%}",
                experiment.mean_std([r.eval_loss for r in rs]),
                f"{statistics.fmean(r.merged_share for r in rs):.0%}",
                f"{statistics.fmean(r.participants for r in rs):.2f}",
                f"{statistics.fmean(sum(r.steps) for r in rs):.0f}",
                f"{statistics.fmean(r.partials for r in rs):.0f}",
                *PAPER.get(name, ("-", "-")),
            ]
        )
    headers = ["policy", "goodput", "held-out loss", "merged", "learners / merge", "learner-steps", "pulled",
               "paper goodput", "paper text avg"]  # fmt: skip
    return experiment.table(headers, rows)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
