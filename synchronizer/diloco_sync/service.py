"""The synchronizer's decisions: registration, plan adoption, initial parameters, reads, status.

State lives on the event loop (no locks); everything blocking (storage, codec) runs in threads
through ``StorageGuard`` or ``anyio.to_thread``. This object holds the parts every route shares (the
fragments, the learner registry, storage, metrics); contributions and rounds are in ``contributions``
and ``round_loop``, which are given only the parts they use.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import anyio.to_thread
from diloco_core import codec, downlink
from diloco_core.fragments import FragmentPlan, plan_differences
from diloco_core.layout import FragmentRecord, LearnerRecord
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
from diloco_core.sharding import shard_fragments
from diloco_core.storage import StorageError
from diloco_core.wire import WireTally

from .contribution import Contribution
from .errors import ApiError, learner_left, not_registered
from .fragments import Fragments
from .ingest import payload_limit, validate_initial_params
from .learners import LearnerLeft, LearnerRegistry, UnknownLearner
from .merging import write_outer_state
from .metrics import Metrics, Traffic
from .persistence import StateStore
from .publication import Served, served_form, served_size
from .recovery import LoadedState, load_state, take_up
from .round_policy import RoundPolicy
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
        self.traffic = Traffic(self.metrics)
        self.wire = WireTally()  # the server's connections' bytes at the socket
        self.metrics.watch_wire(self.wire)
        self.guard = StorageGuard(settings.memory_budget_bytes, settings.storage_retry_max_s, self.metrics)
        self.registry = LearnerRegistry(self.diloco.heartbeat_timeout_s)
        self.fragments = Fragments(settings)
        self.policy = RoundPolicy(self.diloco, self.registry, settings.max_grace_s)
        self.recent_rounds: deque[RoundRecord] = deque(maxlen=settings.recent_rounds)
        self.registry_dirty = False

    # -- start-up --------------------------------------------------------------------------------

    async def load(self) -> list[Contribution]:
        """Read the committed state; returns the pending contributions to replay. Waits out a storage
        outage; a refusal that waiting cannot cure (wrong credentials, no such bucket) fails the start-up."""
        try:
            loaded: LoadedState = await self.guard.call_until_done(
                load_state,
                self.store,
                self.settings.owned_fragments,
                self.settings.served_in_memory_bytes,
                self.settings.recent_rounds,
                what="loading the committed state",
                outages_only=True,
            )
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
                self.fragments.adopt(FragmentPlan.from_dict(plan_dict))
            except ApiError as exc:
                raise RuntimeError(
                    f"the stored fragment plan does not fit the job settings: {exc.body.reason}"
                ) from exc
            plan_hash = self.fragments.plan_hash
            if self.settings.plan_path and loaded.plan is None:
                await self.guard.call_until_done(self.store.save_plan, self.fragments.plan_dict(), plan_hash)
            elif (
                self.settings.plan_path
                and loaded.plan
                and FragmentPlan.from_dict(loaded.plan).hash() != plan_hash
            ):
                raise RuntimeError(
                    f"--plan {self.settings.plan_path} differs from the plan this job's storage holds"
                )
        for p, lf in loaded.fragments.items():
            take_up(self.fragments.get(p), lf, now, self.diloco.quorum)
        log.info(
            "job %s shard %d loaded: plan %s, versions %s, %d learners, %d pending contributions",
            self.settings.job.job_id,
            self.settings.shard_index,
            self.fragments.plan_hash[:12] or "(none yet)",
            self.versions(),
            len(self.registry.learners),
            len(loaded.pending),
        )
        return loaded.pending

    # -- learners ------------------------------------------------------------------------------

    async def register(self, req: RegisterRequest) -> RegisterResponse:
        if self.fragments.plan is None:
            await self._adopt_first_plan(req)
        elif req.plan_hash != self.fragments.plan_hash:
            raise ApiError(409, "plan_mismatch", self._plan_mismatch(req))
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
            plan_hash=self.fragments.plan_hash,
            plan=self.fragments.plan_dict(),
            versions=versions,
            needs_init=self.fragments.uninitialised(),
            initial_digests=self.fragments.initial_digests(),
            diloco=self.diloco.model_dump(),
            shards=self.shards(),
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
        )

    def _plan_mismatch(self, req: RegisterRequest) -> str:
        """Why a learner's plan is not the job's, naming each setting and both values."""
        head = (
            f"learner plan hash {req.plan_hash[:16]} differs from the job's {self.fragments.plan_hash[:16]}"
        )
        assert self.fragments.plan is not None
        try:
            theirs = FragmentPlan.from_dict(req.plan)
        except ValueError:
            return f"{head}: the model or the DiLoCo settings differ"
        return f"{head}: " + "; ".join(plan_differences(self.fragments.plan, theirs) or ["the plans differ"])

    async def _adopt_first_plan(self, req: RegisterRequest) -> None:
        try:
            plan = FragmentPlan.from_dict(req.plan)
        except ValueError as exc:
            raise ApiError(400, "bad_request", str(exc)) from exc
        if plan.hash() != req.plan_hash:
            raise ApiError(400, "bad_request", "plan_hash is not the hash of the plan sent")
        self.fragments.check_plan(plan)
        try:
            await self.guard.call(self.store.save_plan, plan.to_dict(), plan.hash())
        except StorageError as exc:
            raise ApiError(
                503, "storage_unavailable", f"cannot store the plan: {exc}", retryable=True
            ) from exc
        if self.fragments.plan is None:  # another registration may have adopted one meanwhile
            self.fragments.adopt(plan)
            log.info(
                "adopted fragment plan %s from learner %s", self.fragments.plan_hash[:12], req.learner_id
            )

    async def save_registry(self) -> None:
        try:
            await self.guard.call(self.store.save_learners, self.registry.to_record())
            self.registry_dirty = False
        except StorageError:
            self.registry_dirty = True  # written by the storage watcher once storage is back

    async def flush_registry(self) -> None:
        """Storage is back: write the registry if a change could not be written (raises while it fails)."""
        if self.registry_dirty:
            await anyio.to_thread.run_sync(self.store.save_learners, self.registry.to_record())
            self.registry_dirty = False

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
        self.metrics.learner_wire_bytes.labels(learner_id, "sent").set(hb.wire_sent)
        self.metrics.learner_wire_bytes.labels(learner_id, "received").set(hb.wire_received)
        return HeartbeatResponse(versions=self.versions(), alive_learners=self.registry.alive_count(now))

    async def leave(self, learner_id: str) -> None:
        """A learner leaves the quorum (twice, or unregistered, is no error); the registry records it,
        so a synchronizer restarted afterwards does not count it alive."""
        try:
            changed = self.registry.leave(learner_id, self.clock())
        except UnknownLearner:
            return
        if changed:
            await self.save_registry()
        self.metrics.forget_learner(learner_id)
        log.info("learner %s left", learner_id)

    # -- fragments -------------------------------------------------------------------------------

    async def init_fragment(self, p: int, blob: bytes | memoryview) -> FragmentVersionInfo:
        fs = self.fragments.get(p)
        self._check_uninitialised(p)
        params = await anyio.to_thread.run_sync(
            validate_initial_params, blob, fs.spec, payload_limit(fs.spec, self.settings.max_body_bytes)
        )
        self._check_uninitialised(p)
        fs.begin_init()  # no second init while this one is written
        try:
            payload = await anyio.to_thread.run_sync(codec.encode_params, params, p, 0)
            digest = await anyio.to_thread.run_sync(downlink.digest, params)
            record = FragmentRecord(
                version=0,
                params_key=self.store.layout.params(p, 0),
                outer_key=self.store.layout.outer(p, 0),
                params_bytes=len(payload),
                version_times={0: self.clock()},
            )
            try:
                await self.guard.call(
                    lambda: self.store.commit_version(
                        p,
                        record,
                        params_blob=payload,
                        outer=partial(write_outer_state, state=fs.state.outer, fragment=p, version=0),
                        round_log=None,
                        count_round=False,
                    )
                )
            except StorageError as exc:
                raise ApiError(
                    503, "storage_unavailable", f"cannot store fragment {p}: {exc}", retryable=True
                ) from exc
        except BaseException:
            fs.abort_init()
            raise
        served = served_form(payload, record.params_key, self.settings.served_in_memory_bytes)
        fs.finish_init(
            params, served, self.clock(), self.diloco.quorum, digest=digest, outer_key=record.outer_key
        )
        self.traffic.received(len(blob))
        self.metrics.fragment_version.labels(str(p)).set(0)
        log.info("fragment %d initialised (%d parameters)", p, fs.spec.numel)
        return FragmentVersionInfo(fragment=p, version=0)

    def _check_uninitialised(self, p: int) -> None:
        fs = self.fragments.get(p)
        if fs.phase != "uninitialised":
            raise ApiError(
                409,
                "already_initialised",
                f"fragment {p} is at version {fs.version}",
                current_version=fs.version,
            )

    async def fetch(
        self,
        learner_id: str,
        p: int,
        newer_than: int,
        wait: float,
        *,
        announce_rounds: bool = False,
        have: int = -1,
    ) -> tuple[int, Served] | RoundOpen | None:
        """The newest version if newer than ``newer_than`` (waiting up to ``wait`` s), else None.
        With ``announce_rounds``, a round on version ``newer_than`` that this learner has not joined
        answers early with :class:`RoundOpen`: the learner is asked for its partial progress. A
        learner that holds version ``have`` exactly gets, with compressed downloads, the update from
        it, or the first link of the chain of updates from it (``Publication.payload_for``)."""
        fs = self.fragments.get(p)
        news = await fs.wait_newer(
            newer_than, min(wait, self.settings.max_wait_s), learner_id if announce_rounds else None
        )
        if news == "round":
            return RoundOpen(newer_than, self.policy.grace_left(fs.round, self.clock()))
        sent = fs.served.payload_for(have, newer_than)
        if news is None or sent is None:
            return None
        version, payload = sent
        learner = self.registry.get(learner_id)
        if learner is not None:
            learner.base_versions[p] = version
            learner.bytes_received += served_size(payload)
        self.traffic.served(served_size(payload))
        return version, payload

    # -- views -----------------------------------------------------------------------------------

    def versions(self) -> dict[int, int]:
        return self.fragments.versions()

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
        wire = self.wire.totals()
        return StatusResponse(
            job_id=self.settings.job.job_id,
            shard=self.settings.shard_index,
            num_shards=self.settings.num_shards,
            learners=learners,
            fragments=[
                FragmentStatus(
                    fragment=p,
                    version=versions[p],
                    pending=len(fs.pending) if (fs := self.fragments.find(p)) else 0,
                    rounds=fs.rounds if fs else 0,
                    excluded=fs.checked.excluded if fs else 0,
                    clipped=fs.checked.clipped if fs else 0,
                )
                for p in self.settings.owned_fragments
            ],
            rounds=sum(fs.rounds for fs in self.fragments),
            recent_rounds=list(self.recent_rounds)[::-1],
            bytes_in=self.traffic.bytes_in,
            bytes_out=self.traffic.bytes_out,
            wire_in=wire[1],
            wire_out=wire[0],
            tokens=sum(lr.tokens for lr in learners),
            goodput=self.registry.goodput(),
            storage_ok=self.guard.ok,
            eval_loss=sum(losses) / len(losses) if losses else None,
        )

    def refresh_gauges(self) -> None:
        now = self.clock()
        self.metrics.learners_alive.set(self.registry.alive_count(now))
        self.metrics.learners_registered.set(len(self.registry.learners))
        for fs in self.fragments:
            self.metrics.fragment_version.labels(str(fs.index)).set(fs.version)
            self.metrics.pending.labels(str(fs.index)).set(len(fs.pending))
