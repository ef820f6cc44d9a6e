"""Benchmark `queue`: goodput of a 4-learner job under a Kueue quota, each unit admitted on its own
against the same job admitted whole (the data-parallel rule).

On the test control plane (kwok nodes, Kueue built with its webhooks, ``diloco operator`` as a
process) the job is created twice, each time in a fresh namespace and queue:

- ``elastic``: four one-pod learner units, each its own Kueue workload;
- ``whole``: one unit of four pods, one workload that Kueue admits only when all four fit.

Both live through the same quota, ``--phase-seconds`` each: 2 learner pods of quota, then 4, then 4
with one taken by a higher-priority pod in the same queue (it preempts), then 4 again. A pod on kwok
is only its object, so the benchmark runs what the pod would: while a learner's pod is Running, a
real learner process (``python -m diloco_worker``, the settings of ``diloco run``) trains against one
real synchronizer process; when the pod goes (preempted, queued), the process gets SIGTERM, which a
kubelet sends, and checkpoints; when the pod runs again, a new process resumes from the checkpoint.

Printed per mode: tokens trained (the learners' own counts, as the synchronizer holds them), quota
unit-seconds (learner pods of quota the job could use, times seconds: the urgent pod's CPU is not the
job's), tokens per unit-second of quota (the goodput), unit-seconds the learners' pods ran, tokens
per running unit-second, learner launches; and per phase the mean running learners and tokens
trained; the elastic job's goodput over the whole job's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from diloco_bench import experiment, plots

MODES = ("elastic", "whole")


@dataclass(frozen=True)
class Phase:
    name: str
    quota: int  # learner pods the ClusterQueue's quota holds
    urgent: bool  # a higher-priority pod holds one of them

    @property
    def share(self) -> int:
        """Learner pods of quota this job can use."""
        return self.quota - int(self.urgent)


PHASES = (
    Phase("quota 2", 2, False),
    Phase("quota 4", 4, False),
    Phase("quota 4, 1 preempted", 4, True),
    Phase("quota 4 again", 4, False),
)


@dataclass
class Sample:
    t: float
    running: int  # learners whose pod runs
    tokens: int  # tokens trained so far


@dataclass
class ModeResult:
    mode: str
    phase_s: float
    samples: list[Sample] = field(default_factory=list)
    launches: int = 0
    tokens: int = 0

    @property
    def quota_unit_s(self) -> float:
        return sum(p.share for p in PHASES) * self.phase_s

    @property
    def running_unit_s(self) -> float:
        return unit_seconds(self.samples, 0.0, len(PHASES) * self.phase_s)

    @property
    def goodput(self) -> float:
        """Tokens trained per learner pod of quota per second."""
        return self.tokens / self.quota_unit_s

    def phases(self) -> list[tuple[str, float, int]]:
        """Per phase: its name, the mean learners running, the tokens trained in it."""
        out = []
        for i, phase in enumerate(PHASES):
            start, end = i * self.phase_s, (i + 1) * self.phase_s
            mean = unit_seconds(self.samples, start, end) / self.phase_s
            out.append((phase.name, mean, tokens_at(self.samples, end) - tokens_at(self.samples, start)))
        return out


def unit_seconds(samples: Sequence[Sample], start: float, end: float) -> float:
    """The integral of running learners over [start, end], each sample holding until the next."""
    total = 0.0
    for here, after in zip(samples, [*samples[1:], None], strict=True):
        lo = max(here.t, start)
        hi = min(after.t if after is not None else end, end)
        if hi > lo:
            total += here.running * (hi - lo)
    return total


def tokens_at(samples: Sequence[Sample], t: float) -> int:
    """The tokens trained by time ``t`` (the last sample at or before it)."""
    before = [s.tokens for s in samples if s.t <= t]
    return before[-1] if before else 0


def table(results: Sequence[ModeResult]) -> str:
    lines = [
        "| mode | tokens trained | quota unit-s | tokens / quota unit-s | running unit-s | "
        "tokens / running unit-s | launches |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        per_running = r.tokens / r.running_unit_s if r.running_unit_s else 0.0
        lines.append(
            f"| {r.mode} | {r.tokens:,} | {r.quota_unit_s:.0f} | {r.goodput:.1f} | {r.running_unit_s:.0f} | "
            f"{per_running:.1f} | {r.launches} |"
        )
    lines += ["", "| mode | " + " | ".join(p.name for p in PHASES) + " |", "|---" * (len(PHASES) + 1) + "|"]
    for r in results:
        cells = [f"{mean:.2f} running, {tokens:,} tok" for _, mean, tokens in r.phases()]
        lines.append(f"| {r.mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(results: Sequence[ModeResult]) -> Figure:
    fig = Figure(figsize=(9.0, 4.0), layout="constrained")
    running, tokens = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, r in enumerate(results):
        color = plots.COLORS[i % len(plots.COLORS)]
        ts = [s.t for s in r.samples]
        running.step(ts, [s.running for s in r.samples], where="post", color=color, label=r.mode)
        tokens.plot(ts, [s.tokens for s in r.samples], color=color, label=r.mode)
    if results:
        phase_s = results[0].phase_s
        edges = [i * phase_s for i in range(len(PHASES) + 1)]
        shares = [p.share for p in PHASES] + [PHASES[-1].share]
        running.step(edges, shares, where="post", color="gray", linestyle="--", label="quota for the job")
    running.set_xlabel("seconds")
    running.set_ylabel("learners running")
    tokens.set_xlabel("seconds")
    tokens.set_ylabel("tokens trained")
    running.legend()
    tokens.legend()
    return fig


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench queue", description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-seconds", type=float, default=60.0, help="length of each quota phase")
    ap.add_argument(
        "--speed-factor",
        type=float,
        default=4.0,
        help="learners' step-time multiplier (they sleep the rest), so 4 learners and the control plane "
        "share this machine's cores without starving each other",
    )
    ap.add_argument("--modes", default=",".join(MODES), help="which of elastic,whole to run")
    ap.add_argument("--keep-logs", action="store_true", help="keep the control plane's and processes' logs")
    ap.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    plots.add_flags(ap)
    a = ap.parse_args(list(argv))
    modes = [m for m in a.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        ap.error(f"--modes takes {', '.join(MODES)}")

    from diloco_bench.queue_run import run_modes

    results = run_modes(a, modes)
    print(table(results), flush=True)
    by_mode = {r.mode: r for r in results}
    if "elastic" in by_mode and "whole" in by_mode and by_mode["whole"].goodput > 0:
        ratio = by_mode["elastic"].goodput / by_mode["whole"].goodput
        print(f"elastic / whole goodput: {ratio:.2f}x", flush=True)
    experiment.write_json(a.json, {"results": [asdict(r) | {"goodput": r.goodput} for r in results]})
    plots.emit(a, "queue", lambda: figure(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
