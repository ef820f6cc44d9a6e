"""The ``continuations`` scenario of `diloco bench attack`: a learner sends its progress in parts
(``since``) while the synchronizer is killed with kill -9 at random moments, and every acknowledged
step is accounted for from the round logs."""

from __future__ import annotations

import argparse
import functools
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from diloco_worker.sync_client import SyncClient, SyncRejected

from diloco_bench.attack_job import (
    SHAPES,
    client,
    current_version,
    grad_blob,
    init_params,
    job_args,
    join,
    of_norm,
    plan,
    round_logs,
    until_answered,
)
from diloco_bench.sync_process import BenchSync


class Killer:
    """kill -9 of the synchronizer, and its restart, at random moments in a thread, at most ``limit``
    times or until ``stop`` is set."""

    def __init__(self, sync: BenchSync, limit: int, pyrng: random.Random) -> None:
        self.sync, self.limit, self.pyrng = sync, limit, pyrng
        self.kills = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.kills < self.limit and not self.stop.wait(self.pyrng.uniform(0.5, 2.0)):
            self.sync.kill9()
            self.sync.start()
            self.kills += 1


@dataclass
class PartsLedger:
    """What the two learners were answered."""

    acked: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # key -> (base, since, steps)
    superseded: set[str] = field(default_factory=set)
    refused: dict[str, int] = field(default_factory=dict)
    other_refused: dict[str, int] = field(default_factory=dict)
    # the other learner's progress sent per version (its ``since``)
    other_at: dict[int, int] = field(default_factory=dict)


def continuations(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A learner sends its progress in parts of 1-4 steps (``since``), in order, each resent until
    answered; a second learner's contribution after each part makes the quorum of 2 merge. kill -9
    at random moments. A refused part (its base stale, say) makes the learner take the current
    version, which supersedes its unmerged parts on the old base (by design: its local progress is
    overwritten). From the round logs: steps merged twice, and acknowledged steps neither merged,
    nor superseded, nor still pending (lost)."""
    the_plan, rng, pyrng = plan(), np.random.default_rng(args.seed), random.Random(args.seed)
    store, log = tmp / "continuations", tmp / "continuations.log"
    sync = BenchSync(store, job_args(2, "--log-level", "INFO"), log=log)
    sync.start()
    a, b = client(sync, "parts"), client(sync, "other")
    killer = Killer(sync, args.kills, pyrng)
    try:
        for c in (a, b):
            join(c, the_plan)
        init_params(a, {name: np.zeros(shape, np.float32) for name, shape in SHAPES})
        killer.thread.start()
        ledger = PartsLedger()
        _send_parts(a, b, rng, pyrng, time.monotonic() + args.seconds, killer.thread, ledger)
        killer.stop.set()
        killer.thread.join(timeout=120)
        _settle(a)
        return _figures(killer.kills, ledger, a, store, log)
    finally:
        killer.stop.set()
        a.close()
        b.close()
        sync.stop()


def _send_parts(
    a: SyncClient,
    b: SyncClient,
    rng: np.random.Generator,
    pyrng: random.Random,
    deadline: float,
    killer: threading.Thread,
    ledger: PartsLedger,
) -> None:
    """Parts from ``a`` until the deadline and the last kill, each followed by a step of ``b``."""
    seq, version, since = 0, 0, 0
    while time.monotonic() < deadline or killer.is_alive():
        steps = pyrng.randint(1, 4)
        seq += 1
        blob = grad_blob(of_norm(rng, 0.01 * steps), version)
        answer = until_answered(
            functools.partial(
                a.contribute,
                0,
                blob,
                base_version=version,
                steps=steps,
                tokens=8 * steps,
                seq=seq,
                since=since,
            )
        )
        if isinstance(answer, SyncRejected):
            ledger.refused[answer.code] = ledger.refused.get(answer.code, 0) + 1
            ledger.superseded |= {k for k, (base, _, _) in ledger.acked.items() if base == version}
            version, since = current_version(a), 0  # take the current version: progress starts afresh
            continue
        ledger.acked[f"parts/0/{version}/{seq}"] = (version, since, steps)
        since += steps
        _other_step(b, rng, seq, ledger)


def _other_step(b: SyncClient, rng: np.random.Generator, seq: int, ledger: PartsLedger) -> None:
    """The other learner's next step on the current version, until taken (at most 10 tries)."""
    for _ in range(10):
        other = current_version(b)
        other_blob = grad_blob(of_norm(rng, 0.01), other)
        taken = until_answered(
            functools.partial(
                b.contribute,
                0,
                other_blob,
                base_version=other,
                steps=1,
                tokens=8,
                seq=seq,
                since=ledger.other_at.get(other, 0),
            )
        )
        if not isinstance(taken, SyncRejected):
            ledger.other_at[other] = ledger.other_at.get(other, 0) + 1
            break
        ledger.other_refused[taken.code] = ledger.other_refused.get(taken.code, 0) + 1


def _settle(a: SyncClient) -> None:
    """Until nothing is pending and no round committed for a second (at most 30 s): the last round
    merges after the last answer."""
    settle, last = time.monotonic() + 30, (-1, -1)
    while time.monotonic() < settle:
        fragment = a.status().fragments[0]
        if (fragment.version, fragment.pending) == last and not fragment.pending:
            break
        last = (fragment.version, fragment.pending)
        time.sleep(1.0)


def _figures(kills: int, ledger: PartsLedger, a: SyncClient, store: Path, log: Path) -> dict[str, Any]:
    """Each acknowledged step merged once, superseded, or still pending; the rest unaccounted."""
    merged: dict[str, int] = {}
    for entry in round_logs(store):
        for key in entry["merged_keys"]:
            merged[key] = merged.get(key, 0) + 1
    pending = a.status().fragments[0].pending
    held = {  # what is still pending, as stored (waiting for a quorum or its missing part)
        f"{path.parent.name}/0/{path.stem.replace('-', '/')}"
        for path in store.glob("shard-*/pending/0/*/*.bin")
    }
    acked, superseded = ledger.acked, ledger.superseded
    steps_of = {key: steps for key, (_, _, steps) in acked.items()}
    lost = [k for k in acked if k not in merged and k not in superseded and k not in held]
    return {
        "kills": kills,
        "parts_acknowledged": len(acked),
        "steps_acknowledged": sum(steps_of.values()),
        "steps_merged": sum(steps_of.get(k, 0) for k in merged),
        "steps_merged_twice": sum(steps_of.get(k, 0) * (n - 1) for k, n in merged.items()),
        "steps_superseded_by_a_newer_version": sum(steps_of[k] for k in superseded if k not in merged),
        "steps_unaccounted": sum(steps_of[k] for k in lost),
        "learner_contributions_still_pending": pending,
        "steps_still_pending": sum(steps_of[k] for k in held if k in steps_of and k not in merged),
        "refused": ledger.refused,
        "other_refused": ledger.other_refused,
        "unaccounted": {
            k: [line for line in log.read_text().splitlines() if k in line][-3:] for k in lost[:3]
        },
    }
