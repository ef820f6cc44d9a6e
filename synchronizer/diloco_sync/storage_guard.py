"""Storage calls from the event loop: run in a thread, track outages, retry with backoff.

While the object store is unreachable, the service keeps contributions in memory up to a byte
budget (``reserve``/``release``); beyond it, callers answer 503 ``storage_unavailable`` with
``retryable=true``. A background probe notices when storage is back and runs the registered flush.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio.to_thread
from diloco_core.storage import ObjectNotFound, StorageError, StorageUnavailable

from .metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")


def backoff_delays(first: float, cap: float) -> list[float]:
    """Doubling delays from ``first`` up to ``cap`` (the last one repeats)."""
    delays = [first]
    while delays[-1] * 2 < cap:
        delays.append(delays[-1] * 2)
    delays.append(cap)
    return delays


class StorageGuard:
    def __init__(self, budget_bytes: int, retry_max_s: float, metrics: Metrics) -> None:
        self.budget_bytes = budget_bytes
        self.retry_max_s = retry_max_s
        self.metrics = metrics
        self.ok = True
        self.last_error: str | None = None
        self.buffered_bytes = 0
        self._down = asyncio.Event()
        self._stopping = False

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run a blocking storage call in a thread; a failure marks storage down and is re-raised."""
        try:
            result: T = await anyio.to_thread.run_sync(fn, *args)
        except ObjectNotFound:
            raise
        except StorageError as exc:
            self.mark_down(exc)
            raise
        return result

    async def call_until_done(
        self, fn: Callable[..., T], *args: object, what: str = "", outages_only: bool = False
    ) -> T:
        """Retry a storage call with backoff until it succeeds (used for commits that must happen).

        With ``outages_only``, a refusal that waiting cannot cure (a ``StorageError`` that is neither
        ``StorageUnavailable`` nor ``ObjectNotFound``: wrong credentials, no such bucket) is raised at
        once instead of being retried.
        """
        delays = backoff_delays(0.1, self.retry_max_s)
        attempt = 0
        while True:
            try:
                result = await self.call(fn, *args)
                self.mark_up()
                return result
            except StorageError as exc:
                permanent = not isinstance(exc, StorageUnavailable | ObjectNotFound)
                if self._stopping or (outages_only and permanent):
                    raise
                delay = delays[min(attempt, len(delays) - 1)]
                log.warning(
                    "%s failed (%s); retrying in %.1fs",
                    what or getattr(fn, "__name__", "storage call"),
                    exc,
                    delay,
                )
                attempt += 1
                await asyncio.sleep(delay)

    def mark_down(self, exc: BaseException) -> None:
        self.metrics.storage_errors.inc()
        if self.ok:
            log.error("object storage unavailable: %s", exc)
        self.ok, self.last_error = False, str(exc)
        self.metrics.storage_ok.set(0)
        self._down.set()

    def mark_up(self) -> None:
        if not self.ok:
            log.info("object storage is back")
        self.ok, self.last_error = True, None
        self.metrics.storage_ok.set(1)
        self._down.clear()

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the in-memory budget; False when the budget would be exceeded."""
        if self.buffered_bytes + nbytes > self.budget_bytes:
            return False
        self.buffered_bytes += nbytes
        self.metrics.buffered_bytes.set(self.buffered_bytes)
        return True

    def release(self, nbytes: int) -> None:
        self.buffered_bytes = max(0, self.buffered_bytes - nbytes)
        self.metrics.buffered_bytes.set(self.buffered_bytes)

    async def watch(self, probe: Callable[[], None], flush: Callable[[], Awaitable[None]]) -> None:
        """Forever: when storage is down, probe it with backoff; once it answers, flush and mark it up."""
        delays = backoff_delays(0.2, self.retry_max_s)
        while not self._stopping:
            await self._down.wait()
            for attempt in range(10**9):
                if self._stopping:
                    return
                await asyncio.sleep(delays[min(attempt, len(delays) - 1)])
                try:
                    await anyio.to_thread.run_sync(probe)
                    await flush()
                except StorageError as exc:
                    log.info("storage still unavailable: %s", exc)
                    continue
                except Exception:
                    log.exception("flushing buffered state failed")
                    continue
                self.mark_up()
                break

    def stop(self) -> None:
        self._stopping = True
        self._down.set()


__all__ = ["StorageGuard", "StorageUnavailable", "backoff_delays"]
