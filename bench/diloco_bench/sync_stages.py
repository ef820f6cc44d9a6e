"""`diloco bench sync-stages`: the synchronizer's CPU time per stage of a contribution and of a
round, one core, no HTTP.

Each stage runs the synchronizer's own code on an int4 outer gradient of fragment 0 of
``sync-ingest``'s model (``--params`` in ``--fragments``), timed in CPU seconds (the least of
``--repeat`` runs): of this thread for the stages of a contribution, which run on one thread; of
the whole process for a round (BLAS may use threads of its own):

- **write**: the body written into an upload in the pieces the service writes (``body.WRITE_BYTES``;
  a ``FileUpload`` in a temporary folder, as the filesystem store takes a body);
- **decompress**: the payload's zstd frame read (``codec.decode_quantized``);
- **check**: the whole arrival check (``ingest.validate_outer_gradient``: decompression, the norm from
  the codes, finiteness);
- **serve**: the new version encoded as it is served and stored (``codec.encode_params``; part of
  the round), with **served / fp32**, its size against the fragment's float32 bytes;
- **learner decode**: what a learner that fetches the whole version spends decoding it
  (``codec.decode`` of the served payload, as the learner's poller and catch-up do);
- **round**: the synchronizer's round of ``--contributions`` contributions C
  (``merging.run_round``: checks, merge, outer step, compressed download, the encoded new version),
  then the outer state written into a file as a commit writes it (``write_outer_state``), and the
  new version too where the commit encodes it as it writes it (a fragment served from storage,
  ``write_version``); the second round is timed, so momentum and residual exist, after one more
  untimed, so that the heap holds the pages a round takes, as it does in a synchronizer that has
  run a few rounds (the first rounds of a large fragment fault its arrays in: at a billion
  parameters, seconds of the kernel's zeroing of pages);
- **state read**: a fragment served from storage (larger than ``--served-in-memory-bytes``) lets
  its state go between rounds; its round reads it back (``held_state.read_state``) from the objects
  the commit wrote (its version and its outer state, in the filesystem store). It is not in the
  floor, which the rounds of a fragment held in memory do not pay;
- **fold**: what one more part of a learner's progress adds to its round: a contribution folded
  from two parts (``contribution.fold``) has no norm from arrival, so the round's merge measures it
  as it reads the parts once (``merge_inputs.MeasuredTensors``, ``screening``); the stage is that
  reading, less the reading of the first part alone (whose norm came from arrival). Either is added
  into the round's sum once, so the rest of the round is the same. (A difference of two whole rounds
  would say the same, but the noise of a round on shared cores is larger than a part's reading.)

With two or more ``--contributions``, a round's CPU time is fitted as a line against the number of
contributions it merges (``round_scaling``): its **fixed** part (the outer step, the new version
and the outer state encoded and written, the download's update) and its part **per contribution**
(decoding and adding one more into the merge); **one more contribution** is the parameters per CPU
second of a contribution's own work, write, check and that part of the merge. The other stages do
not depend on C: they are measured once per model size, and every row of that size shows them.

Per contribution the service does at least write, check and its share of a round: **floor** is
the parameters per CPU second that these alone allow, ``values / (write + check + round / C)``; with
each contribution folded from several parts, every further part adds a write, a check and a fold
(**floor, per further part**). Receiving the body over HTTP, the metrics and storage other than the
body's file are not in it, so the service's measured rate (``sync-ingest``'s params/cpu-s) is below.
The process takes the synchronizer's allocator settings first (``heap.limit_heap``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from diloco_core import codec
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import Fragment, FragmentPlan
from diloco_core.heap import limit_heap
from diloco_core.merge_inputs import MeasuredTensors
from diloco_core.outer import OuterState
from diloco_core.storage import FilesystemStore
from diloco_core.uploads import FileUpload
from diloco_sync.body import WRITE_BYTES
from diloco_sync.contribution import Arrays, Contribution, fold
from diloco_sync.held_state import InStorage, read_state
from diloco_sync.ingest import payload_limit, validate_outer_gradient
from diloco_sync.merging import RoundOutcome, run_round, write_outer_state, write_version
from diloco_sync.object_writes import put_contents
from diloco_sync.persistence import StateStore
from diloco_sync.publication import DEFAULT_SERVED_IN_MEMORY, served_from_storage

from diloco_bench.round_memory import contributions
from diloco_bench.sync_ingest_payloads import framed, grad_parts, make_plan


def cpu_ms(run: Callable[[], object], repeat: int, clock: Callable[[], float] = time.thread_time) -> float:
    """The least CPU time of ``repeat`` runs of ``run`` by ``clock``, in ms."""
    best = float("inf")
    for _ in range(repeat):
        started = clock()
        run()
        best = min(best, clock() - started)
    return 1000 * best


def write_body(blob: bytes, folder: Path) -> None:
    """The body into an upload, ``WRITE_BYTES`` at a time, then let go."""
    upload = FileUpload(folder, lambda upload: None)
    for start in range(0, len(blob), WRITE_BYTES):
        upload.write(blob[start : start + WRITE_BYTES])
    upload.discard()


def read_all(g: Mapping[str, object]) -> None:
    """Every tensor of ``g`` read, as a merge reads them."""
    for name in g:
        g[name]


def committed_state(store: FilesystemStore, spec: Fragment, params: Arrays, outer: OuterState) -> InStorage:
    """A version's parameters and outer state written as a commit writes them; where they are."""
    put_contents(store, "params", partial(write_version, params=params, fragment=spec.index, version=1))
    put_contents(store, "outer", partial(write_outer_state, state=outer, fragment=spec.index, version=1))
    return InStorage("params", "outer")


