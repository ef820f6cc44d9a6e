"""`diloco bench sync-ingest`: how fast the synchronizer takes contributions, next to a raw baseline.

For each client count N (default 1, 8, 32) and shard count M (``--shards``, default 1), M fresh
synchronizer processes (one filesystem store, quorum N, fragment p on shard p % M) serve N
concurrent asynchronous learners, each with pre-encoded int4 outer gradients:

- ``--mode stream`` (default): every learner contributes back to back, cycling over the fragments,
  while a long-poll per learner listens for new versions; this is the ingest throughput.
- ``--mode lockstep``: every learner contributes, then long-polls until the round that merges it is
  published and fetches the new version; this is the learner's round-trip latency.

A long-poll asks as a learner does (``--downloads updates``): holding the version it heard last
(``have``), it gets the update from it; ``--downloads whole``: every new version whole (from storage
for a fragment over ``--served-in-memory-bytes``).

Reported per N:

- ingest throughput in MB/s of contribution payloads and parameters/s taken,
- latency percentiles of a contribution (POST → 202) and, in lockstep, of a round trip (POST → new version),
- merge + outer-step time per round and fragment and rounds per second (from the services' /metrics),
- the synchronizer's CPU seconds and peak resident memory, summed over its shards,
- the parts answered 503 ``pending_full`` and sent again (``waits``: a learner's further part beyond
  ``--pending-memory-bytes`` waits for a round to free room),
- the commit and state read-back time per round (from /metrics), on a folder or, with
  ``--storage seaweedfs``, a bucket on a real S3 server (SeaweedFS, multipart and ranged reads),
- with ``--restart``: the synchronizers killed with SIGKILL at the end of the run and started again
  on the same storage, the seconds until ready, the rounds they run on what they read back and
  their peak memory,
- a raw baseline measured in the same run: the same N clients send the same bytes over plain TCP
  to a server that only reads and decompresses them; the ratio service/raw shows the overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from diloco_core import codec
from diloco_core.auth import learner_token
from diloco_core.fragments import FragmentPlan
from diloco_core.protocol import LEARNER_HEADER, VERSION_HEADER
from diloco_core.request_proof import ProofAuth

from diloco.runner.processes import free_port
from diloco_bench.sync_ingest_payloads import framed, grad_parts, make_plan
from diloco_bench.sync_ingest_raw import run_raw
from diloco_bench.sync_ingest_report import (
    CpuMark,
    Result,
    record_processes,
    record_rounds,
    report,
    scale_lines,
    summary_row,
)
from diloco_bench.sync_process import (
    SECRET,
    SYNC_FLAGS,
    bench_storage,
    service_figures,
    start_shards,
    stop,
    storage_problem,
    sync_flags,
    timed_restart,
)

# -- the service run ---------------------------------------------------------------------------------


Shards = list[httpx.AsyncClient]
"""One learner's clients, one per synchronizer shard: fragment p is sent to ``shards[p % len(shards)]``."""


def signed_as(learner: str) -> dict[str, Any]:
    """A client's arguments for ``learner``: its header, and every request signed with its token."""
    return {"headers": {LEARNER_HEADER: learner}, "auth": ProofAuth(learner_token(SECRET, learner))}


async def setup_learners(urls: list[str], plan: FragmentPlan, clients: int) -> list[Shards]:
    """``clients`` learners registered with every shard; every fragment initialised on its shard."""
    out = []
    for i in range(clients):
        shards = [httpx.AsyncClient(base_url=url, timeout=120, **signed_as(f"l{i}")) for url in urls]
        body = {"learner_id": f"l{i}", "plan": plan.to_dict(), "plan_hash": plan.hash(), "tokens_per_step": 8}
        for c in shards:
            (await c.post("/v1/learners/register", json=body)).raise_for_status()
        out.append(shards)
    rng = np.random.default_rng(0)
    for f in plan.fragments:
        params = {t.name: rng.standard_normal(t.shape, dtype=np.float32) for t in f.tensors}
        blob = codec.encode(params, fragment=f.index, base_version=0, kind="params", quantizer="fp32")
        del params
        owner = out[0][f.index % len(urls)]
        (await owner.put(f"/v1/fragments/{f.index}/init", content=blob)).raise_for_status()
        del blob
    return out


STEPS_PER_SEND = 4


async def post_contribution(
    shards: Shards,
    blobs: list[bytes],
    p: int,
    seq: int,
    res: Result,
    sent: dict[int, tuple[int, int]],
    base_version: int = 0,
    stop_at: float = math.inf,
) -> float:
    """Contribute fragment ``p``'s payload once, record its latency (of the POST that is taken) and
    size; returns the start time.

    ``sent`` holds, per fragment, (base version, steps sent on it): a learner's next send on the same
    base continues its progress (``since``), as a worker's does, so the synchronizer adds it to the
    pending one or takes it after the merged point instead of refusing it as already merged. A part
    answered 503 ``pending_full`` is sent again after its ``Retry-After``, as a learner's is (counted
    in ``res.waits``), until ``stop_at``."""
    base, through = sent.get(p, (base_version, 0))
    since = through if base == base_version else 0
    started = time.perf_counter()
    params = {"base_version": base_version, "since": since, "steps": STEPS_PER_SEND, "tokens": 32, "seq": seq}
    while True:
        t0 = time.perf_counter()
        r = await shards[p % len(shards)].post(
            f"/v1/fragments/{p}/contributions", params=params, content=blobs[p]
        )
        if r.status_code != 503 or r.json().get("code") != "pending_full":
            break
        res.waits += 1
        if time.perf_counter() >= stop_at:
            return started
        await asyncio.sleep(float(r.headers.get("retry-after", "1")))
    r.raise_for_status()
    sent[p] = (base_version, since + STEPS_PER_SEND)
    res.contribute_ms.append(1000 * (time.perf_counter() - t0))
    res.contributions += 1
    res.payload_bytes += len(blobs[p])
    return started


