"""`diloco bench NAME [options]`: run one benchmark; each prints its figures.

Every benchmark is a module of this package with ``main(argv) -> int``. The experiments (quality,
bandwidth, codecs, hetero, chaos, simulate, merge-rule, goodput) also write a PNG plot, ``NAME.png`` in
``--plot-dir`` (default ``bench-results/``; ``--no-plot`` to skip), and all take ``--json PATH``.
The latest figures and the command that produced them are kept in docs/benchmarks.md.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

BENCHMARKS: dict[str, tuple[str, str]] = {
    "codec": (
        "diloco_bench.codec",
        "bytes/param, throughput and error of each quantizer on real outer gradients",
    ),
    "sync-ingest": (
        "diloco_bench.sync_ingest",
        "synchronizer ingest throughput, latency, merge time vs raw baseline",
    ),
    "sync-stages": (
        "diloco_bench.sync_stages",
        "the synchronizer's CPU time per stage of a contribution and of a round (one core, no HTTP)",
    ),
    "worker": ("diloco_bench.worker", "learner tokens/s with DiLoCo vs a plain training loop; blocked time"),
    "round-memory": (
        "diloco_bench.round_memory",
        "one round's peak memory against the number of contributions it merges (the synchronizer's round)",
    ),
    "learner-scale": (
        "diloco_bench.learner_scale",
        "a learner's training-thread time per fragment synchronisation and peak memory, 2 M to 200 M parameters",
    ),
    "checkpoint": (
        "diloco_bench.checkpoint",
        "a learner's checkpoint: the training thread's time, whole save vs the snapshot it takes now",
    ),
    "startup": (
        "diloco_bench.startup",
        "seconds from a learner's launch to its first step, per phase, vs import torch",
    ),
    "simulate": ("diloco_bench.simulate", "the paper's Table 1 next to the simulator's"),
    "quality": (
        "diloco_bench.quality",
        "E1: held-out loss of data-parallel vs synchronous DiLoCo vs decoupled",
    ),
    "bandwidth": (
        "diloco_bench.bandwidth",
        "E2: bytes on the wire per token, mean and peak, vs data-parallel",
    ),
    "codecs": ("diloco_bench.codecs", "E3: loss vs bytes for fp32/bf16/int8/int4/e3m0 outer gradients"),
    "hetero": ("diloco_bench.hetero", "E4: mixed hardware, K=all vs K=1 vs K=1 + grace: goodput and loss"),
    "chaos": (
        "diloco_bench.chaos",
        "E5: goodput and loss under learner failures, real processes: decoupled vs diloco-sync vs ddp",
    ),
    "goodput": (
        "diloco_bench.goodput",
        "goodput of real processes under failures vs the simulator's prediction, per mode",
    ),
    "merge-rule": ("diloco_bench.merge_rule", "E7: mean vs RDA at M = 4, 8, 16: merged norm and loss"),
    "operator": (
        "diloco_bench.operator_scale",
        "a big job's status next to its pods on the test control plane: lag, going back, work done twice",
    ),
    "queue": (
        "diloco_bench.queue_goodput",
        "a 4-unit job under a Kueue quota: tokens per unit-second of quota, units admitted alone vs whole",
    ),
    "gpu": (
        "diloco_bench.gpu",
        "inner step tokens/s and MFU (eager, compiled), the device sync boundary, a short run",
    ),
    "attack": (
        "diloco_bench.attack",
        "one learner against the job, real synchronizer: norm bound, trickling uploads, sybil ids, continuations",
    ),
    "quantize": (
        "diloco_bench.quantize",
        "numpy vs torch quantizers, encode and decode, G params/s, bytes identical",
    ),
}


def usage() -> str:
    lines = ["usage: diloco bench NAME [options]", "", "benchmarks:"]
    lines += [f"  {name:<14} {summary}" for name, (_, summary) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name = args[0]
    if name not in BENCHMARKS:
        print(f"diloco bench: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[name][0])
    result: int = module.main(args[1:])
    return result
