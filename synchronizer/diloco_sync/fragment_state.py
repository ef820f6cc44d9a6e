"""In-memory state of one fragment: its global version, what waits to be merged, who waits for news.

Mutated only on the event loop; merges run in a worker thread on values handed over to them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt
from diloco_core import rounds as policy
from diloco_core.fragments import Fragment
from diloco_core.outer import OuterOptimizer

Arrays = dict[str, npt.NDArray[np.float32]]
News = Literal["version", "round"] | None


@dataclass
class Contribution:
    """An accepted outer gradient waiting for its fragment's next round."""

    learner_id: str
    fragment: int
    base_version: int
    seq: int
    steps: int
    tokens: int
    tensors: Arrays
    nbytes: int
    received_at: float
    storage_key: str | None = None  # None while only in memory (storage was down)
    blob: bytes | None = None  # kept only while not yet written to storage

    @property
    def key(self) -> str:
        return f"{self.learner_id}/{self.fragment}/{self.base_version}/{self.seq}"


@dataclass
class FragmentState:
    spec: Fragment
    optimizer: OuterOptimizer
    version: int = -1
    params: Arrays | None = None
    payload: bytes | None = None  # the current version, encoded once for every reader
    pending: dict[str, Contribution] = field(default_factory=dict)  # by learner
    applied: deque[str] = field(default_factory=lambda: deque(maxlen=4096))
    reserved: set[str] = field(default_factory=set)  # keys being validated/persisted right now
    rounds: int = 0
    merging: bool = False
    in_merge: set[str] = field(default_factory=set)  # keys of the round being merged and committed
    round: policy.RoundState = field(default_factory=lambda: policy.open_round(0, -1, 0.0))
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def index(self) -> int:
        return self.spec.index

    def is_known(self, key: str) -> bool:
        """True when a contribution with this idempotency key was taken already."""
        return (
            key in self.reserved
            or key in self.in_merge
            or key in self.applied
            or any(c.key == key for c in self.pending.values())
        )

    def round_entry(self, c: Contribution) -> policy.Contribution:
        return policy.Contribution(c.learner_id, c.base_version, c.steps, c.tokens, c.received_at)

    def add_pending(self, c: Contribution, quorum: int) -> Contribution | None:
        """Queue a contribution for the next round; returns the one it supersedes (same learner)."""
        previous = self.pending.get(c.learner_id)
        opens = not self.pending
        if opens:  # a round opens when its first contribution arrives (the fragment fell due)
            self.round = policy.open_round(self.index, self.version, c.received_at)
        self.pending[c.learner_id] = c
        self.round = policy.add_contribution(self.round, self.round_entry(c), quorum=quorum)
        if opens:
            self._notify()  # learners waiting with announce_rounds hear of it at once
        return previous

    def round_open_for(self, learner_id: str, version: int) -> bool:
        """True when a round on ``version`` is collecting contributions and ``learner_id`` has none in it."""
        return (
            not self.merging
            and bool(self.pending)
            and self.version == version
            and self.round.version == version
            and learner_id not in self.pending
        )

    def open_round(self, now: float, quorum: int) -> None:
        """Start the round of the current version with whatever is still pending."""
        start = min((c.received_at for c in self.pending.values()), default=now)
        self.round = policy.open_round(self.index, self.version, start)
        for c in sorted(self.pending.values(), key=lambda c: c.received_at):
            self.round = policy.add_contribution(self.round, self.round_entry(c), quorum=quorum)

    def publish(self, version: int, params: Arrays, payload: bytes) -> None:
        """Make a new version current and wake every long-poll waiting for it."""
        self.version, self.params, self.payload = version, params, payload
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_newer(self, newer_than: int, timeout: float, round_for: str | None = None) -> News:
        """Wait until the version exceeds ``newer_than`` ("version"), or, when ``round_for`` names a
        learner, until a round on ``newer_than`` is open that it has not joined ("round"); None on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            news = self._news(newer_than, round_for)
            remaining = deadline - loop.time()
            if news is not None or remaining <= 0:
                return news
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def _news(self, newer_than: int, round_for: str | None) -> News:
        if self.version > newer_than:
            return "version"
        if round_for is not None and self.round_open_for(round_for, newer_than):
            return "round"
        return None
