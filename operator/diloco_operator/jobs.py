"""One job at a time: every pass over a job (reconcile or status refresh) runs in the job's own
worker, one after the other, and requests that arrive meanwhile are merged into the next pass.

Why: the watch of the job, the watches of its children and the resync timer all ask for work on
the same job, often within milliseconds of each other. Run side by side, a long reconcile and a
timer pass apply the same children twice, and a pass that read the world earlier writes its status
after one that read it later: the status goes backwards. Here the passes of one job never overlap
(passes of different jobs do), and a status refresh asked for while a pass runs happens after it,
from what the watches saw by then.

The workers live in kopf's event loop; the passes themselves (blocking API calls) run in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from diloco_core.protocol import StatusResponse

from diloco_operator.build import JobRef
from diloco_operator.job_status import ChaosStatus, JobStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """What the next pass over a job must do; requests merge by "or" (any asks, the pass does it)."""

    reconcile: bool = False  # apply the children (else: only refresh the status from the watches)
    chaos: bool = False  # let built-in chaos act (the resync timer)
    fetch: bool = False  # read the synchronizer's status
    trigger: str = "watch"  # what asked first, for the metrics and the log

    def merge(self, other: Request) -> Request:
        return replace(self, reconcile=self.reconcile or other.reconcile, chaos=self.chaos or other.chaos,
                       fetch=self.fetch or other.fetch,
                       trigger=self.trigger if self.reconcile or not other.reconcile else other.trigger)


@dataclass
class SyncView:
    """What the last reconcile learnt from the synchronizer."""

    status: StatusResponse | None = None
    problem: str | None = None  # why its answer is not used (it serves another job)
    ready: bool | None = None  # readiness decided by its answer (external or wrong job); None: its pods decide


@dataclass
class JobState:
    """The operator's memory of one job, kept between passes (lost on restart, rebuilt from the API)."""

    ref: JobRef
    body: dict[str, Any]  # the job as the watch last delivered it
    status: JobStatus | None = None  # the status as last written (None: not yet, use the stored one)
    written: dict[str, Any] | None = None  # the last status patch written
    sync: SyncView = field(default_factory=SyncView)
    chaos: ChaosStatus | None = None  # built-in chaos bookkeeping of the last reconcile
    templates: dict[str, str] = field(default_factory=dict)  # unit -> its pods' current template hash
    requested_generation: int | None = None  # the newest generation a reconcile was asked for
    reconciled_generation: int | None = None
    validated_generation: int | None = None
    learners_stopped: bool = False  # the learners were scaled down because the job Succeeded

    def current_status(self) -> JobStatus:
        return self.status if self.status is not None else JobStatus.read(self.body.get("status") or {})


Pass = Callable[[JobState, Request], Awaitable[Request | None]]


class JobWorker:
    """Runs the passes of one job one at a time, merging the requests that wait.

    A request for a status refresh only waits ``debounce`` seconds first, so a burst of pod events
    makes one pass. A pass that fails is retried after ``backoff`` seconds; a pass may ask for a
    follow-up (the status it wrote calls for a reconcile).
    """

    def __init__(self, state: JobState, run: Pass, *, debounce: float, backoff: float) -> None:
        self.state = state
        self._run = run
        self._debounce = debounce
        self._backoff = backoff
        self._pending: Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._stopped = False

    def request(self, req: Request) -> None:
        if self._stopped:
            return
        self._pending = req if self._pending is None else self._pending.merge(req)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"job {self.state.ref.name}")

    async def _loop(self) -> None:
        while self._pending is not None and not self._stopped:
            if not self._pending.reconcile:
                await asyncio.sleep(self._debounce)
            req, self._pending = self._pending, None
            if req is None:  # stopped meanwhile
                break
            try:
                follow_up = await self._run(self.state, req)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # (an API outage, say: the pass is retried)
                log.warning("job %s/%s: %s pass failed, retrying in %gs: %s", self.state.ref.namespace,
                            self.state.ref.name, "reconcile" if req.reconcile else "status", self._backoff, exc)
                self._schedule_retry(req)
                continue
            waiting: Request | None = self._pending  # requested while the pass ran
            if follow_up is not None:
                self._pending = follow_up if waiting is None else waiting.merge(follow_up)

    def _schedule_retry(self, req: Request) -> None:
        if self._retry is not None:
            self._retry.cancel()
        self._retry = asyncio.get_running_loop().call_later(self._backoff, self.request, req)

    async def stop(self) -> None:
        self._stopped = True
        if self._retry is not None:
            self._retry.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class JobRegistry:
    """The workers of the jobs the watch delivered, by uid."""

    def __init__(self, run: Pass, *, debounce: float, backoff: float) -> None:
        self._run = run
        self._debounce = debounce
        self._backoff = backoff
        self.workers: dict[str, JobWorker] = {}
        self._by_name: dict[tuple[str, str], str] = {}  # (namespace, name) -> uid

    def seen(self, body: dict[str, Any]) -> JobWorker:
        """The job's worker, created on first sight; its state holds this latest body."""
        meta = body["metadata"]
        uid = str(meta["uid"])
        worker = self.workers.get(uid)
        if worker is None:
            state = JobState(JobRef(meta["name"], meta["namespace"], uid), body)
            worker = self.workers[uid] = JobWorker(state, self._run, debounce=self._debounce, backoff=self._backoff)
            self._by_name[(state.ref.namespace, state.ref.name)] = uid
        else:
            worker.state.body = body
        return worker

    def find(self, namespace: str, name: str) -> JobWorker | None:
        uid = self._by_name.get((namespace, name))
        return self.workers.get(uid) if uid is not None else None

    async def forget(self, uid: str) -> JobWorker | None:
        worker = self.workers.pop(uid, None)
        if worker is not None:
            if self._by_name.get((worker.state.ref.namespace, worker.state.ref.name)) == uid:
                del self._by_name[(worker.state.ref.namespace, worker.state.ref.name)]
            await worker.stop()
        return worker

    async def stop_all(self) -> None:
        for uid in list(self.workers):
            await self.forget(uid)