def folded(plan: FragmentPlan, version: int) -> tuple[Contribution, Contribution]:
    """A contribution on ``version`` as ``round_memory.contributions`` makes it, and the same
    learner's progress folded from it and a second part (another learner's gradient)."""
    a, b = contributions(plan, 2, version)
    return a, fold(a, replace(b, learner_id=a.learner_id, seq=a.seq + 1, since=a.through, through=-1))


def measure(params: float, fragments: int, counts: list[int], repeat: int) -> list[dict[str, Any]]:
    """Every stage's CPU ms for fragment 0 of a ``params``-parameter model, one row per round size in
    ``counts``: the stages that do not depend on a round's size are measured once and shared."""
    plan = make_plan(int(params), fragments)
    spec = plan.fragments[0]
    blob = framed(grad_parts(plan, 0, 0), 0)
    limit = payload_limit(spec, None)
    settings = DiLoCoSettings(fragments=fragments, inner_steps=plan.inner_steps, overlap=1)
    rng = np.random.default_rng(1)
    state = {t.name: rng.standard_normal(t.shape, dtype=np.float32) for t in spec.tensors}
    first = run_round(spec, state, OuterState(), 0, contributions(plan, 1, 0), settings)
    assert isinstance(first, RoundOutcome)
    state, outer = first.result.params, first.result.outer
    del first
    one, two = folded(plan, 1)
    served = codec.encode_params(state, spec.index, 1)

    with tempfile.TemporaryDirectory(prefix="sync-stages-") as root:
        folder = Path(root)
        store = FilesystemStore(folder / "store")
        in_round = not served_from_storage(spec, DEFAULT_SERVED_IN_MEMORY)

        def round_and_commit(taken: list[Contribution]) -> None:
            outcome = run_round(spec, state, outer, 1, taken, settings, encode_version=in_round)
            assert isinstance(outcome, RoundOutcome), outcome
            result = outcome.result
            for key, write in (
                ("outer", partial(write_outer_state, state=result.outer)),
                *([] if in_round else [("version", partial(write_version, params=result.params))]),
            ):
                upload = store.open_upload(key, read_back=False)  # the commit's uploads, not committed
                write(upload, fragment=spec.index, version=result.version)
                upload.discard()

        # the heap's pages faulted in (by the largest round), as in a synchronizer past its first rounds
        round_and_commit(contributions(plan, max(counts), 1))
        at = committed_state(store, spec, state, outer)
        state_store = StateStore(store, 0, "sync-stages")
        shared = {
            "write": cpu_ms(lambda: write_body(blob, folder), repeat),
            "decompress": cpu_ms(lambda: codec.decode_quantized(blob, fragment=spec), repeat),
            "check": cpu_ms(lambda: validate_outer_gradient(blob, spec, 0, limit), repeat),
            "fold": cpu_ms(lambda: read_all(MeasuredTensors(two.tensors)), repeat)
            - cpu_ms(lambda: read_all(one.tensors), repeat),
            "serve": cpu_ms(lambda: codec.encode_params(state, spec.index, 1), repeat),
            "learner decode": cpu_ms(lambda: codec.decode(served, fragment=spec), repeat),
            "state read": cpu_ms(lambda: read_state(state_store, spec, at), repeat, time.process_time),
        }
        rounds = {}
        for n in counts:
            taken = contributions(plan, n, 1)
            rounds[n] = cpu_ms(partial(round_and_commit, taken), repeat, time.process_time)
            del taken
    return [_row(spec, len(blob), len(served), n, {**shared, "round": rounds[n]}) for n in counts]


