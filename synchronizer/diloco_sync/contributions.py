"""Taking contributions: checks in the order a learner can act on, durability before the answer.

Durability rule: a contribution is answered 202 with ``durable: true`` only after it is written
under ``pending/`` in the object store, so a crash after the answer never loses it (it is replayed
at start-up). While storage is down, contributions are held in memory up to the byte budget and
answered 202 with ``durable: false``: those are written as soon as storage is back, and are lost
if the process dies during the outage, so the learner resends them (same key) until an answer —
``accepted`` by a restarted synchronizer that lost it, or ``duplicate`` — says ``durable``.
Beyond the budget the answer is 503 ``storage_unavailable`` (``retryable``): nothing is dropped
silently. A learner's newer contribution to the same fragment continues or supersedes its pending
one, and is taken only where the learner's progress is held through (409 ``out_of_order`` names the
step to start from); progress merged already is refused (409 ``already_merged``), and a continuation
is held to the bounds of one contribution: every step of a learner's progress is merged at most
once, in order (``FragmentState.conflict``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import anyio.to_thread
from diloco_core import rounds
from diloco_core.layout import PENDING_HEAD_SIZE, PendingMeta, contribution_key
from diloco_core.protocol import ContributionResult
from diloco_core.screening import tensors_norm
from diloco_core.storage import StorageError, StorageUnavailable
from diloco_core.uploads import Upload, reading

from .contribution import Contribution, Gradient, compacted, needs_compacting
from .errors import ApiError, body_not_written, learner_left, not_registered
from .fragment_state import FragmentState
from .fragments import Fragments
from .ingest import Checked, payload_limit, validate_outer_gradient
from .learners import LearnerRegistry
from .metrics import Metrics, Traffic
from .pace import pace_for, pace_problem
from .pending_memory import Arriving, holds, may_take, pending_full
from .persistence import StateStore
from .settings import SyncSettings
from .storage_guard import StorageGuard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Taken:
    checked: Checked
    storage_key: str | None  # None: not written (storage down)
    failure: StorageError | None
    blob: bytes | None  # the payload, to hold in memory when it was not written


class ContributionDesk:
    def __init__(
        self,
        settings: SyncSettings,
        fragments: Fragments,
        registry: LearnerRegistry,
        store: StateStore,
        guard: StorageGuard,
        metrics: Metrics,
        traffic: Traffic,
        clock: Callable[[], float],
    ) -> None:
        self.settings, self.diloco = settings, settings.job.diloco
        self.fragments, self.registry = fragments, registry
        self.store, self.guard = store, guard
        self.metrics, self.traffic = metrics, traffic
        self.clock = clock
        self.wake: Callable[[], None] = lambda: None  # the round runner's, once it exists
        self._deletes: set[asyncio.Task[None]] = set()
        self._compacting: set[int] = set()  # the pending contributions being added up (by id)
        self.arriving = Arriving()  # the bodies being received, counted against --pending-memory-bytes
        metrics.pending_bytes.set_function(self.held_bytes)

    def held_bytes(self) -> int:
        """What the contributions waiting for or in their rounds hold, with the bodies being received."""
        return holds(c for fs in self.fragments for c in fs.held()) + self.arriving.bytes

    def room(
        self, learner_id: str, p: int, base_version: int, seq: int, size: int
    ) -> contextlib.AbstractContextManager[None]:
        """Count a contribution's body of ``size`` bytes against ``--pending-memory-bytes`` while it
        is received and taken (``pending_memory``): 503 ``pending_full`` for a learner's further part
        to the fragment's round beyond the budget. A repeat of a contribution taken already (answered
        ``duplicate``, it holds nothing) and a part the learner's pending one waits for (its progress
        has a gap before it: a restart lost a part only buffered) are never refused for room."""
        fs, budget = self.fragments.get(p), self.settings.pending_memory_bytes
        pending = fs.pending.get(learner_id)
        first = (pending is None or not fs.ready(pending)) and not self.arriving.has(learner_id, p)
        first = first or fs.is_known(contribution_key(learner_id, p, base_version, seq))
        held = self.held_bytes()
        if not may_take(held, size, budget, first=first):
            self.metrics.contributions.labels("pending_full").inc()
            raise pending_full(p, held, size, budget)
        return self.arriving.hold(learner_id, p, size)

    def body_limit(self, p: int) -> int:
        """Largest body accepted for fragment ``p`` (``payload_limit``)."""
        return payload_limit(self.fragments.get(p).spec, self.settings.max_body_bytes)

    def precheck(
        self,
        learner_id: str,
        p: int,
        base_version: int,
        seq: int,
        since: int = 0,
        steps: int = 1,
        tokens: int = 0,
        unit_min_step_s: float | None = None,
    ) -> FragmentState:
        """The checks that need no body: registration (a learner that left is refused until it
        registers again), fragment, initialisation, staleness, progress and its pace
        (``unit_min_step_s``: the step time the learner's token declares for its unit).

        A repeat of a contribution taken already is not refused as stale: it answers ``duplicate``,
        so a learner whose answer was lost learns that its contribution counted.
        """
        learner = self.registry.get(learner_id)
        if learner is None:
            raise not_registered(learner_id)
        if learner.has_left:
            raise learner_left(learner_id)
        fs = self.fragments.get(p)
        if fs.version < 0:
            raise ApiError(
                409, "not_initialised", f"fragment {p} has no parameters yet: upload them with /init"
            )
        if not fs.is_known(contribution_key(learner_id, p, base_version, seq)):
            self._check_fresh(fs, base_version)
            self._check_new_progress(fs, learner_id, base_version, since, steps, tokens, unit_min_step_s)
        return fs

    def _check_new_progress(
        self,
        fs: FragmentState,
        learner_id: str,
        base_version: int,
        since: int,
        steps: int,
        tokens: int,
        unit_min_step_s: float | None,
    ) -> None:
        """Refuse progress taken already, a part that does not start where the learner's progress is
        held through, a continuation whose sum with what it continues is beyond the bounds, and more
        steps than the learner can have trained since its base (at the job's or, when slower, its
        unit's fastest pace)."""
        refusal = fs.refusal(learner_id, base_version, since, steps, tokens)
        if refusal is not None:
            status, code, reason = refusal
            raise ApiError(status, code, reason, current_version=fs.version if status == 409 else None)
        min_step_s, bound = pace_for(self.settings.min_step_time_s, unit_min_step_s)
        too_fast = pace_problem(
            learner_id,
            fs.index,
            base_version,
            since + steps,
            fs.version_times.get(base_version),
            self.clock(),
            min_step_s=min_step_s,
            slack_steps=2 * self.diloco.inner_steps,
            bound=bound,
        )
        if too_fast is not None:
            raise ApiError(400, "bad_request", too_fast)

    def _check_fresh(self, fs: FragmentState, base_version: int) -> None:
        """Refuse a base the contribution's round would exclude: while a merge runs, the round it
        joins is on the version that merge makes, so it is judged against that one (accepting it and
        excluding it after the commit would lose an acknowledged contribution)."""
        max_staleness = self.diloco.max_staleness
        if base_version > fs.version:
            raise ApiError(
                409,
                "stale",
                f"base version {base_version} is newer than fragment {fs.index}'s {fs.version}: resynchronise",
                current_version=fs.version,
            )
        round_version = fs.version + 1 if fs.phase == "merging" else fs.version
        if rounds.is_stale(base_version, round_version, max_staleness):
            lag = rounds.staleness(base_version, round_version)
            merging = f" (version {round_version} is being merged)" if round_version != fs.version else ""
            raise ApiError(
                409,
                "stale",
                f"base version {base_version} is {lag} versions behind fragment {fs.index}'s {round_version}{merging} "
                f"(at most {max_staleness} allowed): fetch the fragment and continue from it",
                current_version=fs.version,
            )

    def open_body(self, learner_id: str, p: int, base_version: int, seq: int) -> Upload:
        """Where a contribution's body is written as it arrives: its pending object in storage (a
        file), or memory while storage is down; ``contribute`` takes it, the caller discards it."""
        return self.store.start_pending(p, learner_id, base_version, seq, to_storage=self.guard.ok)

    def storage_failed(self, exc: OSError) -> None:
        """A body could not be written where it goes: storage is down until the guard sees it back
        (the next bodies are received in memory)."""
        self.guard.mark_down(StorageUnavailable(f"writing a contribution's body: {exc}"))

    async def contribute(
        self,
        learner_id: str,
        p: int,
        *,
        base_version: int,
        steps: int,
        tokens: int,
        seq: int,
        body: Upload,
        since: int = 0,
        unit_min_step_s: float | None = None,
    ) -> ContributionResult:
        """Take the payload received into ``body`` (``open_body``): checked, then stored as it is."""
        fs = self.precheck(learner_id, p, base_version, seq, since, steps, tokens, unit_min_step_s)
        size = body.size - PENDING_HEAD_SIZE
        key = contribution_key(learner_id, p, base_version, seq)
        if not fs.reserve(key):
            self.metrics.contributions.labels("duplicate").inc()
            return self._result("duplicate", fs, base_version, durable=fs.is_durable(key))
        try:
            meta = PendingMeta(
                learner_id=learner_id,
                fragment=p,
                base_version=base_version,
                seq=seq,
                steps=steps,
                tokens=tokens,
                received_at=self.clock(),
                since=since,
            )
            taken = await anyio.to_thread.run_sync(self._take, fs, meta, body, self.guard.ok)
            if taken.failure is not None:
                self.guard.mark_down(taken.failure)
                log.warning("contribution %s kept in memory: %s", key, taken.failure)
            try:
                self._check_fresh(fs, base_version)  # a round may have moved on meanwhile
                self._check_new_progress(fs, learner_id, base_version, since, steps, tokens, unit_min_step_s)
            except ApiError:
                self._delete_later([taken.storage_key] if taken.storage_key else [])
                raise
            c = Contribution.from_meta(
                meta, taken.checked.tensors, size, taken.storage_key, norm=taken.checked.norm
            )
            if taken.blob is not None:
                self._hold_in_memory(c, taken.blob)
            self._enqueue(fs, c)
        finally:
            fs.release(key)
        await self._compact(fs, learner_id)
        learner = self.registry.get(learner_id)
        if learner is not None:
            learner.contributions += 1
            learner.base_versions[p] = base_version
        self.traffic.received(size)
        self.metrics.contributions.labels("accepted").inc()
        self.wake()
        return self._result("accepted", fs, base_version, durable=c.storage_key is not None)

    async def _compact(self, fs: FragmentState, learner_id: str) -> None:
        """The learner's pending progress, when its parts hold more than ``COMPACT_AT`` times their
        sum in float32, is added up once in a worker thread (the same values; its norm measured
        with them), so a learner's many parts hold memory of the fragment's size, not of their
        count. A part that cannot be read leaves it as it was: its round excludes it."""
        c = fs.pending.get(learner_id)
        if c is None or id(c) in self._compacting or not needs_compacting(c.tensors, 4 * fs.spec.numel):
            return
        self._compacting.add(id(c))
        try:
            c.tensors, c.norm = await anyio.to_thread.run_sync(_compacted_with_norm, c.tensors)
            for part in c.parts:  # a part's own tensors are never read again: only the sum's are
                part.tensors = {}
        except ValueError as exc:
            log.warning("contribution %s: its parts could not be added up: %s", c.key, exc)
        finally:
            self._compacting.discard(id(c))

    def _result(
        self, status: Literal["accepted", "duplicate"], fs: FragmentState, base_version: int, *, durable: bool
    ) -> ContributionResult:
        return ContributionResult(
            status=status,
            fragment=fs.index,
            base_version=base_version,
            version=fs.version,
            pending=len(fs.pending),
            durable=durable,
        )

    def _take(self, fs: FragmentState, meta: PendingMeta, body: Upload, store_it: bool) -> _Taken:
        """Blocking, in one worker thread: decode and check the payload where it was received, then
        store its pending object (the payload is written once: it is the object).

        A refused payload raises ``ApiError`` and is never stored. A storage failure is returned
        (not raised) with the payload, so the caller can keep the contribution in memory instead.
        """
        try:
            with reading(body, PENDING_HEAD_SIZE) as payload:
                checked = validate_outer_gradient(
                    payload, fs.spec, meta.base_version, self.body_limit(fs.index)
                )
                if not store_it:
                    return _Taken(checked, None, None, bytes(payload))
        except OSError as exc:  # the last of the body could not be written
            self.storage_failed(exc)
            raise body_not_written(exc) from None
        try:
            return _Taken(checked, self.store.finish_pending(body, meta), None, None)
        except StorageError as exc:
            with reading(body, PENDING_HEAD_SIZE) as payload:
                return _Taken(checked, None, exc, bytes(payload))

    def _hold_in_memory(self, c: Contribution, blob: bytes) -> None:
        """Storage is down: keep the payload in memory within the budget, or answer 503 (retryable)."""
        if not self.guard.reserve(len(blob)):
            raise ApiError(
                503,
                "storage_unavailable",
                f"storage is unavailable and {self.guard.buffered_bytes} bytes are already held in memory: retry later",
                retryable=True,
            )
        c.blob = blob

    def _enqueue(self, fs: FragmentState, c: Contribution) -> None:
        for previous in fs.accept(c, self.diloco.quorum):
            log.info("learner %s: contribution %s supersedes %s", c.learner_id, c.key, previous.key)
            self.discard(previous)

    def forget(self, c: Contribution) -> None:
        """Drop a contribution from memory only (its stored copies, if any, stay for a restart)."""
        for part in c.received():
            if part.blob is not None:
                self.guard.release(len(part.blob))
                part.blob = None

    def discard(self, c: Contribution) -> None:
        """Forget a contribution that will never be merged (or was merged): free memory and storage."""
        self.forget(c)
        for part in c.received():
            if part.storage_key is not None:
                key, part.storage_key = part.storage_key, None
                self._delete_later([key])

    def replay(self, pending: list[Contribution]) -> None:
        """Queue contributions found in storage at start-up (in arrival order)."""
        for c in pending:
            fs = self.fragments.find(c.fragment)
            if fs is None or fs.is_known(c.key):
                continue
            refusal = fs.refusal(c.learner_id, c.base_version, c.since, c.steps, c.tokens, in_order=False)
            if refusal is not None:
                log.warning("not replaying contribution %s: %s", c.key, refusal[2])
                self.discard(c)
                continue
            self._enqueue(fs, c)

    async def flush(self) -> None:
        """Storage is back: write what was held in memory (raises while storage still fails)."""
        for fs in self.fragments:
            for c in [part for x in fs.queued() for part in x.received()]:
                blob = c.blob
                if blob is not None and c.storage_key is None:
                    key = await anyio.to_thread.run_sync(self.store.put_pending, c.meta(), blob)
                    if fs.mark_durable(c, key):
                        self.guard.release(len(blob))
                    else:  # merged or superseded meanwhile
                        self._delete_later([key])

    def _delete_later(self, keys: list[str]) -> None:
        """Delete objects that are no longer needed, off the request path; failures are only logged."""
        if keys:
            task = asyncio.get_running_loop().create_task(self._delete(keys))
            self._deletes.add(task)
            task.add_done_callback(self._deletes.discard)

    async def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                await anyio.to_thread.run_sync(self.store.delete, key)
            except StorageError as exc:
                log.info("could not delete %s (collected later): %s", key, exc)


def _compacted_with_norm(g: Gradient) -> tuple[Gradient, float]:
    dense = compacted(g)
    return dense, tensors_norm(dense)
