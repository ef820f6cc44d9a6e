"""Start-up in the background: the server answers at once while the committed state loads.

Loading waits out a storage outage (retrying), so it must not hold the server back: a synchronizer
started before its storage is reachable still answers ``/healthz`` (a liveness probe does not kill
it) and stops at once on SIGTERM (the load is cancelled). Until the state is loaded, ``/readyz``
answers 503 with why, and every ``/v1`` route 503 ``starting`` (``retryable``, with ``Retry-After``).
Once loaded, the pending contributions are replayed and the round loop and the storage watcher
start. A failure that waiting cannot cure (wrong credentials, storage of another job) is handed
to ``on_fatal`` (``cannot start: <why>``), which stops the server with the reason; so is another
job taking the storage prefix while this one runs (``stopped: <why>``, ``StateStore.on_lost``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from diloco_core.tracking import Tracking

from .commit import Committer
from .contributions import ContributionDesk
from .errors import ApiError
from .round_loop import RoundRunner
from .round_memory import RoundMemory
from .service import SyncService

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5


def storage_reason(storage_ok: bool, storage_error: str | None) -> str | None:
    """Why storage keeps the synchronizer from being ready, or None when it is fine; without
    ``storage_error`` (the caller may not know where the storage is) it only says it is down."""
    if storage_ok:
        return None
    return f"storage unavailable ({storage_error})" if storage_error else "storage unavailable"


def not_ready_reason(
    loaded: bool, failure: str | None, storage_ok: bool, storage_error: str | None
) -> str | None:
    """Why ``/readyz`` answers 503 (None: ready)."""
    storage = storage_reason(storage_ok, storage_error)
    if failure is not None:
        return f"start-up failed: {failure}"
    if not loaded:
        return f"loading state: {storage}" if storage else "loading state"
    return storage


def starting_error(reason: str | None) -> ApiError:
    """The answer of a ``/v1`` route before the state is loaded (``reason``: why it is not ready):
    503 ``starting``, retry later."""
    reason = reason or "loading state"
    return ApiError(
        503,
        "starting",
        f"the synchronizer is starting ({reason}): retry later",
        retryable=True,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def build_round_parts(
    service: SyncService, tracking: Tracking | None = None
) -> tuple[ContributionDesk, RoundRunner]:
    """The contribution desk and the round runner of ``service``, each given only the parts it uses;
    committed rounds go to ``tracking`` too."""
    settings = service.settings
    desk = ContributionDesk(
        settings,
        service.fragments,
        service.registry,
        service.store,
        service.guard,
        service.metrics,
        service.traffic,
        service.clock,
    )
    committer = Committer(
        service.store,
        service.guard,
        service.metrics,
        service.recent_rounds,
        max_staleness=service.diloco.max_staleness,
        keep_versions=settings.keep_versions,
        clock=service.clock,
        tracking=tracking,
        served_in_memory_bytes=settings.served_in_memory_bytes,
    )
    runner = RoundRunner(
        service.diloco,
        service.fragments,
        service.policy,
        committer,
        desk,
        clock=service.clock,
        tick_s=settings.tick_s,
        on_tick=service.refresh_gauges,
        on_excluded=lambda _p, n: service.metrics.contributions.labels("excluded").inc(n),
        on_clipped=lambda _p, n: service.metrics.contributions.labels("clipped").inc(n),
        round_memory=RoundMemory(settings.round_memory_bytes),
    )
    desk.wake = runner.wake
    return desk, runner


class Startup:
    """Loads the state in a background task, then starts the round loop and the storage watcher."""

    def __init__(
        self,
        service: SyncService,
        desk: ContributionDesk,
        runner: RoundRunner,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.service, self.desk, self.runner = service, desk, runner
        self.on_fatal = on_fatal
        self.loaded = False
        self.failure: str | None = None
        self.stopped: str | None = None  # why it stopped after loading (its storage prefix was taken)
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def begin(self) -> None:
        loop = asyncio.get_running_loop()

        def lost(reason: str) -> None:  # called from the storage thread that noticed
            loop.call_soon_threadsafe(self._lost, reason)

        self.service.store.on_lost = lost
        self._tasks.append(asyncio.create_task(self._load_then_run(), name="load-state"))

    async def _load_then_run(self) -> None:
        svc = self.service
        try:
            pending = await svc.load()
            if not self._stopping:
                self.desk.replay(pending)
        except Exception as exc:
            if self._stopping:
                return
            self.failure = str(exc)
            log.error("cannot start: %s", exc)
            if self.on_fatal is not None:
                self.on_fatal(f"cannot start: {self.failure}")
            return
        if self._stopping:
            return
        self._tasks += [
            asyncio.create_task(self.runner.run(), name="rounds"),
            asyncio.create_task(svc.guard.watch(svc.store.probe, self._after_outage), name="storage-watch"),
        ]
        self.loaded = True
        log.info("synchronizer ready: storage %s", svc.store.store.describe())

    def _lost(self, reason: str) -> None:
        """Another job took the storage prefix: nothing more is written; stop with the reason."""
        if self._stopping or self.stopped is not None:
            return
        self.stopped = reason
        self.runner.stop()
        if self.on_fatal is not None:
            self.on_fatal(f"stopped: {reason}")

    async def _after_outage(self) -> None:
        """Storage is back: write what only memory holds (raises while storage still fails)."""
        await self.desk.flush()
        await self.service.flush_registry()

    def check_ready(self, *, detailed: bool = True) -> None:
        """Raise 503 ``starting`` until the state is loaded; without ``detailed`` (a caller not
        authenticated), its reason names nothing of the storage (``not_ready_reason``)."""
        if not self.loaded:
            raise starting_error(self.not_ready_reason(detailed=detailed))

    def not_ready_reason(self, *, detailed: bool = True) -> str | None:
        """Why the synchronizer is not ready; without ``detailed``, nothing that names the storage
        (endpoint, bucket, object keys), which a start-up failure or storage error may."""
        guard = self.service.guard
        if self.stopped is not None:
            return f"stopped: {self.stopped}" if detailed else "stopped: the synchronizer's log says why"
        if detailed:
            return not_ready_reason(self.loaded, self.failure, guard.ok, guard.last_error)
        failure = "the synchronizer's log says why" if self.failure is not None else None
        return not_ready_reason(self.loaded, failure, guard.ok, None)

    async def stop(self) -> None:
        """Stop loading (if still loading), the round loop and the storage watcher."""
        self._stopping = True
        self.runner.stop()
        self.service.guard.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