def _row(spec: Fragment, payload: int, served: int, n: int, ms: dict[str, float]) -> dict[str, Any]:
    """A round size's figures: the stages' CPU ms and the floors they give."""
    per_contribution = ms["write"] + ms["check"] + ms["round"] / n
    per_part = ms["write"] + ms["check"] + ms["fold"]
    return {
        "fragment_values": spec.numel,
        "payload_bytes": payload,
        "served_over_fp32": served / (4 * spec.numel),
        "contributions": n,
        "ms": ms,
        "floor_params_per_cpu_s": spec.numel / (per_contribution / 1000),
        "floor_per_part_params_per_cpu_s": spec.numel / (per_part / 1000),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| fragment values | payload bytes | write ms | decompress ms | check ms | fold ms | serve ms "
        "| served / fp32 | learner decode ms | round ms (C contributions) | state read ms "
        "| floor, G params/CPU-s | floor per further part |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['fragment_values']:,} | {r['payload_bytes']:,} | {ms['write']:.1f} | {ms['decompress']:.1f} | "
            f"{ms['check']:.1f} | {ms['fold']:.1f} | {ms['serve']:.1f} | {r['served_over_fp32']:.4f} | "
            f"{ms['learner decode']:.1f} | {ms['round']:,.0f} ({r['contributions']}) | "
            f"{ms['state read']:,.0f} | "
            f"{r['floor_params_per_cpu_s'] / 1e9:.3f} | {r['floor_per_part_params_per_cpu_s'] / 1e9:.3f} |"
        )
    return "\n".join(lines)


def round_scaling(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A round's CPU ms against its number of contributions C, from rows of one fragment measured at
    two or more C: the least-squares line ``fixed + per_contribution * C``, and the parameters per
    CPU second of one more contribution (its write, its check and its share of the merge)."""
    counts = [r["contributions"] for r in rows]
    if len(set(counts)) < 2:
        raise ValueError(f"a line needs rounds of two or more sizes, not {counts}")
    per_contribution, fixed = np.polyfit(counts, [r["ms"]["round"] for r in rows], 1)
    marginal = min(r["ms"]["write"] for r in rows) + min(r["ms"]["check"] for r in rows) + per_contribution
    return {
        "fragment_values": rows[0]["fragment_values"],
        "contributions": counts,
        "fixed_ms": float(fixed),
        "per_contribution_ms": float(per_contribution),
        "per_contribution_params_per_cpu_s": rows[0]["fragment_values"] / (marginal / 1000),
    }


def scaling_table(lines: list[dict[str, Any]]) -> str:
    out = [
        "| fragment values | rounds of C | round ms, fixed | round ms per contribution "
        "| one more contribution (write, check, merge), G params/CPU-s |",
        "|--:|:--|--:|--:|--:|",
    ]
    for x in lines:
        out.append(
            f"| {x['fragment_values']:,} | {', '.join(map(str, x['contributions']))} | {x['fixed_ms']:,.0f} | "
            f"{x['per_contribution_ms']:,.1f} | {x['per_contribution_params_per_cpu_s'] / 1e9:.3f} |"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench sync-stages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, nargs="+", default=[20e6, 200e6], help="model sizes")
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument(
        "--contributions",
        type=int,
        nargs="+",
        default=[4],
        help="contributions per round (two or more: a line of a round's cost against them too)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per stage (the least CPU time is kept)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    limit_heap(reuse_large=True)  # as the synchronizer does (diloco_sync.cli), before any thread
    per_size = [measure(p, args.fragments, args.contributions, args.repeat) for p in args.params]
    rows = [row for rows in per_size for row in rows]
    print(table(rows))
    lines = [round_scaling(rows) for rows in per_size] if len(set(args.contributions)) > 1 else []
    if lines:
        print()
        print(scaling_table(lines))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "scaling": lines}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