async def learner_loop(
    shards: Shards,
    blobs: list[bytes],
    parts: list[dict[str, codec.QuantizedTensor]],
    plan: FragmentPlan,
    stop_at: float,
    res: Result,
    downloads: str = "updates",
) -> None:
    """Contribute, wait for the round that merges it, then contribute on the new version (the
    version itself is read and let go, as a learner's download, not held; ``downloads``:
    ``fetch_params``)."""
    known, blobs = {f.index: 0 for f in plan.fragments}, list(blobs)
    sent: dict[int, tuple[int, int]] = {}
    seq = 0
    while time.perf_counter() < stop_at:
        p = seq % len(plan.fragments)
        seq += 1
        t0 = await post_contribution(shards, blobs, p, seq, res, sent, base_version=known[p])
        # wait for the round that merges it, but not past the end of the run (the others have stopped)
        wait = min(60.0, max(stop_at - time.perf_counter(), 0.0))
        params = fetch_params(known[p], wait, downloads)
        async with shards[p % len(shards)].stream("GET", f"/v1/fragments/{p}", params=params) as g:
            async for piece in g.aiter_raw():
                if g.status_code == 200:
                    res.heard_bytes += len(piece)
        if g.status_code == 200:
            known[p] = int(g.headers[VERSION_HEADER])
            res.round_trip_ms.append(1000 * (time.perf_counter() - t0))
            blobs[p] = await asyncio.to_thread(framed, parts[p], p, known[p])


async def streaming_loop(
    shards: Shards, blobs: list[bytes], plan: FragmentPlan, stop_at: float, res: Result
) -> None:
    """Contribute back to back (each continues the learner's progress on its base); never wait for rounds."""
    sent: dict[int, tuple[int, int]] = {}
    seq = 0
    while time.perf_counter() < stop_at:
        p = seq % len(plan.fragments)
        seq += 1
        await post_contribution(shards, blobs, p, seq, res, sent, stop_at=stop_at)


def fetch_params(known: int, wait: float, downloads: str) -> dict[str, float | int]:
    """A long-poll's query for a version newer than ``known``: with ``known`` as the version held
    (``have``: the update from it) when ``downloads`` is ``updates``, else for the version whole."""
    return {"newer_than": known, "wait": wait, **({"have": known} if downloads == "updates" else {})}


async def long_poll_loop(shards: Shards, p: int, stop_at: float, res: Result, downloads: str) -> None:
    """A learner's background long-poll: hear about every new version of fragment p."""
    client, known = shards[p % len(shards)], 0
    while (remaining := stop_at - time.perf_counter()) > 0:
        g = await client.get(f"/v1/fragments/{p}", params=fetch_params(known, min(remaining, 5.0), downloads))
        if g.status_code == 200:
            known = int(g.headers[VERSION_HEADER])
            res.versions_heard += 1
            res.heard_bytes += len(g.content)


async def run_service(
    plan: FragmentPlan,
    blobs: list[list[bytes]],
    parts: list[list[dict[str, codec.QuantizedTensor]]],
    seconds: float,
    mode: str,
    shards: int = 1,
    flags: Sequence[str] = (),
    storage: str = "file",
    restart: bool = False,
    downloads: str = "updates",
) -> Result:
    """One run: a learner per list of ``blobs`` (its contribution to each fragment, framed on version 0
    from its ``parts``; lockstep frames them again on each new version); ``flags``: more settings of
    the synchronizers; ``storage``: ``file`` or ``seaweedfs``; ``restart``: at the end, the
    synchronizers are killed with SIGKILL and started again on the same storage (``timed_restart``);
    ``downloads``: how the long-polls ask for new versions (``fetch_params``)."""
    clients = len(blobs)
    with (
        tempfile.TemporaryDirectory(prefix="bench-sync-") as root,
        bench_storage(storage, Path(root)) as where,
    ):
        procs, urls = start_shards(where, plan, clients, shards, flags)
        try:
            learners = await setup_learners(urls, plan, clients)
            res = Result(mode, clients, 0.0, 0, 0, 0, 0, model_params=plan.num_params, shards=shards)
            res.storage, res.downloads = storage, downloads
            pids = [proc.pid for proc in procs]
            cpu_before = CpuMark.now(pids, where.server_pid)
            start = time.perf_counter()
            stop_at = start + seconds
            if mode == "lockstep":
                jobs = [
                    learner_loop(c, b, q, plan, stop_at, res, downloads)
                    for c, b, q in zip(learners, blobs, parts, strict=True)
                ]
            else:
                jobs = [
                    streaming_loop(c, b, plan, stop_at, res) for c, b in zip(learners, blobs, strict=True)
                ]
                jobs += [
                    long_poll_loop(c, i % len(plan.fragments), stop_at, res, downloads)
                    for i, c in enumerate(learners)
                ]
            await asyncio.gather(*jobs)
            res.seconds = time.perf_counter() - start
            record_processes(res, pids, cpu_before, where.server_pid)
            record_rounds(res, service_figures(urls), plan)
            for shards_of_one in learners:
                for c in shards_of_one:
                    await c.aclose()
            if restart:
                again = partial(start_shards, where, plan, clients, shards, flags, ready_timeout_s=600.0)
                procs = timed_restart(procs, res, seconds, again)
            return res
        finally:
            stop(procs)


