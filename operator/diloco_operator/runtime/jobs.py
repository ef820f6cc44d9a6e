"""One job at a time: the reconciles of a job run one after the other, and so do the refreshes of
its status; requests that arrive meanwhile are merged into the next pass.

Why: the watch of the job, the watches of its children and the resync timer all ask for work on
the same job, often within milliseconds of each other. Run side by side, a long reconcile and a
timer pass apply the same children twice, and a pass that read the world earlier writes its status
after one that read it later: the status goes backwards. Here only the refresh writes the status,
one refresh at a time, each from what the watches saw by then; and a reconcile never runs beside
another reconcile of the same job. A refresh may run while a reconcile applies the children of a big
job, so the status follows the pods that are already up. Passes of different jobs run side by side.

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

from diloco_operator.builders.names import JobRef
from diloco_operator.runtime.pods import Restart
from diloco_operator.runtime.rollout import RolloutPlan
from diloco_operator.schema.status import ChaosStatus, JobStatus
from diloco_operator.status.admission import Admission

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """What the next pass over a job must do; requests merge by "or" (any asks, the pass does it)."""

    reconcile: bool = False  # apply the children (else: only refresh the status from the watches)
    chaos: bool = False  # let built-in chaos act (the resync timer)
    fetch: bool = False  # read the synchronizer's status
    trigger: str = "watch"  # what asked first, for the metrics and the log

    def merge(self, other: Request) -> Request:
        return replace(
            self,
            reconcile=self.reconcile or other.reconcile,
            chaos=self.chaos or other.chaos,
            fetch=self.fetch or other.fetch,
            trigger=self.trigger if self.reconcile or not other.reconcile else other.trigger,
        )


@dataclass
class SyncView:
    """What the last reconcile learnt from the synchronizer."""

    status: StatusResponse | None = None
    problem: str | None = None  # why its answer is not used (it serves another job)
    ready: bool | None = (
        None  # readiness decided by its answer (external or wrong job); None: its pods decide
    )
    unreachable: str = ""  # the URL asked (without credentials) when it gave no status


@dataclass
class JobState:
    """The operator's memory of one job, kept between passes (lost on restart, rebuilt from the API)."""

    ref: JobRef
    body: dict[str, Any]  # the job as the watch last delivered it
    status: JobStatus | None = None  # the status as last written (None: not yet, use the stored one)
    sync: SyncView = field(default_factory=SyncView)
    chaos: ChaosStatus | None = None  # built-in chaos bookkeeping of the last reconcile
    templates: dict[str, str] = field(default_factory=dict)  # unit -> its pods' current template hash
    restarts: dict[str, Restart] = field(default_factory=dict)  # unit -> the operator's restart of it
    rollout: RolloutPlan = field(default_factory=RolloutPlan)  # the units to restart for a new template now
    requested_generation: int | None = None  # the newest generation a reconcile was asked for
    reconciled_generation: int | None = None
    validated_generation: int | None = None
    invalid: tuple[int | None, str] | None = (
        None  # (generation, why) when the last reconcile found the spec invalid
    )
    learners_stopped: bool = False  # the learners were scaled down because the job Succeeded
    admissions: dict[str, Admission] = field(default_factory=dict)  # unit -> Kueue's admission of it

    def current_status(self) -> JobStatus:
        return self.status if self.status is not None else JobStatus.read(self.body.get("status") or {})


Reconcile = Callable[[JobState, Request], Awaitable[None]]
Refresh = Callable[[JobState], Awaitable[Request | None]]  # returns a reconcile the new status calls for


class Lane:
    """Runs one kind of pass of a job one at a time, merging the requests that wait.

    A request first waits ``debounce`` seconds (a burst of pod events makes one refresh); a pass that
    fails is retried after ``backoff`` seconds.
    """

    def __init__(
        self, name: str, run: Callable[[Request], Awaitable[None]], *, debounce: float, backoff: float
    ) -> None:
        self.name = name
        self._run = run
        self._debounce = debounce
        self._backoff = backoff
        self._pending: Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._stopped = False

    @property
    def idle(self) -> bool:
        """Nothing running, waiting or due for a retry."""
        return self._pending is None and self._retry is None and (self._task is None or self._task.done())

    def _retry_now(self, req: Request) -> None:
        self._retry = None
        self.request(req)

    def request(self, req: Request) -> None:
        if self._stopped:
            return
        self._pending = req if self._pending is None else self._pending.merge(req)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def _loop(self) -> None:
        while self._pending is not None and not self._stopped:
            if self._debounce:
                await asyncio.sleep(self._debounce)
            req, self._pending = self._pending, None
            if req is None:  # stopped meanwhile
                break
            try:
                await self._run(req)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # (an API outage, say: the pass is retried)
                log.warning("%s failed, retrying in %gs: %s", self.name, self._backoff, exc)
                if self._retry is not None:
                    self._retry.cancel()
                self._retry = asyncio.get_running_loop().call_later(self._backoff, self._retry_now, req)

    async def stop(self) -> None:
        self._stopped = True
        if self._retry is not None:
            self._retry.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class JobWorker:
    """The two lanes of one job: reconciles (each followed by a refresh) and status refreshes."""

    def __init__(
        self, state: JobState, reconcile: Reconcile, refresh: Refresh, *, debounce: float, backoff: float
    ) -> None:
        self.state = state
        where = f"job {state.ref.namespace}/{state.ref.name}"

        async def run_reconcile(req: Request) -> None:
            await reconcile(self.state, req)
            self.refreshes.request(Request(trigger=req.trigger))

        async def run_refresh(_: Request) -> None:
            follow_up = await refresh(self.state)
            if follow_up is not None:
                self.reconciles.request(follow_up)

        self.reconciles = Lane(f"{where}: reconcile", run_reconcile, debounce=0.0, backoff=backoff)
        self.refreshes = Lane(f"{where}: status refresh", run_refresh, debounce=debounce, backoff=backoff)

    def request(self, req: Request) -> None:
        (self.reconciles if req.reconcile else self.refreshes).request(req)

    @property
    def idle(self) -> bool:
        return self.reconciles.idle and self.refreshes.idle

    async def stop(self) -> None:
        await self.reconciles.stop()
        await self.refreshes.stop()


class JobRegistry:
    """The workers of the jobs the watch delivered, by uid."""

    def __init__(self, reconcile: Reconcile, refresh: Refresh, *, debounce: float, backoff: float) -> None:
        self._reconcile = reconcile
        self._refresh = refresh
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
            worker = self.workers[uid] = JobWorker(
                state, self._reconcile, self._refresh, debounce=self._debounce, backoff=self._backoff
            )
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
