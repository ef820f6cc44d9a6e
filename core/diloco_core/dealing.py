"""The job's training data dealt to its learner units in ranges, so that units can come and go without
re-dealing what was consumed (pure).

The job reads one stream of training windows: position ``g`` is window ``perm(epoch)[g % W]`` with
``epoch = g // W``, ``W`` the corpus's training windows and ``perm`` a permutation seeded per epoch
(``diloco_worker.tokens``). Each unit reads a sequence of its own, positions 0, 1, 2, ...: the ranges
the job's stream was dealt to it, one after the other. When a unit reaches a position past its ranges it
is dealt the next ``size`` positions of the stream that nobody holds. The record of what was dealt is
the synchronizer's, durable before it answers, so a position of a unit's sequence maps to the same
stream position forever: a unit that restarts from a checkpoint trains on what it would have, and a
unit added later starts where the job's stream has reached. Nothing dealt is dealt again; what a unit
removed for good held and had not trained on is left, not re-dealt (a unit's position inside its
sequence lives in its own checkpoint, which nobody else reads). A unit whose range size changes (its
batch, context or number of processes did) keeps the ranges it holds; its new ranges take the new size.

A unit may ask for a position up to ``AHEAD`` ranges past the ones it holds, no further: a learner
cannot take the job's data away from the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from .bounds import MAX_STEPS

AHEAD = 4  # ranges a unit may be dealt past the ones it holds, in one request
MAX_RANGE = 1 << 30  # positions in one range
MAX_POSITION = MAX_STEPS * 1024  # the stream is long enough for any job


class DealError(ValueError):
    """A request the dealer refuses: a position too far past the unit's ranges, an absurd size."""


class DealtRange(BaseModel):
    """``size`` positions of the job's stream from ``start``; the first of them is position ``offset``
    of the unit's own sequence."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offset: int = Field(ge=0, le=MAX_POSITION)
    start: int = Field(ge=0, le=MAX_POSITION)
    size: int = Field(ge=1, le=MAX_RANGE)

    def holds(self, position: int) -> bool:
        return self.offset <= position < self.offset + self.size

    def stream(self, position: int) -> int:
        """Where position ``position`` of the unit's sequence (within this range) is in the stream."""
        return self.start + position - self.offset


class DealRecord(BaseModel):
    """What was dealt: each unit's ranges in the order of its sequence, and where the stream's next
    range starts."""

    model_config = ConfigDict(extra="forbid")

    next: int = Field(0, ge=0, le=MAX_POSITION)
    units: dict[str, list[DealtRange]] = Field(default_factory=dict)


def held_through(ranges: Sequence[DealtRange]) -> int:
    """The end of a unit's sequence as far as its ranges go."""
    return ranges[-1].offset + ranges[-1].size if ranges else 0


def covering(ranges: Sequence[DealtRange], position: int) -> DealtRange | None:
    """The range (of a unit's, in sequence order) that holds ``position``, or None."""
    lo, hi = 0, len(ranges)
    while lo < hi:
        mid = (lo + hi) // 2
        if ranges[mid].offset + ranges[mid].size <= position:
            lo = mid + 1
        else:
            hi = mid
    return ranges[lo] if lo < len(ranges) and ranges[lo].holds(position) else None


def deal(record: DealRecord, unit: str, position: int, size: int) -> tuple[DealRecord, DealtRange]:
    """The range of ``unit`` that holds ``position`` of its sequence, dealing it ranges of ``size``
    positions as far as that when it holds none there; the record with them (the same record when
    nothing was dealt). Raises ``DealError``."""
    if not 1 <= size <= MAX_RANGE:
        raise DealError(f"a range holds 1..{MAX_RANGE} positions, not {size}")
    held = record.units.get(unit, [])
    through = held_through(held)
    if position < 0 or position >= through + AHEAD * size:
        raise DealError(
            f"unit {unit!r} holds positions 0..{through - 1} of its data: it may ask for positions "
            f"0..{through + AHEAD * size - 1} (ranges of {size}), not {position}"
        )
    if position < through:
        found = covering(held, position)
        assert found is not None  # the ranges are contiguous from 0
        return record, found
    added: list[DealtRange] = []
    start = record.next
    while held_through(added) <= position:
        added.append(
            DealtRange(offset=through + len(added) * size, start=start + len(added) * size, size=size)
        )
    if added[-1].start + size > MAX_POSITION:
        raise DealError("the job's data stream is exhausted")
    units = {**record.units, unit: [*held, *added]}
    return DealRecord(next=added[-1].start + size, units=units), added[-1]