# -- entry point -----------------------------------------------------------------------------------------


async def run_all(args: argparse.Namespace) -> list[Result]:
    results = []
    flags = sync_flags(args)
    for size in args.params:
        plan = make_plan(size, args.fragments)
        at_size = []
        parts = [  # learner i's contribution to fragment p, quantized once for every run at this size
            [grad_parts(plan, f.index, 100 * i + f.index) for f in plan.fragments]
            for i in range(max(args.clients))
        ]
        blobs = [[framed(q, p) for p, q in enumerate(of_one)] for of_one in parts]
        if args.mode != "lockstep":
            parts = [[] for _ in parts]  # framed once: let the quantized copies go
        for n in args.clients:
            runs = [
                await run_service(
                    plan,
                    blobs[:n],
                    parts[:n],
                    args.seconds,
                    args.mode,
                    m,
                    flags,
                    storage,
                    args.restart,
                    args.downloads,
                )
                for storage in args.storage
                for m in args.shards
            ]
            raw_mb_s = await run_raw(blobs[:n], args.seconds, free_port())
            for res in runs:
                res.raw_mb_s = raw_mb_s
                print(
                    f"  {size:,} params, {n} clients, {res.shards} shard(s) on {res.storage}: "
                    f"{res.contributions} contributions, "
                    f"{res.rounds} rounds, {res.versions_heard + len(res.round_trip_ms)} new versions heard "
                    f"by long-polls (downloads: {res.downloads})",
                    file=sys.stderr,
                )
            at_size += runs
        print(report(at_size, plan, len(blobs[0][0])), flush=True)
        results += at_size
    return results


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench sync-ingest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrent learners per run")
    ap.add_argument("--seconds", type=float, default=10.0, help="duration of each run")
    ap.add_argument(
        "--params",
        type=lambda v: int(float(v)),
        nargs="+",
        default=[2_000_000],
        help="model sizes in parameters (2e6 20e6 200e6: one table per size)",
    )
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument(
        "--shards",
        type=int,
        nargs="+",
        default=[1],
        help="synchronizer processes per run (1 2 4: a run each, fragment p on shard p %% shards)",
    )
    ap.add_argument(
        "--mode",
        choices=["stream", "lockstep"],
        default="stream",
        help="stream: contribute back to back while long-polling (ingest throughput); "
        "lockstep: contribute, then wait for the round's new version (round-trip latency)",
    )
    for flag in SYNC_FLAGS:  # e.g. a larger --served-in-memory-bytes holds a bigger fragment's state
        ap.add_argument(
            flag, type=lambda v: int(float(v)), help=f"the synchronizers' {flag} (default: theirs)"
        )
    ap.add_argument(
        "--storage",
        choices=["file", "seaweedfs"],
        nargs="+",
        default=["file"],
        help="the synchronizers' storage (a run each): a folder, or a bucket on a SeaweedFS S3 server "
        "started for the run",
    )
    ap.add_argument(
        "--restart",
        action="store_true",
        help="after each run, kill the synchronizers with SIGKILL and start them again on the same "
        "storage: the seconds until ready, the rounds on the contributions read back, peak memory",
    )
    ap.add_argument(
        "--downloads",
        choices=["updates", "whole"],
        default="updates",
        help="how the long-polls ask for new versions: as a learner that holds the one it heard last "
        "(the update from it), or whole",
    )
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument(
        "--plot-from",
        nargs="+",
        metavar="JSON",
        help="run nothing: plot the rows of earlier --json files (runs of different lengths, e.g. a "
        "billion parameters run longer than the smaller sizes)",
    )
    from diloco_bench import plots  # matplotlib: only for this command's own plot

    plots.add_flags(ap)
    args = ap.parse_args(argv)
    if not args.plot_from and (problem := storage_problem(args.storage)):
        ap.error(problem)
    if args.plot_from:
        rows = [row for name in args.plot_from for row in json.loads(Path(name).read_text())]
    else:
        rows = [summary_row(r) for r in asyncio.run(run_all(args))]
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    plots.emit(args, "sync-scale", lambda: plots.sync_scale(scale_lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
