"""`diloco bench round-memory`: the memory one round of one fragment takes, against the number of
contributions it merges.

The synchronizer's own round (``diloco_sync.merging.run_round``: the checks, the merge, the outer
step, the compressed download and the encoded new version), then the outer state written into a
file as the commit writes it (``write_outer_state``), over contributions as the
synchronizer holds them once taken (``diloco_sync.ingest.validate_outer_gradient``: int4 payloads
decompressed but still quantized, their norm measured). The fragment is fragment 0 of
``sync-ingest``'s model (``--params`` in ``--fragments``); a first round makes the outer momentum
and the download residual, and the second is measured: the peak of the memory it allocates, and
what it still holds once done, in float32 sizes of the fragment (``tracemalloc``, which sees
numpy's arrays; the contributions themselves were allocated before it started).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import FragmentPlan
from diloco_core.outer import OuterState
from diloco_core.uploads import FileUpload
from diloco_sync.contribution import Contribution
from diloco_sync.ingest import payload_limit, validate_outer_gradient
from diloco_sync.merging import NothingMerged, RoundOutcome, run_round, write_outer_state

from diloco_bench.sync_ingest_payloads import framed, grad_parts, make_plan


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="diloco bench round-memory", description=__doc__)
    ap.add_argument("--params", type=float, default=20e6, help="the model's parameters")
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument(
        "--contributions", type=int, nargs="+", default=[1, 4, 16, 64], help="contributions per round"
    )
    ap.add_argument("--merge-rule", choices=["rda", "mean"], default="rda")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def contributions(plan: FragmentPlan, n: int, version: int) -> list[Contribution]:
    """``n`` learners' int4 outer gradients of ``plan``'s fragment 0 on ``version``, taken as the
    synchronizer takes them (a few distinct gradients, repeated: what a round holds does not depend
    on values)."""
    spec = plan.fragments[0]
    blobs = [framed(grad_parts(plan, 0, seed), 0, version) for seed in range(min(n, 4))]
    taken = []
    for i in range(n):
        blob = blobs[i % len(blobs)]
        checked = validate_outer_gradient(blob, spec, version, payload_limit(spec, None))
        taken.append(
            Contribution(
                learner_id=f"l{i}",
                fragment=0,
                base_version=version,
                seq=version,
                steps=16,
                tokens=16 * 4096,
                tensors=checked.tensors,
                nbytes=len(blob),
                received_at=0.0,
                norm=checked.norm,
            )
        )
    return taken


def measure(args: argparse.Namespace, n: int) -> dict[str, Any]:
    """The second round of fragment 0 with ``n`` contributions: its peak and what it holds after."""
    plan = make_plan(int(args.params), args.fragments)
    spec = plan.fragments[0]
    settings = DiLoCoSettings(
        fragments=args.fragments, inner_steps=plan.inner_steps, overlap=1, merge_rule=args.merge_rule
    )
    rng = np.random.default_rng(1)
    params = {t.name: rng.standard_normal(t.shape, dtype=np.float32) for t in spec.tensors}
    one = contributions(plan, 1, 0)
    first = run_round(spec, params, OuterState(), 0, one, settings)
    assert isinstance(first, RoundOutcome)
    params, outer = first.result.params, first.result.outer
    del first
    taken = contributions(plan, n, 1)
    fp32 = 4 * spec.numel
    tracemalloc.start()
    started = time.perf_counter()
    outcome = run_round(spec, params, outer, 1, taken, settings)
    if isinstance(outcome, RoundOutcome):
        with tempfile.TemporaryDirectory(prefix="round-memory-") as folder:
            upload = FileUpload(Path(folder), lambda upload: None)
            write_outer_state(upload, outcome.result.outer, spec.index, outcome.result.version)
            upload.discard()
    seconds = time.perf_counter() - started
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    if isinstance(outcome, NothingMerged):
        raise RuntimeError(f"the round merged nothing: {outcome.excluded}")
    return {
        "contributions": n,
        "merged": len(outcome.merged),
        "fragment_values": spec.numel,
        "largest_tensor_values": max(t.numel for t in spec.tensors),
        "peak_x": peak / fp32,
        "held_x": held / fp32,
        "round_s": seconds,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| contributions | merged | fragment values | peak, x fragment fp32 | held after, x fragment fp32 | round s (traced) |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['contributions']} | {r['merged']} | {r['fragment_values']:,} | {r['peak_x']:.2f} | "
            f"{r['held_x']:.2f} | {r['round_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(list(argv))
    rows = []
    for n in args.contributions:
        rows.append(measure(args, n))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "settings": {k: str(v) for k, v in vars(args).items()}})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
