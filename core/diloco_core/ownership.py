"""Which job owns a storage prefix: the marker object ``job.json`` at the prefix's root.

Two jobs writing under one prefix overwrite each other's state, so a prefix belongs to one job.
Every synchronizer shard claims it before it serves: it writes the marker when there is none and
reads it back (of two claiming at once, the last writer wins and the other refuses), and it refuses
to start when the marker names another owner. While it runs, it reads the marker again before it
writes its state, and stops once another job holds the prefix. A marker that cannot be read is
never overwritten: a person decides whose prefix it is.

The owner is the job's identity: ``<namespace>/<name>`` under the operator, else the job id. A job
deleted and created again with the same name in the same namespace is the same owner, and resumes
the state it left. The decisions here are pure; the synchronizer does the reads and writes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

MARKER_KEY = "job.json"
MARKER_FORMAT = 1
# every refusal starts with these words, wherever it is told (log, exit message, the job's status)
CONFLICT = "storage prefix owned by another job"

Claim = Literal["claim", "owned", "refuse"]


class MarkerUnreadable(ValueError):
    """The marker exists but is not one this version can read: it is left alone."""


class JobMarker(BaseModel):
    """The content of ``job.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int = MARKER_FORMAT
    owner: str
    job_id: str
    claimed_at: float  # unix seconds


def new_marker(owner: str, job_id: str, now: float) -> JobMarker:
    return JobMarker(owner=owner, job_id=job_id, claimed_at=now)


def encode_marker(marker: JobMarker) -> bytes:
    return marker.model_dump_json().encode()


def parse_marker(raw: bytes, where: str) -> JobMarker:
    """The marker stored at ``where``; ``MarkerUnreadable`` saying what to do when it is not one."""
    try:
        marker = JobMarker.model_validate_json(raw)
    except ValidationError as exc:
        problem = f"not a job marker ({exc.error_count()} problem(s): {exc.errors()[0]['msg']})"
    else:
        if marker.format <= MARKER_FORMAT:
            return marker
        problem = f"format {marker.format}, newer than this version reads ({MARKER_FORMAT})"
    raise MarkerUnreadable(
        f"the ownership marker {where} cannot be read: {problem}; it is left as it is: delete it "
        "if no other job uses this storage prefix, or give this job its own prefix"
    )


def claim_decision(existing: JobMarker | None, owner: str) -> Claim:
    """What ``owner`` does about the prefix: claim it (no marker), use it (its own), or refuse."""
    if existing is None:
        return "claim"
    return "owned" if existing.owner == owner else "refuse"


def conflict_message(existing: JobMarker, owner: str, where: str) -> str:
    """The refusal: who holds the prefix, since when, and how to recover."""
    claimed = datetime.fromtimestamp(existing.claimed_at, UTC).isoformat(timespec="seconds")
    return (
        f"{CONFLICT}: {where} names {existing.owner!r} (job {existing.job_id!r}, claimed {claimed}), "
        f"not this job {owner!r}: give this job its own storage prefix, or delete {where} "
        f"if {existing.owner!r} no longer uses this prefix"
    )


def find_conflict(text: str) -> str | None:
    """The refusal told in ``text`` (a log tail, a termination message): from ``CONFLICT`` to the end
    of the last line that tells it; None when no line does."""
    for line in reversed(text.splitlines()):
        at = line.find(CONFLICT)
        if at >= 0:
            return line[at:].strip()
    return None
