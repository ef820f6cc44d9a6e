"""Benchmark `startup`: what a learner process costs to start, phase by phase, next to bare Python.

Every repeat runs, one after the other so that the machine's load affects all alike:

- ``python -c pass`` (the interpreter alone) and ``python -c 'import torch'`` (the floor of any
  PyTorch learner), timed from launch to exit;
- a **start**: a learner process exactly as ``diloco run`` launches it (same command line and
  environment, one CPU thread), with no checkpoint, against a real synchronizer process, stopping
  after its first step;
- a **restart**: the same learner launched again, resuming from the checkpoint the start wrote.

The learners report their own start-up (``diloco_worker.startup``): seconds from the creation of
the process to the end of its first training step, split into phases (imports, unit, task,
optimizer, checkpoint, register, first step). Medians over the repeats are printed with each
total's ratio to ``import torch`` of the same repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco_worker.startup import PHASES

from diloco.runner.commands import (
    RunPaths,
    build_synchronizer_argv,
    build_synchronizer_env,
    build_worker_argv,
)
from diloco.runner.commands import build_worker_env as worker_env
from diloco.runner.processes import Child, free_port, launch, stop_all
from diloco.runner.settings import RunSettings
from diloco_bench import experiment

SECRET = "bench-startup-secret"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco bench startup", description=__doc__.splitlines()[0])
    p.add_argument(
        "--repeats", type=int, default=3, help="starts and restarts of a learner (default %(default)s)"
    )
    model = RunSettings().model  # diloco run's default model
    p.add_argument("--n-layer", type=int, default=model.n_layer)
    p.add_argument("--n-embd", type=int, default=model.n_embd)
    p.add_argument("--block-size", type=int, default=model.block_size)
    experiment.output_flags(p, plot=False)
    return p


def timed(argv: Sequence[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Wall seconds from launch to exit of a short command (it must succeed), and its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(list(argv), check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": wall, "cpu_s": cpu}


def startup_records(metrics: Path) -> dict[int, dict[str, Any]]:
    """The start-up figures of each learner process (by pid) in a metrics file."""
    out: dict[int, dict[str, Any]] = {}
    if not metrics.exists():
        return out
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "startup_s" in record:
            out[int(record["pid"])] = record
    return out


class Learners:
    """A synchronizer and the learner command lines ``diloco run`` would use, in a scratch folder."""

    def __init__(self, a: argparse.Namespace, root: Path) -> None:
        model = RunSettings().model.model_copy(
            update={"n_layer": a.n_layer, "n_embd": a.n_embd, "block_size": a.block_size}
        )
        self.settings = RunSettings(learners=a.repeats, model=model, python=sys.executable, mtbf_s=0.0)
        self.paths = RunPaths(root)
        for sub in ("logs", "storage", "checkpoints", "metrics"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sync: Child | None = None

    def start_synchronizer(self) -> None:
        argv = build_synchronizer_argv(self.settings, self.paths, port=self.port)
        env = build_synchronizer_env(dict(os.environ), job_secret=SECRET)
        sync = self.sync = launch("synchronizer", argv, self.paths.log_file("synchronizer"), env)
        from diloco_bench.sync_process import wait_ready  # imports httpx: only when a synchronizer runs

        try:
            wait_ready(self.url, sync.alive, 120.0)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; see {sync.log_path}") from None

    def run(self, learner: int, max_steps: int) -> dict[str, Any]:
        """Launch learner ``learner`` to train up to ``max_steps`` and wait for it; its start-up record."""
        train = self.settings.train.model_copy(update={"max_steps": max_steps})
        settings = self.settings.model_copy(update={"train": train})
        argv = build_worker_argv(settings, self.paths, learner, sync_url=self.url)
        env = worker_env(settings, learner, dict(os.environ), job_secret=SECRET, master_port=0)
        child = launch(f"learner-{learner}", argv, self.paths.log_file(f"learner-{learner}"), env)
        code = child.popen.wait(timeout=600)
        records = startup_records(self.paths.metrics_file(learner))
        if code != 0 or child.pid not in records:
            raise RuntimeError(
                f"learner {learner} exited with {code} without a start-up record:\n{child.log_tail()}"
            )
        return records[child.pid]

    def close(self) -> None:
        if self.sync is not None:
            stop_all([self.sync], 15.0)


def measure(a: argparse.Namespace, root: Path) -> dict[str, list[Any]]:
    """Every repeat's figures: bare Python, import torch, a start and a restart of a learner."""
    python = [sys.executable, "-c", "pass"]
    torch_only = [sys.executable, "-c", "import torch"]
    one_thread = dict(os.environ) | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    learners = Learners(a, root)
    learners.start_synchronizer()
    out: dict[str, list[Any]] = {"python": [], "import_torch": [], "start": [], "restart": []}
    try:
        for r in range(a.repeats):
            out["python"].append(timed(python, one_thread))
            out["import_torch"].append(timed(torch_only, one_thread))
            out["start"].append(learners.run(r, max_steps=1))
            out["restart"].append(learners.run(r, max_steps=2))
            print(
                f"repeat {r + 1}/{a.repeats}: import torch {out['import_torch'][-1]['wall_s']:.2f} s, start "
                f"{out['start'][-1]['startup_s']:.2f} s, restart {out['restart'][-1]['startup_s']:.2f} s",
                flush=True,
            )
    finally:
        learners.close()
    return out


