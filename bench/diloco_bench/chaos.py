"""Benchmark `chaos`: goodput and loss per wall-clock time under learner failures, with real processes.

Runs ``diloco run`` (one synchronizer and N learner processes on this machine) once per mode with
the same failure schedule (same ``--seed``, ``--mtbf``, ``--repair``): Decoupled DiLoCo, where a
killed learner only takes itself out, against the synchronous baselines (``ddp``: data-parallel
every step; ``diloco-sync``: K = all), which stall or restart on every failure. Each run's
``report.json`` gives goodput (useful / allocated learner time) and the global model's held-out loss
over wall-clock time; this compares them at the same wall-clock instant.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco_bench import experiment, plots

MODES = ("decoupled", "diloco-sync", "ddp")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco bench chaos", description=__doc__)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated (default %(default)s)")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=400, help="inner steps per learner")
    p.add_argument("--mtbf", type=float, default=60.0, help="mean seconds between failures of each learner")
    p.add_argument("--repair", type=float, default=6.0, help="seconds a killed learner stays down")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure schedule and the model")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per run at most")
    p.add_argument(
        "--runs-dir", type=Path, default=None, help="keep the run folders here (default: a temp dir)"
    )
    experiment.output_flags(p)
    p.add_argument("extra", nargs="*", help="more `diloco run` flags, after --")
    return p


def run_command(mode: str, a: argparse.Namespace, runs_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "diloco",
        "run",
        "--mode",
        mode,
        "--learners",
        str(a.learners),
        "--max-steps",
        str(a.max_steps),
        "--mtbf",
        str(a.mtbf),
        "--repair",
        str(a.repair),
        "--seed",
        str(a.seed),
        "--time-limit",
        str(a.time_limit),
        "--runs-dir",
        str(runs_dir),
        "--plain",
        *a.extra,
    ]


def run_and_read(cmd: list[str], runs_dir: Path, timeout_s: float) -> tuple[Path | str, float]:
    """Run a ``diloco run`` command line that writes its run folder under ``runs_dir``: the path of
    its ``report.json`` or the reason there is none, and the wall seconds it took."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    wall = time.perf_counter() - started
    reports = sorted(runs_dir.glob("*/report.json"))
    if proc.returncode != 0 or not reports:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return f"exit {proc.returncode}: {' / '.join(tail) or 'no report'}", wall
    return reports[-1], wall


def run_mode(mode: str, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Run one mode; its summary, or the reason it did not run."""
    runs_dir = root / mode
    report, wall = run_and_read(run_command(mode, a, runs_dir), runs_dir, a.time_limit + 120)
    if isinstance(report, str):
        return {"mode": mode, "error": report, "wall_s": wall}
    return summarize(mode, json.loads(report.read_text()), wall)


def summarize(mode: str, report: dict[str, Any], wall: float) -> dict[str, Any]:
    summary, record = report["summary"], report["record"]
    losses = [(float(s["wall_s"]), float(s["loss"])) for s in record.get("losses", [])]
    return {
        "mode": mode,
        "goodput": summary["goodput"]["goodput"],
        "final_loss": summary["final_loss"],
        "kills": summary["kills"],
        "unrejoined": summary["unrejoined"],
        "tokens": summary["total_tokens"],
        "duration_s": record.get("duration_s", wall),
        "losses": losses,
        "kill_times": [float(k["at_s"]) for k in record.get("kills", [])],
        "wall_s": wall,
    }


def loss_at(losses: list[tuple[float, float]], t: float) -> float | None:
    """The last held-out loss measured at or before wall-clock ``t``."""
    seen = [loss for at, loss in losses if at <= t]
    return seen[-1] if seen else None


def curves(summaries: list[dict[str, Any]]) -> list[tuple[str, list[tuple[float, float]], list[float]]]:
    """Per mode that ran: (mode, [(wall seconds, held-out loss)], kill times in seconds)."""
    return [(s["mode"], s["losses"], s.get("kill_times", [])) for s in summaries if "error" not in s]


def report(summaries: list[dict[str, Any]]) -> str:
    ok = [s for s in summaries if "error" not in s]
    horizon = min((s["duration_s"] for s in ok), default=0.0)
    rows = []
    for s in summaries:
        if "error" in s:
            rows.append([s["mode"], "did not run", "-", "-", "-", "-", s["error"]])
            continue
        at = loss_at(s["losses"], horizon)
        rows.append(
            [
                s["mode"],
                f"{s['goodput']:.1%}",
                f"{s['final_loss']:.4f}" if s["final_loss"] is not None else "n/a",
                "n/a" if at is None else f"{at:.4f}",
                f"{s['duration_s']:.0f}",
                s["kills"],
                f"{s['tokens']:,}",
            ]
        )
    headers = ["mode", "goodput", "final loss", f"loss at {horizon:.0f} s", "run s", "kills", "tokens"]
    return experiment.table(headers, rows)


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = sorted(set(modes) - set(MODES))
    if bad or not modes:
        print(f"diloco bench chaos: unknown mode(s) {bad}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="diloco-chaos-") as tmp:
        root = a.runs_dir or Path(tmp)
        summaries = []
        for mode in modes:
            s = run_mode(mode, a, root)
            summaries.append(s)
            outcome = s["error"] if "error" in s else f"goodput {s['goodput']:.1%}"
            print(f"{mode}: {outcome} ({s['wall_s']:.0f} s)", flush=True)
    print(report(summaries))
    experiment.write_json(a.json, summaries)
    plots.emit(a, "chaos", lambda: plots.chaos(curves(summaries)))
    return 0 if all("error" not in s for s in summaries) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
