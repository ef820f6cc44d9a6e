"""What one fragment serves its readers: the current version, encoded once for every reader (in
memory, or read from its object in storage when it is larger than ``--served-in-memory-bytes``), the
recent updates that take a reader a few versions behind to it (compressed downloads,
``diloco_core.downlink``), and the wake-up of the long-polls waiting for news."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from diloco_core import codec
from diloco_core.fragments import Fragment

DEFAULT_SERVED_IN_MEMORY = 64 * 1024 * 1024  # bytes: a larger version is served from storage
KEPT_UPDATES = 16  # compressed downloads: the updates kept, so a reader that many versions behind walks them
News = Literal["version", "round"] | None


@dataclass(frozen=True)
class Stored:
    """A version served from its committed object in storage, ``size`` bytes long."""

    key: str
    size: int


Served = bytes | Stored
"""A version as served: its payload in memory, or where it is stored."""


def served_from_storage(fragment: Fragment, in_memory_bytes: int) -> bool:
    """Whether a fragment's versions are served from storage: when one can be larger than
    ``in_memory_bytes`` (``codec.max_payload_size``, about its fp32 size). A round then leaves the
    new version to its commit to encode as it writes it."""
    return codec.max_payload_size(fragment) > in_memory_bytes


def served_form(payload: bytes | memoryview, key: str, in_memory_bytes: int) -> Served:
    """The payload itself (as bytes) when it is at most ``in_memory_bytes`` long, else its object ``key``."""
    size = memoryview(payload).nbytes
    return bytes(payload) if size <= in_memory_bytes else Stored(key, size)


def served_size(served: Served) -> int:
    return served.size if isinstance(served, Stored) else len(served)


class Publication:
    """The fragment's current version as served, and the event its long-polls wait on."""

    def __init__(self) -> None:
        self.version = -1  # -1: no parameters yet
        self.payload: Served | None = None  # the current version, encoded once for every reader
        self.initial_digest: str | None = None  # of version 0's values, while it is current
        # with compressed downloads: the recent versions' updates (version -> update from the one before)
        self._updates: dict[int, bytes] = {}
        self._changed = asyncio.Event()

    def publish(
        self,
        version: int,
        payload: Served,
        update: bytes | None = None,
        initial_digest: str | None = None,
    ) -> None:
        """Make a new version current and wake every long-poll waiting for it (``initial_digest``: of
        version 0, which only the initial parameters are)."""
        self.version, self.payload = version, payload
        self.initial_digest = initial_digest
        if update is None:
            self._updates = {}  # a chain with a gap is no chain
        else:
            self._updates = {v: u for v, u in self._updates.items() if v > version - KEPT_UPDATES}
            self._updates[version] = update
        self.notify()

    def payload_for(self, have: int, newer_than: int) -> tuple[int, Served] | None:
        """What to send a reader holding version ``have`` exactly that asks for a version newer than
        ``newer_than``, as (version, payload); None while there is no version. With compressed
        downloads: the update from ``have`` when the current version is the next one; when it is
        several versions behind, the first link of the chain of updates from it (the version after
        ``have``: the reader asks again for the next) while the whole chain is held and smaller than
        the whole version; else the whole current version."""
        if self.version < 0 or self.payload is None:
            return None
        current: tuple[int, Served] = (self.version, self.payload)
        if have < 0 or have < newer_than or have >= self.version:
            return current
        chain: list[bytes] = []
        for v in range(have + 1, self.version + 1):
            link = self._updates.get(v)
            if link is None:
                return current
            chain.append(link)
        if len(chain) > 1 and sum(map(len, chain)) >= served_size(self.payload):
            return current
        return have + 1, chain[0]

    def notify(self) -> None:
        """Wake every long-poll waiting now (each looks again at what it waits for)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, news: Callable[[], News], timeout: float) -> News:
        """Wait until ``news()`` has something to say, looking again at each change; None on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            found = news()
            remaining = deadline - loop.time()
            if found is not None or remaining <= 0:
                return found
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