def summarize(raw: dict[str, list[Any]]) -> dict[str, Any]:
    """Medians of wall and CPU seconds: the baselines, and per kind (start, restart) the total and
    each phase, with the totals' ratios to ``import torch``."""
    med = statistics.median
    summary: dict[str, Any] = {}
    for base in ("python", "import_torch"):
        summary[base] = {unit: med(x[unit] for x in raw[base]) for unit in ("wall_s", "cpu_s")}
    torch_wall, torch_cpu = summary["import_torch"]["wall_s"], summary["import_torch"]["cpu_s"]
    for kind in ("start", "restart"):
        records = raw[kind]
        wall, cpu = med(r["startup_s"] for r in records), med(r["startup_cpu_s"] for r in records)
        summary[kind] = {
            "wall_s": wall,
            "cpu_s": cpu,
            "wall_vs_import_torch": wall / torch_wall,
            "cpu_vs_import_torch": cpu / torch_cpu,
            "phases_wall_s": {p: med(r["startup_phases"].get(p, 0.0) for r in records) for p in PHASES},
            "phases_cpu_s": {p: med(r["startup_cpu_phases"].get(p, 0.0) for r in records) for p in PHASES},
        }
    return summary


def report(summary: dict[str, Any], repeats: int) -> str:
    start, restart = summary["start"], summary["restart"]
    rows: list[list[object]] = []
    for name, key in (("`python -c pass`", "python"), ("`python -c 'import torch'`", "import_torch")):
        wall, cpu = summary[key]["wall_s"], summary[key]["cpu_s"]
        rows.append([name, f"{wall:.2f}", "", f"{cpu:.2f}", ""])
    for phase in PHASES:
        rows.append(
            [
                phase,
                f"{start['phases_wall_s'][phase]:.2f}",
                f"{restart['phases_wall_s'][phase]:.2f}",
                f"{start['phases_cpu_s'][phase]:.2f}",
                f"{restart['phases_cpu_s'][phase]:.2f}",
            ]
        )
    rows.append(
        [
            "**learner: launch to end of first step**",
            f"**{start['wall_s']:.2f}**",
            f"**{restart['wall_s']:.2f}**",
            f"**{start['cpu_s']:.2f}**",
            f"**{restart['cpu_s']:.2f}**",
        ]
    )
    rows.append(
        [
            "learner / `import torch`",
            f"{start['wall_vs_import_torch']:.2f}x",
            f"{restart['wall_vs_import_torch']:.2f}x",
            f"{start['cpu_vs_import_torch']:.2f}x",
            f"{restart['cpu_vs_import_torch']:.2f}x",
        ]
    )
    headers = ["phase", "start s", "restart s", "start CPU-s", "restart CPU-s"]
    return experiment.table(headers, rows) + f"\n\n(medians of {repeats} repeats; one CPU thread per process)"


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if a.repeats < 1:
        print("diloco bench startup: --repeats must be >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diloco-startup-") as tmp:
        raw = measure(a, Path(tmp))
    summary = summarize(raw)
    print(report(summary, a.repeats))
    print(f"({time.perf_counter() - started:.0f} s in all)")
    experiment.write_json(a.json, {"summary": summary, "raw": raw})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
