"""The memory the contributions waiting for their rounds hold, bounded together
(``--pending-memory-bytes``).

A contribution is held from its arrival until its round ends, decoded but still quantized
(``codec.QuantizedArrays``); a learner's parts on one base are held as they came, then added up
(``contribution.Sum``, ``COMPACT_AT``). Learners that send faster than the rounds merge would pile
parts up, each learner up to about two to three times the fragment's float32 size, so what the
synchronizer holds would grow with the number of learners. The budget bounds it:

- a learner's first contribution to a fragment's next round is always taken, so the budget never
  keeps a round from its quorum, and so are a part its pending one waits for (a restart lost an
  earlier part only buffered in memory) and a repeat of a contribution taken already;
- a further one from the same learner (a part that continues or supersedes its pending one) is taken
  while what the fragments' pending and merging contributions hold, with the bodies being received
  (counted at their ``Content-Length``), leaves room for its body;
- beyond it the answer is 503 ``pending_full`` (``retryable``, ``Retry-After``) before its body is
  read: nothing is lost, the learner retries it and holds the fragment back meanwhile, its progress
  going into one later part (``diloco_worker.session``: queued once the waiting part is sent, before
  a new version of the fragment replaces that progress, or when the learner leaves).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator

from .contribution import Contribution, held_bytes
from .errors import ApiError

RETRY_AFTER_S = 1  # a round's merge frees the room: seconds at the sizes this bound matters for


def holds(contributions: Iterable[Contribution]) -> int:
    """The bytes these contributions' outer gradients hold (a folded one's parts as they came)."""
    return sum(held_bytes(c.tensors) for c in contributions)


def may_take(held: int, size: int, budget: int, *, first: bool) -> bool:
    """Whether a body of ``size`` bytes may be received while contributions and bodies hold ``held``:
    always the learner's first for the fragment's round, else within the ``budget``."""
    return first or held + size <= budget


def pending_full(p: int, held: int, size: int, budget: int) -> ApiError:
    """503 ``pending_full``: the learner's further part must wait for a round to free memory."""
    return ApiError(
        503,
        "pending_full",
        f"the contributions waiting for their rounds hold {held:,} bytes and this one's {size:,} would "
        f"pass --pending-memory-bytes ({budget:,}): your earlier contribution to fragment {p} is still "
        "waiting for its round; send this progress again once it is merged",
        retryable=True,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class Arriving:
    """The bodies being received that the budget counts: their bytes, and by learner and fragment."""

    def __init__(self) -> None:
        self.bytes = 0
        self._count: Counter[tuple[str, int]] = Counter()

    def has(self, learner_id: str, p: int) -> bool:
        """True while a body of ``learner_id`` for fragment ``p`` is being received."""
        return self._count[(learner_id, p)] > 0

    @contextlib.contextmanager
    def hold(self, learner_id: str, p: int, size: int) -> Iterator[None]:
        """Count a body of ``size`` bytes while it is received and taken."""
        self.bytes += size
        self._count[(learner_id, p)] += 1
        try:
            yield
        finally:
            self.bytes -= size
            self._count[(learner_id, p)] -= 1
            if not self._count[(learner_id, p)]:
                del self._count[(learner_id, p)]
