"""A learner unit's ranges of the job's training stream (``diloco_core.dealing``): the unit's leader
asks the synchronizer for them, and its other ranks take the answers from it.

Every rank of a unit asks for the positions of the whole unit batch it is in (``cover``), not only its
own, and every rank holds the same ranges: so all ranks find a unit batch uncovered at the same batch
and take the new range in the same collective of the unit, on the training thread, between two batches.
A synchronizer that cannot answer yet (down, restarting, its storage out) is asked again with backoff
until it answers or the learner stops; a refusal stops the learner with the synchronizer's reason.
"""

from __future__ import annotations

import logging
import random
import threading

from diloco_core.dealing import DealtRange, covering

from .data import CorpusError, DataStopped
from .distributed import Unit
from .pacing import backoff_delay
from .sync_client import SyncClient, SyncRejected, SyncUnavailable

log = logging.getLogger(__name__)

RANGE_BATCHES = 32  # unit batches in one range, at most
MIN_RANGES_PER_EPOCH = 8  # a small corpus is dealt in smaller ranges, so that units share an epoch


def range_size(train_windows: int, unit_batch: int) -> int:
    """Positions in each new range of a unit whose batches (all its ranks together) hold ``unit_batch``
    windows: ``k`` unit batches, ``k`` up to ``RANGE_BATCHES``, fewer for a corpus that would otherwise
    hold fewer than ``MIN_RANGES_PER_EPOCH`` ranges."""
    return unit_batch * max(1, min(RANGE_BATCHES, train_windows // (MIN_RANGES_PER_EPOCH * unit_batch)))


class UnitRanges:
    """The ranges the unit holds, as far as it has read; ``stream(p)`` maps a position of its sequence
    to the job's stream once ``cover`` brought in the range that holds it."""

    def __init__(self, client: SyncClient | None, unit: Unit, stop: threading.Event) -> None:
        if unit.is_leader and client is None:
            raise ValueError("the unit's leader asks the synchronizer: it needs a client")
        self.client, self.unit, self.stop = client, unit, stop
        self.ranges: list[DealtRange] = []  # in sequence order, without gaps from the first one held
        self._rng = random.Random()

    def cover(self, lo: int, hi: int, size: int) -> None:
        """Bring in the ranges that hold positions ``lo..hi-1`` (new ones of ``size`` positions). Every
        rank of the unit calls it with the same arguments."""
        while (missing := self._first_missing(lo, hi)) is not None:
            got = self._ask(missing, size) if self.unit.is_leader else None
            if self.unit.distributed:
                mine = [got.offset, got.start, got.size] if got is not None else []
                offset, start, n = self.unit.gather_ints(mine, 3)[0]
                got = DealtRange(offset=offset, start=start, size=n)
            if got is None or not got.holds(missing):
                raise CorpusError(
                    f"the synchronizer answered {got} for position {missing} of this unit's data"
                )
            self._keep(got)

    def stream(self, position: int) -> int:
        found = covering(self.ranges, position)
        if found is None:
            raise KeyError(f"position {position} of the unit's data is not covered yet")
        return found.stream(position)

    def _first_missing(self, lo: int, hi: int) -> int | None:
        p = lo
        while p < hi:
            found = covering(self.ranges, p)
            if found is None:
                return p
            p = found.offset + found.size
        return None

    def _keep(self, got: DealtRange) -> None:
        # a learner reads forwards: ranges well behind the one it needs are let go
        self.ranges = sorted(
            [
                r
                for r in self.ranges
                if r.offset + r.size > got.offset - 2 * got.size and r.offset != got.offset
            ]
            + [got],
            key=lambda r: r.offset,
        )

    def _ask(self, position: int, size: int) -> DealtRange:
        assert self.client is not None
        attempt = 0
        while True:
            try:
                got = self.client.data_range(position, size)
                return DealtRange(offset=got.offset, start=got.start, size=got.size)
            except SyncRejected as exc:
                if 400 <= exc.status < 500 and exc.status not in (401, 429):
                    raise CorpusError(
                        f"the synchronizer refuses position {position} of this unit's data: {exc.reason}"
                    ) from exc
                problem = f"{exc.status} {exc.code}"
            except SyncUnavailable as exc:
                problem = str(exc)
            delay = backoff_delay(attempt, self._rng)
            if attempt in (0, 5) or attempt % 20 == 0:
                log.warning(
                    "waiting for position %d of this unit's data (%s); asking again in %.1fs",
                    position,
                    problem,
                    delay,
                )
            attempt += 1
            if self.stop.wait(delay):
                raise DataStopped(f"stopped while waiting for position {position} of this unit's data")
