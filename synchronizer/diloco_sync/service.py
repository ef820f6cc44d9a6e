"""The synchronizer's decisions: registration, plan adoption, initial parameters, reads, status.

State lives on the event loop (no locks); everything blocking (storage, codec) runs in threads
through ``StorageGuard`` or ``anyio.to_thread``. Contributions and rounds are in ``contributions``
and ``round_loop``, which share this object.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from diloco_core.fragments import FragmentPlan
from diloco_core.protocol import (
    FragmentStatus,
    FragmentVersionInfo,
    Heartbeat,
    HeartbeatResponse,
    RegisterRequest,
    RegisterResponse,
    RoundRecord,
    ShardInfo,
    StatusResponse,
)
from diloco_core.sharding import shard_fragments, shard_of
from diloco_core.storage import StorageError

from .errors import ApiError, learner_left, not_registered
from .fragment_state import Contribution, FragmentState
from .ingest import encode_params, validate_initial_params
from .layout import FragmentRecord, LearnerRecord
from .learners import LearnerLeft, LearnerRegistry, UnknownLearner
from .merging import encode_outer_state, new_optimizer
from .metrics import Metrics
from .persistence import StateStore
from .recovery import LoadedState, load_state
from .round_loop import grace_left
from .settings import SyncSettings
from .storage_guard import StorageGuard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundOpen:
    """A round on ``version`` waits for the asking learner's contribution (deadline_s: grace left)."""

    version: int
    deadline_s: float | None


