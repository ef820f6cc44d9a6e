"""Benchmark `bandwidth`: bytes on the wire per token, mean and peak per learner, per method and codec.

Bytes are the real encoded sizes (``diloco_core.codec``, zstd included) of what each learner uploads:
a gradient every step for data-parallel, an outer gradient per fragment every H steps for DiLoCo.
Downloads (the merged global fragments, fp32) are shown separately. The paper's headline is
198 Gbps -> 0.84 Gbps (about 235x) across 8 datacenters.
"""

from __future__ import annotations

import statistics
import sys

from diloco_bench import experiment, harness, plots, runs, workload


def methods(learners: int, inner_steps: int) -> list[runs.Method]:
    out = [runs.data_parallel(learners, "fp32"), runs.data_parallel(learners, "bf16")]
    out += [runs.diloco_sync(learners, inner_steps, wire) for wire in ("fp32", "bf16", "int4")]
    out += [runs.decoupled(learners, wire, inner_steps=inner_steps) for wire in ("fp32", "bf16", "int8", "int4", "e3m0")]
    return out


def main(argv: list[str]) -> int:
    p = experiment.parser("diloco bench bandwidth", __doc__, steps=32)
    p.add_argument("--learners", type=int, default=4, help="M (default %(default)s)")
    p.add_argument("--inner-steps", type=int, default=16, help="H (default %(default)s)")
    p.add_argument("--step-time", type=float, default=1.0, help="seconds per inner step for the Gbit/s column")
    a = p.parse_args(argv)
    experiment.check_inner_steps(p, a.inner_steps)
    if a.steps < a.inner_steps:
        p.error(f"--steps ({a.steps}) must be at least --inner-steps ({a.inner_steps}) to see a sync")
    w = experiment.workload_from(a)
    corpus = workload.Corpus(w)
    timing = runs.Timing(steps=a.steps)
    seed = experiment.seeds_from(a.seeds)[0]
    results = []
    for m in experiment.with_outer(methods(a.learners, a.inner_steps), a):
        r = harness.run(m, w, timing, corpus, seed)
        results.append(r)
        print(f"{m.name:<22} {r.bytes_per_token:10.2f} B/token  ({r.wall_s:.0f} s)", flush=True)
    print(report(results, a.step_time))
    experiment.write_json(a.json, results)
    plots.emit(a, "bandwidth", lambda: plots.bandwidth({r.method: r.bytes_per_token for r in results}, results[0].method))
    return 0


def report(results: list[runs.RunResult], step_time: float) -> str:
    base = results[0]
    rows = []
    for r in results:
        per_step = statistics.fmean(b / s for b, s in zip(r.bytes_up, r.steps, strict=True))
        peak = max(r.peak_up)
        rows.append([
            r.method, f"{r.bytes_per_token:.3f}", f"{base.bytes_per_token / r.bytes_per_token:.0f}x",
            experiment.human_bytes(per_step), experiment.human_bytes(peak), f"{max(base.peak_up) / peak:.0f}x",
            f"{per_step * 8 / step_time / 1e6:.3f}", f"{r.bytes_down / max(r.tokens, 1):.3f}",
        ])  # fmt: skip
    headers = [
        "method (wire)", "bytes up / token", "vs DP fp32", "mean up / learner-step", "peak up / learner-step",
        "peak vs DP fp32", f"mean Mbit/s per learner at {step_time:g} s/step", "bytes down / token",
    ]
    return experiment.table(headers, rows)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
