"""The handshake of a unit's leader with the synchronizer: registering, and what the answers give.

The leader registers with the synchronizer (shard) it was given; a sharded synchronizer announces
its shards in the answer, and the leader registers with every other shard too (:mod:`.routing`).
Registering uploads the initial parameters of the fragments that need them; every answer carries
the job's DiLoCo settings (:class:`JobTerms`) and the newest global version of each fragment.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from diloco_core import protocol as proto
from diloco_core.codec import encode_params
from diloco_core.config import SCHEDULES, DiLoCoSettings, Quantizer, Schedule
from diloco_core.fragments import FragmentPlan

from .distributed import Unit
from .fragment_state import FragmentState
from .pacing import backoff_delay
from .routing import RoutingError, build_routes
from .settings import WorkerSettings
from .sync_client import ShardClients, SyncClient, SyncRejected, SyncUnavailable, SyncUntrusted

log = logging.getLogger("diloco_worker.session")
T = TypeVar("T")
TOKEN_RENEWAL_WAIT_S = 300.0  # a refused token from a file: how long registering waits for its renewal
INIT_WAIT_S, INIT_WAIT_MAX_S = 0.1, 5.0  # registering again while another learner initialises a fragment


class FatalSyncError(RuntimeError):
    """The synchronizer refused this learner for good (wrong plan, wrong token), or its TLS
    certificate is not trusted."""


@dataclass
class JobTerms:
    """The job's DiLoCo settings a learner follows, as the synchronizer's latest answer to
    registering gave them (the defaults until one has)."""

    alpha: float = 0.0
    codec: Quantizer = "int4"
    heartbeat_interval_s: float = 2.0
    quorum: int = 1
    error_feedback: bool = False
    schedule: Schedule = "fixed"  # rank 0 tells the other ranks of its unit (``share``)
    down_codec: Quantizer = "fp32"  # whether to keep versions for their updates

    def share(self, unit: Unit) -> None:
        """Take rank 0's terms on every rank of the unit: only rank 0 registers, and every rank
        counts steps by the schedule and mixes arriving versions in with ``alpha``."""
        self.alpha = unit.share_float(self.alpha)
        self.schedule = SCHEDULES[unit.share_int(SCHEDULES.index(self.schedule))]

    def take(self, resp: proto.RegisterResponse) -> None:
        """Follow the terms of an answer (the settings this learner does not know are left out)."""
        known = {k: v for k, v in resp.diloco.items() if k in DiLoCoSettings.model_fields}
        job = DiLoCoSettings.model_validate(known)
        self.alpha, self.codec, self.quorum = job.mixing_alpha, job.codec, job.quorum
        self.error_feedback, self.schedule = job.error_feedback, job.schedule
        self.down_codec = job.down_codec
        self.heartbeat_interval_s = resp.heartbeat_interval_s


class Handshake:
    """The leader's registrations with the synchronizer's shards. Every answer updates ``terms``;
    ``step`` is the step a registration reports (its owner keeps it current)."""

    def __init__(
        self,
        settings: WorkerSettings,
        plan: FragmentPlan,
        fragments: FragmentState,
        home: SyncClient,
        terms: JobTerms,
        *,
        tokens_per_step: int,
        stop: threading.Event,
        beat: Callable[[str], None],
    ) -> None:
        """``home``: the synchronizer (shard) the learner was given; ``beat(phase)``: a sign of life
        while registering is retried."""
        self.settings, self.plan, self.fs, self.home, self.terms = settings, plan, fragments, home, terms
        self.tokens_per_step, self.stop, self._beat = tokens_per_step, stop, beat
        self.step = 0
        self.shards: ShardClients | None = None  # every shard, once the home one has answered
        # version 0 as this learner can hold it without a download: the fragments it initialised, and
        # the synchronizers' digests of the fragments still at version 0
        self.uploaded: set[int] = set()
        self.initial_digests: dict[int, str] = {}

    def register(self, client: SyncClient) -> proto.RegisterResponse:
        """Register with one shard and upload the initial parameters of its fragments that need them."""
        req = proto.RegisterRequest(
            learner_id=self.settings.learner_id,
            unit=self.settings.unit,
            plan=self.plan.to_dict(),
            plan_hash=self.plan.hash(),
            tokens_per_step=self.tokens_per_step,
            step=self.step,
        )
        refused = client.token.current()
        try:
            resp = client.register(req)
        except SyncUntrusted as exc:
            raise FatalSyncError(str(exc)) from exc
        except SyncRejected as exc:
            if exc.code == "plan_mismatch":
                raise FatalSyncError(
                    f"the synchronizer's job uses a different model or fragment plan ({exc.reason}); check "
                    "--inner-steps/--fragments/--overlap and the model settings against the job"
                ) from exc
            if exc.status == 401 and client.token.wait_for_new(refused, TOKEN_RENEWAL_WAIT_S):
                log.info("the learner token was refused (%s); registering with the renewed one", exc.reason)
                return self.register(client)
            if exc.status in (401, 403):
                raise FatalSyncError(f"the synchronizer refused the learner token: {exc.reason}") from exc
            raise
        self.terms.take(resp)
        self.initial_digests.update(resp.initial_digests)
        for p in resp.needs_init:
            self._upload_init(client, p)
        return resp

    def _upload_init(self, client: SyncClient, p: int) -> None:
        blob = encode_params(self.fs.anchors[p], p, -1)
        try:
            info = client.init_fragment(p, blob)
            log.info("fragment=%d version=%d uploaded the initial parameters", p, info.version)
            self.uploaded.add(p)
        except SyncRejected as exc:
            if exc.code != "already_initialised":
                raise
            log.info("fragment=%d already initialised by another learner", p)

    def retry(self, what: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, tried again after a backoff while the synchronizer is unavailable; None when
        asked to stop first."""
        rng, attempt = random.Random(), 0
        while not self.stop.is_set():
            self._beat("starting")
            try:
                return fn()
            except SyncUnavailable as exc:
                attempt += 1
                log.warning("%s: synchronizer unavailable (%s); retrying", what, exc)
                self.stop.wait(backoff_delay(attempt, rng))
        return None

    def join(self) -> dict[int, int] | None:
        """Register with the shard the learner was given, then with every other shard it announces;
        the newest global version of every fragment, or None when asked to stop first."""
        resp = self.retry("register", functools.partial(self.register, self.home))
        if resp is None:
            return None
        try:
            routes = build_routes(
                self.home.base_url, resp.shards, resp.versions.keys(), len(self.plan.fragments)
            )
        except RoutingError as exc:
            raise FatalSyncError(str(exc)) from exc
        self.shards = ShardClients.connect(routes, self.home)
        versions = dict(resp.versions)
        for shard in routes.others():
            client = self.shards.shard(shard.index)
            got = self.retry(f"shard={shard.index} register", functools.partial(self.register, client))
            if got is None:
                return None
            versions.update(got.versions)
        if not self._await_initialised(versions):
            return None
        if routes.num_shards > 1:
            log.info(
                "learner=%s registered with %d synchronizer shards: %s",
                self.settings.learner_id,
                routes.num_shards,
                ", ".join(f"{s.index}={s.url} fragments {list(s.fragments)}" for s in routes.shards),
            )
        return versions

    def _await_initialised(self, versions: dict[int, int]) -> bool:
        """Fragments without a version that this learner did not initialise are being initialised by
        another: register again (uploading whatever is still uninitialised, e.g. after that learner
        failed) until each has its version 0, whose digest may spare its download. Updates
        ``versions``; False when asked to stop first."""
        assert self.shards is not None
        shards, attempt = self.shards, 0
        while waiting := [p for p, v in versions.items() if v < 0 and p not in self.uploaded]:
            if self.stop.wait(min(INIT_WAIT_MAX_S, INIT_WAIT_S * 2**attempt)):
                return False
            attempt += 1
            for client in {id(c): c for c in map(shards.owner, waiting)}.values():
                got = self.retry("register", functools.partial(self.register, client))
                if got is None:
                    return False
                versions.update(got.versions)
        return True

    def reregister(self, shard: int) -> None:
        """A shard lost this learner (its registry was reset): register with that shard again."""
        assert self.shards is not None
        self.register(self.shards.shard(shard))