class SyncService:
    def __init__(
        self, settings: SyncSettings, store: StateStore, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.settings = settings
        self.diloco = settings.job.diloco
        self.store = store
        self.clock = clock
        self.metrics = Metrics()
        self.guard = StorageGuard(settings.memory_budget_bytes, settings.storage_retry_max_s, self.metrics)
        self.registry = LearnerRegistry(self.diloco.heartbeat_timeout_s)
        self.plan: FragmentPlan | None = None
        self.plan_hash = ""
        self.fragments: dict[int, FragmentState] = {}
        self.recent_rounds: deque[RoundRecord] = deque(maxlen=settings.recent_rounds)
        self.bytes_in = 0
        self.bytes_out = 0
        self.sync_time_s = 0.0  # EMA of merge + commit time
        self.registry_dirty = False
        self.started_at = clock()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- start-up --------------------------------------------------------------------------------

    async def load(self) -> list[Contribution]:
        """Read the committed state; returns the pending contributions to replay.

        Waits out a storage outage; a refusal that waiting cannot cure (wrong credentials, no such
        bucket) fails the start-up with what to check."""
        try:
            loaded: LoadedState = await self.guard.call_until_done(
                load_state, self.store, self.settings.owned_fragments, self.settings.recent_rounds,
                what="loading the committed state", outages_only=True,
            )  # fmt: skip
        except StorageError as exc:
            raise RuntimeError(
                f"cannot read the job's state from {self.store.store.describe()}: {exc}; check the "
                "storage URL and its credentials (--storage-access-key/--storage-secret-key, else AWS_*)"
            ) from exc
        now = self.clock()
        self.registry.restore(loaded.learners, now)
        self.recent_rounds.extend(loaded.rounds)
        if self.settings.plan_path:
            with open(self.settings.plan_path, encoding="utf-8") as fh:
                plan_dict = json.load(fh)
        else:
            plan_dict = loaded.plan
        if plan_dict is not None:
            try:
                self._adopt_plan(FragmentPlan.from_dict(plan_dict))
            except ApiError as exc:
                raise RuntimeError(
                    f"the stored fragment plan does not fit the job settings: {exc.body.reason}"
                ) from exc
            if self.settings.plan_path and loaded.plan is None:
                await self.guard.call_until_done(self.store.save_plan, self.plan_dict(), self.plan_hash)
            elif (
                self.settings.plan_path
                and loaded.plan
                and FragmentPlan.from_dict(loaded.plan).hash() != self.plan_hash
            ):
                raise RuntimeError(
                    f"--plan {self.settings.plan_path} differs from the plan this job's storage holds"
                )
        for p, lf in loaded.fragments.items():
            fs = self.fragments[p]
            if lf.outer is not None:
                fs.optimizer.load_state_arrays(lf.outer)
            fs.applied.extend(lf.record.applied)
            fs.rounds = lf.record.rounds
            fs.publish(lf.record.version, lf.params, lf.payload)
            fs.open_round(now, self.diloco.quorum)
        log.info(
            "job %s shard %d loaded: plan %s, versions %s, %d learners, %d pending contributions",
            self.settings.job.job_id, self.settings.shard_index, self.plan_hash[:12] or "(none yet)",
            self.versions(), len(self.registry.learners), len(loaded.pending),
        )  # fmt: skip
        return loaded.pending

    def _adopt_plan(self, plan: FragmentPlan) -> None:
        self._check_plan(plan)
        self.plan, self.plan_hash = plan, plan.hash()
        for p in self.settings.owned_fragments:
            if p not in self.fragments:
                self.fragments[p] = FragmentState(
                    spec=plan.fragments[p], optimizer=new_optimizer(self.diloco)
                )

    def plan_dict(self) -> dict[str, Any]:
        assert self.plan is not None
        return self.plan.to_dict()

    def _check_plan(self, plan: FragmentPlan) -> None:
        d = self.diloco
        if (
            len(plan.fragments) != d.fragments
            or plan.inner_steps != d.inner_steps
            or plan.overlap != d.overlap
        ):
            raise ApiError(
                409,
                "plan_mismatch",
                f"plan has {len(plan.fragments)} fragments, H={plan.inner_steps}, overlap={plan.overlap}; "
                f"the job has {d.fragments} fragments, H={d.inner_steps}, overlap={d.overlap}",
            )

    # -- learners ------------------------------------------------------------------------------

    async def register(self, req: RegisterRequest) -> RegisterResponse:
        if self.plan is None:
            await self._adopt_first_plan(req)
        elif req.plan_hash != self.plan_hash:
            raise ApiError(
                409, "plan_mismatch",
                f"learner plan hash {req.plan_hash[:16]} differs from the job's {self.plan_hash[:16]}: "
                "the model or the DiLoCo settings differ",
            )  # fmt: skip
        now = self.clock()
        record = LearnerRecord(
            learner_id=req.learner_id, unit=req.unit, tokens_per_step=req.tokens_per_step, registered_at=now
        )
        if self.registry.register(record, req.step, now):
            await self.save_registry()
        versions = self.versions()
        log.info("learner %s (unit %r) registered at step %d", req.learner_id, req.unit, req.step)
        return RegisterResponse(
            job_id=self.settings.job.job_id,
            learner_id=req.learner_id,
            plan_hash=self.plan_hash,
            plan=self.plan_dict(),
            versions=versions,
            needs_init=[p for p, v in versions.items() if v < 0],
            diloco=self.diloco.model_dump(),
            shards=self.shards(),
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
        )

    async def _adopt_first_plan(self, req: RegisterRequest) -> None:
        try:
            plan = FragmentPlan.from_dict(req.plan)
        except ValueError as exc:
            raise ApiError(400, "bad_request", str(exc)) from exc
        if plan.hash() != req.plan_hash:
            raise ApiError(400, "bad_request", "plan_hash is not the hash of the plan sent")
        self._check_plan(plan)
        try:
            await self.guard.call(self.store.save_plan, plan.to_dict(), plan.hash())
        except StorageError as exc:
            raise ApiError(
                503, "storage_unavailable", f"cannot store the plan: {exc}", retryable=True
            ) from exc
        if self.plan is None:  # another registration may have adopted one meanwhile
            self._adopt_plan(plan)
            log.info("adopted fragment plan %s from learner %s", self.plan_hash[:12], req.learner_id)

    async def save_registry(self) -> None:
        try:
            await self.guard.call(self.store.save_learners, self.registry.to_record())
            self.registry_dirty = False
        except StorageError:
            self.registry_dirty = True  # written by the storage watcher once storage is back

    def heartbeat(self, learner_id: str, hb: Heartbeat) -> HeartbeatResponse:
        """Record a learner's progress; 404 ``not_registered`` (register again) for an unknown learner."""
        now = self.clock()
        try:
            tokens = self.registry.heartbeat(learner_id, hb, now)
        except UnknownLearner:
            raise not_registered(learner_id) from None
        except LearnerLeft:
            raise learner_left(learner_id) from None
        if tokens:
            self.metrics.learner_tokens.labels(learner_id).inc(tokens)
        if hb.eval_loss is not None:
            self.metrics.learner_loss.labels(learner_id).set(hb.eval_loss)
        return HeartbeatResponse(versions=self.versions(), alive_learners=self.registry.alive_count(now))

    async def leave(self, learner_id: str) -> None:
        """A learner leaves the quorum; leaving twice, or without registering, is not an error.

        The registry records it, so a synchronizer restarted afterwards does not count it alive."""
        try:
            changed = self.registry.leave(learner_id, self.clock())
        except UnknownLearner:
            return
        if changed:
            await self.save_registry()
        self.metrics.forget_learner(learner_id)
        log.info("learner %s left", learner_id)

    # -- fragments -------------------------------------------------------------------------------

    def fragment(self, p: int) -> FragmentState:
        """The state of an owned fragment, or 404/421 with a reason."""
        if not 0 <= p < self.diloco.fragments:
            raise ApiError(
                404, "unknown_fragment", f"fragment {p} does not exist (the job has {self.diloco.fragments})"
            )
        if not self.settings.owns(p):
            owner = shard_of(p, self.settings.num_shards)
            raise ApiError(
                421,
                "wrong_shard",
                f"fragment {p} is served by shard {owner}, this is shard {self.settings.shard_index}",
            )
        fs = self.fragments.get(p)
        if fs is None:
            raise ApiError(409, "no_plan", "no learner has registered a fragment plan yet: register first")
        return fs

    async def init_fragment(self, p: int, blob: bytes) -> FragmentVersionInfo:
        fs = self.fragment(p)
        if fs.version >= 0 or fs.merging:
            raise ApiError(
                409,
                "already_initialised",
                f"fragment {p} is at version {fs.version}",
                current_version=fs.version,
            )
        params = await anyio.to_thread.run_sync(
            validate_initial_params, blob, fs.spec, self.settings.max_body_bytes
        )
        if fs.version >= 0 or fs.merging:
            raise ApiError(
                409,
                "already_initialised",
                f"fragment {p} is at version {fs.version}",
                current_version=fs.version,
            )
        fs.merging = True  # no second init while this one is written
        try:
            payload = await anyio.to_thread.run_sync(encode_params, params, p, 0)
            record = FragmentRecord(
                version=0, params_key=self.store.layout.params(p, 0), outer_key=self.store.layout.outer(p, 0)
            )
            outer_blob = encode_outer_state(fs.optimizer, p, 0)
            try:
                await self.guard.call(
                    lambda: self.store.commit_version(
                        p,
                        record,
                        params_blob=payload,
                        outer_blob=outer_blob,
                        round_log=None,
                        count_round=False,
                    )
                )
            except StorageError as exc:
                raise ApiError(
                    503, "storage_unavailable", f"cannot store fragment {p}: {exc}", retryable=True
                ) from exc
            fs.publish(0, params, payload)
            fs.open_round(self.clock(), self.diloco.quorum)
        finally:
            fs.merging = False
        self.bytes_in += len(blob)
        self.metrics.bytes_in.inc(len(blob))
        self.metrics.fragment_version.labels(str(p)).set(0)
        log.info("fragment %d initialised (%d parameters)", p, fs.spec.numel)
        return FragmentVersionInfo(fragment=p, version=0)

    async def fetch(
        self, learner_id: str, p: int, newer_than: int, wait: float, *, announce_rounds: bool = False
    ) -> tuple[int, bytes] | RoundOpen | None:
        """The newest version if newer than ``newer_than`` (waiting up to ``wait`` s), else None.

        With ``announce_rounds``, a round on version ``newer_than`` that this learner has not joined
        answers early with :class:`RoundOpen`: the learner is asked for its partial progress.
        """
        fs = self.fragment(p)
        news = await fs.wait_newer(
            newer_than, min(wait, self.settings.max_wait_s), learner_id if announce_rounds else None
        )
        if news == "round":
            return RoundOpen(newer_than, grace_left(self, fs, self.clock()))
        if news is None or fs.payload is None:
            return None
        learner = self.registry.get(learner_id)
        if learner is not None:
            learner.base_versions[p] = fs.version
        self.bytes_out += len(fs.payload)
        self.metrics.bytes_out.inc(len(fs.payload))
        return fs.version, fs.payload

    def background_delete(self, keys: list[str]) -> None:
        """Delete objects that are no longer needed, off the request path; failures are only logged."""
        if keys:
            task = asyncio.get_running_loop().create_task(self._delete(keys))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                await anyio.to_thread.run_sync(self.store.delete, key)
            except StorageError as exc:
                log.info("could not delete %s (collected later): %s", key, exc)

    # -- views -----------------------------------------------------------------------------------

    def versions(self) -> dict[int, int]:
        return {
            p: (self.fragments[p].version if p in self.fragments else -1)
            for p in self.settings.owned_fragments
        }

    def shards(self) -> list[ShardInfo]:
        s = self.settings
        urls = s.shard_urls or ("",) * s.num_shards
        return [
            ShardInfo(
                index=i,
                url=urls[i],
                fragments=shard_fragments(i, s.num_shards, self.diloco.fragments),
            )
            for i in range(s.num_shards)
        ]

    def status(self) -> StatusResponse:
        now = self.clock()
        versions = self.versions()
        learners = self.registry.status(now, versions)
        losses = [lr.eval_loss for lr in learners if lr.alive and lr.eval_loss is not None]
        return StatusResponse(
            job_id=self.settings.job.job_id,
            shard=self.settings.shard_index,
            num_shards=self.settings.num_shards,
            learners=learners,
            fragments=[
                FragmentStatus(
                    fragment=p,
                    version=versions[p],
                    pending=len(self.fragments[p].pending) if p in self.fragments else 0,
                    rounds=self.fragments[p].rounds if p in self.fragments else 0,
                )
                for p in self.settings.owned_fragments
            ],
            rounds=sum(fs.rounds for fs in self.fragments.values()),
            recent_rounds=list(self.recent_rounds)[::-1],
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            tokens=sum(lr.tokens for lr in learners),
            goodput=self.registry.goodput(),
            storage_ok=self.guard.ok,
            eval_loss=sum(losses) / len(losses) if losses else None,
        )

    def refresh_gauges(self) -> None:
        now = self.clock()
        self.metrics.learners_alive.set(self.registry.alive_count(now))
        self.metrics.learners_registered.set(len(self.registry.learners))
        for p, fs in self.fragments.items():
            self.metrics.fragment_version.labels(str(p)).set(fs.version)
            self.metrics.pending.labels(str(p)).set(len(fs.pending))
