"""`diloco simulate run`: the goodput the `diloco run` with the same flags should get, predicted.

Takes every flag of ``diloco run`` (the mode, the learners, the failure flags ``--mtbf``,
``--repair``, ``--seed``, the time limit, ...) plus what the machine's processes take, measured:
``--restart`` (a relaunched learner's launch to its first step), ``--startup`` (the same for the
first launch, default: ``--restart``), ``--step-time`` and ``--blocked-fraction`` (the share of
training time spent syncing while every learner trains). It simulates the job under the failure
model shared with the runner (the same failure instants for the same seed) and prints the goodput
the runner's report would show: overall, start-up, steady state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from typing import Any

from diloco.runner.cli import parse_settings
from diloco.runner.commands import CHECKPOINT_EVERY
from diloco.runner.settings import RunSettings, SettingsError
from diloco.runner.timeline import Goodput, goodput_of
from diloco.simulate.job import JobTiming, simulate_job


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="diloco simulate run",
        description=__doc__.splitlines()[0],
        epilog="Every `diloco run` flag is accepted as well (see `diloco run --help`).",
        allow_abbrev=False,  # --seed is the run's flag, not short for --seeds
    )
    p.add_argument(
        "--restart",
        type=float,
        required=True,
        help="measured seconds from a relaunched learner's launch to its first step",
    )
    p.add_argument(
        "--startup",
        type=float,
        default=None,
        help="measured seconds from a learner's first launch to its first step (default: --restart)",
    )
    p.add_argument("--step-time", type=float, required=True, help="measured seconds per training step")
    p.add_argument(
        "--blocked-fraction",
        type=float,
        default=0.0,
        help="measured share of training time spent syncing while every learner trains (default 0)",
    )
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds of the failure instants, averaged (default: the run's --seed)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    return p


def predict(settings: RunSettings, timing: JobTiming, seeds: list[int]) -> list[dict[str, Any]]:
    """One simulated run per seed: the goodput figures of the runner's report, and the failures."""
    out = []
    for seed in seeds:
        model = replace(settings.failures, seed=seed)
        job = simulate_job(
            model, timing, time_limit_s=settings.time_limit_s, max_steps=settings.train.max_steps
        )
        g = goodput_of(job.timeline)
        out.append({"seed": seed, "kills": job.kills, "absorbed": job.absorbed, "goodput": g.to_dict()})
    return out


def render(settings: RunSettings, timing: JobTiming, runs: list[dict[str, Any]]) -> str:
    m = settings.failures
    lines = [
        f"diloco simulate run: {settings.mode}, {settings.learners} learners, {settings.time_limit_s:g} s; failures: "
        f"MTBF {m.mtbf_s:g} s per learner, repair {m.repair_s:g} s, {'elastic' if m.elastic else 'not elastic'}, "
        f"quorum {m.quorum}",
        f"measured: start-up {timing.first_start_s:g} s, restart {timing.restart_s:g} s, step {timing.step_time_s:g} s, "
        f"checkpoint every {timing.checkpoint_every} steps, {100 * timing.blocked_fraction:.1f}% of training time "
        "syncing while every learner trains",
        "",
        f"{'seed':>6}{'goodput':>10}{'steady':>10}{'start-up':>10}{'blocked':>10}{'lost':>8}{'kills':>7}",
    ]
    for run in runs:
        g = run["goodput"]
        lines.append(
            f"{run['seed']:>6}{_pct(g['goodput']):>10}{_pct(g['steady_goodput']):>10}"
            f"{_pct(g['startup_s'] / g['total_s']):>10}{g['blocked_s']:>9.0f}s{g['lost_s']:>7.0f}s"
            f"{run['kills']:>7}"
        )
    if len(runs) > 1:
        mean = {
            k: statistics.fmean(r["goodput"][k] or 0.0 for r in runs) for k in ("goodput", "steady_goodput")
        }
        lines.append(f"{'mean':>6}{_pct(mean['goodput']):>10}{_pct(mean['steady_goodput']):>10}")
    lines.append("(goodput = useful / allocated learner-time; steady = after each learner's first start-up)")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def simulate_run(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse the flags, simulate, and return the text and the JSON document. Raises ``SettingsError``
    (or ``ValueError``) for flags that cannot work."""
    extra, rest = build_parser().parse_known_args(argv)
    settings = parse_settings(rest)
    timing = JobTiming(
        extra.restart, extra.step_time, extra.startup, CHECKPOINT_EVERY, extra.blocked_fraction
    )
    try:
        seeds = (
            [int(s) for s in extra.seeds.split(",") if s.strip()] if extra.seeds else [settings.model.seed]
        )
    except ValueError:
        raise SettingsError(f"--seeds: expected comma-separated integers, got {extra.seeds!r}") from None
    runs = predict(settings, timing, seeds)
    doc = {"mode": settings.mode, "learners": settings.learners, "time_limit_s": settings.time_limit_s,
           "failures": vars(settings.failures), "timing": vars(timing), "runs": runs}  # fmt: skip
    return render(settings, timing, runs), doc


def mean_goodput(doc: dict[str, Any]) -> Goodput:
    """The seeds' mean of every figure of a ``simulate_run`` document, as one ``Goodput``."""
    fields = ("total_s", "training_s", "starting_s", "down_s", "blocked_s", "lost_s", "startup_s")
    runs = [r["goodput"] for r in doc["runs"]]
    return Goodput(**{k: statistics.fmean(float(r[k]) for r in runs) for k in fields})


def main(argv: list[str]) -> int:
    try:
        text, doc = simulate_run([a for a in argv if a != "--json"])
    except (SettingsError, ValueError) as exc:
        print(f"diloco simulate run: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2) if "--json" in argv else text)
    return 0
