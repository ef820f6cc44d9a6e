"""A learner's final counts from its metrics file (JSONL, one record per logged step).

Every process of a learner appends to the same file and tags its records with its ``pid``; a
restarted learner continues from its checkpoint, so the final step and tokens are those of the last
record, while bytes sent and a ddp rank's all-reduce bytes add up over the processes (each counts
from zero).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LearnerCounts:
    step: int
    tokens: int
    first_step: int  # the step of the first record counted (a resumed process's first step)
    first_tokens: int
    bytes_sent: int
    processes: int
    allreduce_bytes: int = 0  # a ddp rank's ring all-reduce bytes each way, summed over its processes
    tokens_per_s: float | None = None  # median over the records (each: since the previous one on a GPU)
    mfu: float | None = None  # median, where the learner knew its device's peak


def parse_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON objects of ``lines``; a line cut short by a killed process is skipped."""
    out: list[dict[str, Any]] = []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            out.append(record)
    return out


def counts_from_records(records: Iterable[Mapping[str, Any]]) -> LearnerCounts | None:
    """Final step and tokens (the last record), bytes sent summed over the processes, and the
    median tokens/s and MFU of the records."""
    last: Mapping[str, Any] | None = None
    first: Mapping[str, Any] | None = None
    bytes_by_process: dict[Any, int] = {}
    reduced_by_process: dict[Any, int] = {}
    rates: list[float] = []
    mfus: list[float] = []
    for record in records:
        first = first or record
        last = record
        key = record.get("pid")
        bytes_by_process[key] = max(bytes_by_process.get(key, 0), int(record.get("bytes_sent", 0) or 0))
        reduced_by_process[key] = max(
            reduced_by_process.get(key, 0), int(record.get("allreduce_bytes", 0) or 0)
        )
        if isinstance(record.get("tokens_per_s"), int | float):
            rates.append(float(record["tokens_per_s"]))
        if isinstance(record.get("mfu"), int | float):
            mfus.append(float(record["mfu"]))
    if last is None or first is None:
        return None
    return LearnerCounts(
        step=int(last["step"]),
        tokens=int(last.get("tokens", 0) or 0),
        first_step=int(first["step"]),
        first_tokens=int(first.get("tokens", 0) or 0),
        bytes_sent=sum(bytes_by_process.values()),
        processes=len(bytes_by_process),
        allreduce_bytes=sum(reduced_by_process.values()),
        tokens_per_s=statistics.median(rates) if rates else None,
        mfu=statistics.median(mfus) if mfus else None,
    )


def read_counts(path: Path, pids: Collection[int] | None = None) -> LearnerCounts | None:
    """The counts of a metrics file (only the records of the processes ``pids`` when given); None
    when it is missing or has no such record yet."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    records = parse_records(text.splitlines())
    if pids is not None:
        records = [r for r in records if r.get("pid") in pids]
    return counts_from_records(records)


@dataclass(frozen=True)
class ProcessFacts:
    """What one learner process reported of itself: when its first step ended (wall clock) and the
    blocked time it added (its newest cumulative ``blocked_s`` minus the one it resumed with)."""

    first_step_at: float
    blocked_s: float


def read_processes(path: Path) -> dict[int, ProcessFacts]:
    """Per process (pid) of a metrics file that reported its start-up (diloco_worker.startup)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    first: dict[int, Mapping[str, Any]] = {}
    last: dict[int, Mapping[str, Any]] = {}
    for record in parse_records(text.splitlines()):
        pid = record.get("pid")
        if not isinstance(pid, int):
            continue
        if "first_step_at" in record:
            first.setdefault(pid, record)
        last[pid] = record
    return {
        pid: ProcessFacts(
            float(r["first_step_at"]),
            max(0.0, float(last[pid].get("blocked_s", 0.0)) - float(r.get("resumed_blocked_s", 0.0))),
        )
        for pid, r in first.items()
    }
