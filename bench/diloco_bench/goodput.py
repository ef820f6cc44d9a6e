"""Benchmark `goodput`: real processes' goodput under failures next to the simulator's prediction.

For every seed and mode (decoupled, diloco-sync, ddp) it runs ``diloco run`` with the same flags
(one synchronizer and N learner processes on this machine, killed at the failure model's instants,
restarted after the repair time), then ``diloco simulate run`` with those very flags plus what the
run measured of its own processes:

- ``--startup``: mean seconds from a learner's first launch to its first step (launches that
  reached training),
- ``--restart``: the same for relaunches after a failure (the start-up where there was none),
- ``--step-time``: the median seconds per training step in the learners' metrics records;
- ``--blocked-fraction``: the share of training time the learners spent syncing at step boundaries
  (their cumulative ``blocked_s``) in the windows where every learner was training, so that no
  failure caused it.

Nothing else is fitted: failure instants, repair, quorum, elasticity, checkpoint interval and time
limit are the run's own. It prints measured vs predicted goodput per run (overall and steady state,
that is after each learner's first start-up), the mean per mode, decoupled's ratio to ddp, and writes
``goodput.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from diloco.runner.learner_metrics import parse_records
from diloco.runner.record import RunRecord
from diloco.runner.timeline import Interval, launch_durations
from diloco.simulate.job_cli import mean_goodput, simulate_run
from diloco_bench import chaos, experiment, plots

MODES = ("decoupled", "diloco-sync", "ddp")
PAPER = {"decoupled": 88.0, "ddp": 27.0}  # Decoupled DiLoCo, Table 1 at 1.2M chips: M = 8 vs data-parallel


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco bench goodput", description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated (default %(default)s)")
    p.add_argument(
        "--learners", type=int, default=4, help="learner processes (ddp: ranks) (default %(default)s)"
    )
    p.add_argument("--mtbf", type=float, default=120.0, help="mean seconds between failures of each learner")
    p.add_argument("--repair", type=float, default=2.0, help="seconds a failed learner stays down")
    p.add_argument("--seeds", default="0,1", help="seeds of the failure instants, one run per mode each")
    p.add_argument("--time-limit", type=float, default=360.0, help="seconds each run lasts")
    p.add_argument(
        "--runs-dir", type=Path, default=None, help="keep the run folders here (default: a temp dir)"
    )
    experiment.output_flags(p)
    p.add_argument("extra", nargs="*", help="more `diloco run` flags, after --")
    return p


def run_flags(mode: str, seed: int, a: argparse.Namespace) -> list[str]:
    """The flags both commands get: the run never stops on steps, only at the time limit."""
    return [
        "--mode",
        mode,
        "--learners",
        str(a.learners),
        "--max-steps",
        "100000000",
        "--mtbf",
        str(a.mtbf),
        "--repair",
        str(a.repair),
        "--seed",
        str(seed),
        "--time-limit",
        str(a.time_limit),
        *a.extra,
    ]


def all_training_windows(intervals: Sequence[Interval], learners: int) -> list[tuple[float, float]]:
    """The spans of the run in which every learner was training."""
    edges = sorted({t for i in intervals if i.phase == "training" for t in (i.start_s, i.end_s)})
    training = [i for i in intervals if i.phase == "training"]
    windows: list[tuple[float, float]] = []
    for a, b in itertools.pairwise(edges):
        mid = (a + b) / 2
        if len({i.learner for i in training if i.start_s <= mid < i.end_s}) == learners:
            if windows and windows[-1][1] == a:
                windows[-1] = (windows[-1][0], b)
            else:
                windows.append((a, b))
    return windows


def blocked_fraction(
    records: Sequence[dict[str, Any]], windows: Sequence[tuple[float, float]], t0_wall: float
) -> float:
    """Blocked seconds per second between consecutive records of one process (cumulative ``blocked_s``,
    wall-clock ``time``) that both fall in the same window."""
    blocked = elapsed = 0.0
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_pid.setdefault(int(r["pid"]), []).append(r)
    for own in by_pid.values():
        own.sort(key=lambda r: float(r["time"]))
        for a, b in itertools.pairwise(own):
            ta, tb = float(a["time"]) - t0_wall, float(b["time"]) - t0_wall
            if any(lo <= ta and tb <= hi for lo, hi in windows):
                blocked += max(0.0, float(b["blocked_s"]) - float(a["blocked_s"]))
                elapsed += tb - ta
    return blocked / elapsed if elapsed > 0 else 0.0


def measured_timing(record: RunRecord, metrics_dir: Path, learners: int) -> dict[str, float]:
    """What the run's processes took: start-up, restart (launch to first step), step time, and the
    share of training time spent syncing while every learner trained."""
    first, later = launch_durations(record.timeline.intervals)
    records = [
        r
        for path in sorted(metrics_dir.glob("*.jsonl"))
        for r in parse_records(path.read_text(errors="replace").splitlines())
    ]
    steps = [float(r["step_time_s"]) for r in records if r.get("step_time_s")]
    if not first or not steps:
        raise ValueError("the run has no learner that reached training; nothing to calibrate on")
    startup = statistics.fmean(first)
    windows = all_training_windows(record.timeline.intervals, learners)
    return {
        "startup_s": startup,
        "restart_s": statistics.fmean(later) if later else startup,
        "step_time_s": statistics.median(steps),
        "blocked_fraction": blocked_fraction(records, windows, record.started_at),
        "restarts": float(len(later)),
    }


def run_one(mode: str, seed: int, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One real run and its prediction; or the reason it did not run."""
    runs_dir = root / f"{mode}-seed{seed}"
    flags = run_flags(mode, seed, a)
    cmd = [sys.executable, "-m", "diloco", "run", *flags, "--runs-dir", str(runs_dir), "--plain"]
    path, wall = chaos.run_and_read(cmd, runs_dir, a.time_limit + 300)
    if isinstance(path, str):
        return {"mode": mode, "seed": seed, "error": path, "wall_s": wall}
    report = json.loads(path.read_text())
    record = RunRecord.from_dict(report["record"])
    timing = measured_timing(record, path.parent / "metrics", a.learners)
    _, doc = simulate_run(
        [
            *flags,
            "--restart",
            f"{timing['restart_s']:.3f}",
            "--startup",
            f"{timing['startup_s']:.3f}",
            "--step-time",
            f"{timing['step_time_s']:.4f}",
            "--blocked-fraction",
            f"{timing['blocked_fraction']:.4f}",
        ]
    )
    predicted = mean_goodput(doc)
    measured = report["summary"]["goodput"]
    return {
        "mode": mode,
        "seed": seed,
        "wall_s": wall,
        "timing": timing,
        "kills": len(record.kills),
        "predicted_kills": doc["runs"][0]["kills"],
        "measured": {
            k: measured[k]
            for k in (
                "goodput",
                "steady_goodput",
                "startup_s",
                "total_s",
                "blocked_s",
                "lost_s",
                "down_s",
                "starting_s",
            )
        },
        "predicted": {
            "goodput": predicted.goodput,
            "steady_goodput": predicted.steady_goodput,
            "startup_s": predicted.startup_s,
            "total_s": predicted.total_s,
            "blocked_s": predicted.blocked_s,
            "lost_s": predicted.lost_s,
            "down_s": predicted.down_s,
            "starting_s": predicted.starting_s,
        },
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _points(measured: float | None, predicted: float | None) -> str:
    return "n/a" if measured is None or predicted is None else f"{100 * (measured - predicted):+.1f}"


def report(results: Sequence[dict[str, Any]]) -> str:
    rows: list[list[object]] = []
    for r in results:
        if "error" in r:
            rows.append([r["mode"], r["seed"], "did not run", "", "", "", "", "", "", "", r["error"]])
            continue
        m, p, t = r["measured"], r["predicted"], r["timing"]
        rows.append(
            [
                r["mode"],
                r["seed"],
                _pct(m["goodput"]),
                _pct(p["goodput"]),
                _points(m["goodput"], p["goodput"]),
                _pct(m["steady_goodput"]),
                _pct(p["steady_goodput"]),
                _points(m["steady_goodput"], p["steady_goodput"]),
                f"{100 * m['startup_s'] / m['total_s']:.1f}%",
                f"{r['kills']} / {r['predicted_kills']}",
                f"{t['startup_s']:.1f} / {t['restart_s']:.1f} / {t['step_time_s']:.3f} / {100 * t['blocked_fraction']:.1f}%",
            ]
        )
    headers = ["mode", "seed", "goodput", "predicted", "points", "steady", "predicted", "points",
               "start-up share", "kills (run / sim)", "measured: start-up s / restart s / step s / syncing"]  # fmt: skip
    return experiment.table(headers, rows)


def summary(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the mean and spread over seeds of measured and predicted steady-state goodput."""
    out: dict[str, Any] = {}
    for mode in MODES:
        ok = [r for r in results if r["mode"] == mode and "error" not in r]
        if not ok:
            continue
        measured = [r["measured"]["steady_goodput"] for r in ok]
        predicted = [r["predicted"]["steady_goodput"] for r in ok]
        out[mode] = {
            "measured_steady": statistics.fmean(measured), "predicted_steady": statistics.fmean(predicted),
            "measured_spread": max(measured) - min(measured), "runs": len(ok),
            "measured_overall": statistics.fmean(r["measured"]["goodput"] for r in ok),
            "predicted_overall": statistics.fmean(r["predicted"]["goodput"] for r in ok),
            "max_abs_points": max(abs(100 * (a - b)) for a, b in zip(measured, predicted, strict=True)),
        }  # fmt: skip
    return out


def render_summary(s: dict[str, Any]) -> str:
    lines = [
        "",
        "steady-state goodput per mode, mean over seeds (measured / predicted, spread of the measured):",
    ]
    for mode, x in s.items():
        paper = f"; paper {PAPER[mode]:.0f}%" if mode in PAPER else ""
        lines.append(
            f"  {mode:<12} {_pct(x['measured_steady'])} / {_pct(x['predicted_steady'])} (spread "
            f"{100 * x['measured_spread']:.1f} points over {x['runs']} runs; largest |measured - predicted| "
            f"{x['max_abs_points']:.1f} points; overall {_pct(x['measured_overall'])} / "
            f"{_pct(x['predicted_overall'])}{paper})"
        )
    if "decoupled" in s and "ddp" in s and s["ddp"]["measured_steady"] > 0:
        ratio = s["decoupled"]["measured_steady"] / s["ddp"]["measured_steady"]
        lines.append(f"  decoupled / ddp (steady state, measured): {ratio:.2f}x (paper: 88 / 27 = 3.26x)")
    return "\n".join(lines)


def figure(results: Sequence[dict[str, Any]]) -> Figure:
    """Steady-state goodput per mode: every measured run (dots), the predictions (x), the paper (dashes)."""
    fig = Figure(figsize=(7.0, 4.0), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    modes = [m for m in MODES if any(r["mode"] == m and "error" not in r for r in results)]
    for i, mode in enumerate(modes):
        color = plots.COLORS[i % len(plots.COLORS)]
        ok = [r for r in results if r["mode"] == mode and "error" not in r]
        for k, r in enumerate(ok):
            dx = 0.08 * (k - (len(ok) - 1) / 2)
            ax.plot(
                [i - 0.12 + dx],
                [100 * r["measured"]["steady_goodput"]],
                "o",
                color=color,
                label="measured (real processes)" if i == 0 and k == 0 else None,
            )
            ax.plot(
                [i + 0.12 + dx],
                [100 * r["predicted"]["steady_goodput"]],
                "x",
                color=color,
                markersize=9,
                label="predicted (simulator, same flags)" if i == 0 and k == 0 else None,
            )
        if mode in PAPER:
            ax.plot(
                [i - 0.3, i + 0.3],
                [PAPER[mode]] * 2,
                "--",
                color="gray",
                label="paper, 1.2M chips (88% vs 27%)" if mode == "decoupled" else None,
            )
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylim(0, 100)
    ax.set_ylabel("steady-state goodput (%)")
    ax.set_title("Goodput under failures: real processes vs the simulator")
    ax.legend(loc="upper right", fontsize="small")
    return fig


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not modes or set(modes) - set(MODES) or not seeds:
        print(
            f"diloco bench goodput: choose modes from {', '.join(MODES)} and give integer --seeds",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="diloco-goodput-") as tmp:
        root = a.runs_dir or Path(tmp)
        for seed in seeds:
            for mode in modes:
                r = run_one(mode, seed, a, root)
                results.append(r)
                outcome = (
                    r["error"]
                    if "error" in r
                    else (
                        f"steady {_pct(r['measured']['steady_goodput'])} vs predicted {_pct(r['predicted']['steady_goodput'])}"
                    )
                )
                print(f"{mode} seed {seed}: {outcome} ({r['wall_s']:.0f} s)", flush=True)
    print(report(results))
    s = summary(results)
    print(render_summary(s))
    print(f"({time.perf_counter() - started:.0f} s in all)")
    experiment.write_json(a.json, {"results": results, "summary": s})
    plots.emit(a, "goodput", lambda: figure(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
