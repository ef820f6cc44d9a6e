"""The DiLoCo side of a learner: register, first contact, the step-boundary hook, leaving.

Only the unit's rank 0 talks to the synchronizer; the other ranks follow its decisions through
:meth:`Unit.boundary`, so every rank applies the same global fragments at the same step.

A sharded synchronizer announces its shards when the learner registers with the one it was given;
the learner then registers with every other shard too and sends each fragment's calls to its owner
(:mod:`.routing`).
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from diloco_core import downlink
from diloco_core import protocol as proto
from diloco_core.codec import decode, encode
from diloco_core.config import SCHEDULES, DiLoCoSettings, Quantizer, Schedule
from diloco_core.fragments import Fragment, FragmentPlan

from .comms import CommSettings, Communicator
from .distributed import Arrivals, Unit
from .fragment_state import FragmentState
from .health import Health
from .lockstep import lockstep_counters, round_can_close
from .metrics import MetricsLog
from .pacing import backoff_delay
from .poller import Held
from .pull import should_send_partial
from .routing import RoutingError, build_routes
from .settings import WorkerSettings
from .sync_client import (
    GlobalFragment,
    ShardClients,
    SyncClient,
    SyncRejected,
    SyncUnavailable,
    SyncUntrusted,
)
from .train import LoopState

log = logging.getLogger("diloco_worker.session")
T = TypeVar("T")
BLOCK_TICK_S = 1.0  # a blocked learner looks at arrivals, stop requests and its unit this often
MEMBERS_CHECK_S = 3.0  # and asks this often whether the learners still in the job can close the round
TOKEN_RENEWAL_WAIT_S = 300.0  # a refused token from a file: how long registering waits for its renewal
INIT_WAIT_S, INIT_WAIT_MAX_S = 0.1, 5.0  # registering again while another learner initialises a fragment


class FatalSyncError(RuntimeError):
    """The synchronizer refused this learner for good (wrong plan, wrong token), or its TLS
    certificate is not trusted."""


class DiLoCoSession:
    def __init__(
        self,
        settings: WorkerSettings,
        plan: FragmentPlan,
        fragments: FragmentState,
        unit: Unit,
        *,
        tokens_per_step: int,
        stop: threading.Event,
        metrics: MetricsLog | None = None,
        health: Health | None = None,
        client: SyncClient | None = None,
    ) -> None:
        """``client``: the leader's connection to the synchronizer it was given (the one its data ranges
        come through too, so that its bytes are counted once); the session closes it."""
        self.settings, self.plan, self.fs, self.unit = settings, plan, fragments, unit
        self.tokens_per_step, self.stop, self.metrics, self.health = tokens_per_step, stop, metrics, health
        self.alpha, self.quantizer, self.heartbeat_interval_s = 0.0, "int4", 2.0
        self.quorum, self.error_feedback = 1, False
        self.schedule: Schedule = "fixed"  # the job's, from the synchronizer (rank 0 tells the others)
        self.down_codec: Quantizer = "fp32"  # the job's: whether to keep versions for their updates
        self._short_of_learners = False
        self.client: SyncClient | None = None  # the synchronizer (shard) the learner was given
        self.shards: ShardClients | None = None  # every shard, once the home one has answered
        self.comm: Communicator | None = None
        self._step = 0
        # version 0 as this learner can hold it without a download: the fragments it initialised, and
        # the synchronizers' digests of the fragments still at version 0
        self._uploaded: set[int] = set()
        self._initial_digests: dict[int, str] = {}
        # global versions held exactly, from the checkpoint resumed (their next ones may come as updates)
        self._kept: Held = {}
        # a synchronous job sends in lockstep: nothing to pull there
        self.partial_contributions = settings.partial_contributions and not settings.blocking_sync
        if unit.is_leader:
            if client is None:
                raise ValueError("the unit's leader talks to the synchronizer: it needs a client")
            self.client = client

    # ---- start-up ----
    def _register_once(self, client: SyncClient) -> proto.RegisterResponse:
        """Register with one shard and upload the initial parameters of its fragments that need them."""
        req = proto.RegisterRequest(
            learner_id=self.settings.learner_id,
            unit=self.settings.unit,
            plan=self.plan.to_dict(),
            plan_hash=self.plan.hash(),
            tokens_per_step=self.tokens_per_step,
            step=self._step,
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
                return self._register_once(client)
            if exc.status in (401, 403):
                raise FatalSyncError(f"the synchronizer refused the learner token: {exc.reason}") from exc
            raise
        known = {k: v for k, v in resp.diloco.items() if k in DiLoCoSettings.model_fields}
        job = DiLoCoSettings.model_validate(known)
        self.alpha, self.quantizer, self.quorum = job.mixing_alpha, job.codec, job.quorum
        self.error_feedback, self.schedule = job.error_feedback, job.schedule
        self.down_codec = job.down_codec
        self.heartbeat_interval_s = resp.heartbeat_interval_s
        self._initial_digests.update(resp.initial_digests)
        for p in resp.needs_init:
            self._upload_init(client, p)
        return resp

    def _upload_init(self, client: SyncClient, p: int) -> None:
        blob = encode(self.fs.anchors[p], fragment=p, base_version=-1, kind="params", quantizer="fp32")
        try:
            info = client.init_fragment(p, blob)
            log.info("fragment=%d version=%d uploaded the initial parameters", p, info.version)
            self._uploaded.add(p)
        except SyncRejected as exc:
            if exc.code != "already_initialised":
                raise
            log.info("fragment=%d already initialised by another learner", p)

    def _retry(self, what: str, fn: Callable[[], T]) -> T | None:
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

    def _join(self) -> dict[int, int] | None:
        """Register with the shard the learner was given, then with every other shard it announces;
        the newest global version of every fragment, or None when asked to stop first."""
        assert self.client is not None
        home = self.client
        resp = self._retry("register", lambda: self._register_once(home))
        if resp is None:
            return None
        try:
            routes = build_routes(
                self.client.base_url, resp.shards, resp.versions.keys(), len(self.plan.fragments)
            )
        except RoutingError as exc:
            raise FatalSyncError(str(exc)) from exc
        self.shards = ShardClients.connect(routes, self.client)
        versions = dict(resp.versions)
        for shard in routes.others():
            client = self.shards.shard(shard.index)
            got = self._retry(f"shard={shard.index} register", functools.partial(self._register_once, client))
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
        while waiting := [p for p, v in versions.items() if v < 0 and p not in self._uploaded]:
            if self.stop.wait(min(INIT_WAIT_MAX_S, INIT_WAIT_S * 2**attempt)):
                return False
            attempt += 1
            for client in {id(c): c for c in map(shards.owner, waiting)}.values():
                got = self._retry("register", functools.partial(self._register_once, client))
                if got is None:
                    return False
                versions.update(got.versions)
        return True

    def _first_globals(self, versions: dict[int, int]) -> Arrivals:
        """Every fragment's global version newer than what this learner has (waits for missing ones)."""
        out: Arrivals = {}
        for f in self.plan.fragments:
            mine, theirs = self.fs.counters[f.index].base_version, versions.get(f.index, -1)
            if theirs != -1 and theirs <= mine:
                continue
            held = self._kept.get(f.index)
            if mine < 0 and (own := self._own_initial(f.index, theirs)) is not None:
                held = (0, own)
                log.info("fragment=%d version=0 is this learner's initial parameters", f.index)
            got = self._catch_up(f, mine, theirs, held)
            if got is None:
                break
            out[f.index] = got
        return out

    def _catch_up(
        self, f: Fragment, mine: int, theirs: int, held: tuple[int, dict[str, np.ndarray]] | None
    ) -> tuple[int, dict[str, np.ndarray]] | None:
        """Version ``theirs`` of fragment ``f`` or a newer one (the first version when ``theirs`` is
        -1): the copy ``held`` when it is that version, else the chain of updates from it, else the
        whole version; None when asked to stop first."""
        assert self.shards is not None
        owner, wait = self.shards.owner(f.index), self.settings.poll_wait_s
        version, values = held if held is not None else (-1, {})
        taken = 0
        while not self.stop.is_set():
            if version >= 0 and version >= theirs:
                if held is not None:
                    log.info(
                        "fragment=%d version=%d from the copy held at version %d and %d update(s)",
                        f.index,
                        version,
                        held[0],
                        taken,
                    )
                return version, values

            def fetch(v: int = version) -> GlobalFragment | None:
                got = owner.fetch(f.index, newer_than=v if v >= 0 else mine, wait_s=wait, have=v)
                return got if isinstance(got, GlobalFragment) else None

            got = self._retry(f"fragment={f.index} first fetch", fetch)
            if got is None:
                continue
            payload = decode(got.payload, fragment=f)
            if payload.kind != "update":
                version, values, held = got.version, dict(payload.tensors), None
                continue
            made = downlink.apply_decoded(version, values, payload)
            version, values = made if made is not None else (-1, {})  # not for this copy: take it whole
            taken += 1
        return None

    def _own_initial(self, p: int, theirs: int) -> dict[str, np.ndarray] | None:
        """A copy of this learner's parameters of fragment ``p`` (as built, never trained) when they are
        the job's version 0 bit for bit: it uploaded them, or they have the digest the synchronizer
        gave; else None."""
        if not ((theirs == -1 and p in self._uploaded) or (theirs == 0 and p in self._initial_digests)):
            return None
        own = {n: a.copy() for n, a in self.fs.store.arrays(p).items()}
        return own if theirs == -1 or downlink.digest(own) == self._initial_digests[p] else None

    def connect(
        self,
        state: LoopState,
        resumed: bool,
        held: Held | None = None,
    ) -> None:
        """Register (rank 0), take the current global state, start the background threads. ``held``:
        global versions the learner holds exactly (its checkpoint's, with compressed downloads)."""
        self._step = state.step
        self._kept = dict(held or {})
        arrivals: Arrivals = {}
        if self.unit.is_leader:
            versions = self._join()
            if versions is not None:
                arrivals = self._first_globals(versions)
        # as decoded, and the checkpoint's copies of the fragments that needed nothing new
        first = {**self._kept, **{p: (version, dict(tensors)) for p, (version, tensors) in arrivals.items()}}
        _, arrivals = self.unit.boundary(False, arrivals, self.plan)
        # every rank of the unit counts, so every rank follows the job's schedule
        self.fs.set_schedule(SCHEDULES[self.unit.share_int(SCHEDULES.index(self.schedule))])
        for p, (version, tensors) in sorted(arrivals.items()):
            if resumed:
                self.fs.apply(p, version, tensors, self.alpha)
            else:
                self.fs.set_base(p, version, tensors)
            log.info("learner=%s fragment=%d version=%d taken at start", self.settings.learner_id, p, version)
        if self.settings.blocking_sync:
            counters = lockstep_counters(self.plan, self.fs.versions())
            self.fs.set_counters(counters)
            log.info(
                "learner=%s blocking sync: steps since sync per fragment %s",
                self.settings.learner_id,
                counters,
            )
        if self.unit.is_leader and self.shards is not None:
            settings = CommSettings(
                quantizer=self.quantizer,
                heartbeat_interval_s=self.heartbeat_interval_s,
                poll_wait_s=self.settings.poll_wait_s,
                bandwidth_limit=self.settings.bandwidth_limit,
                announce_rounds=self.partial_contributions,
                hold_versions=self.down_codec != "fp32",
            )
            self.comm = Communicator(
                self.shards,
                self.plan,
                settings,
                versions=self.fs.versions(),
                on_unknown_learner=self._reregister,
                stage=self.fs.store.stage,
                held=first,
            )
            # a resumed learner reports where its checkpoint left it from the first heartbeat on (one
            # that resumed at the end of training leaves before it steps: it reports nothing else)
            self.comm.progress.step, self.comm.progress.tokens = state.step, state.tokens
            self.comm.progress.eval_loss = state.eval_loss
            self.comm.start()

    def held(self) -> Held:
        """The global versions held exactly now (for the checkpoint): none without compressed downloads."""
        return self.comm.held_versions() if self.comm is not None else {}

    def _reregister(self, shard: int) -> None:
        """A shard lost this learner (its registry was reset): register with that shard again."""
        assert self.shards is not None
        self._register_once(self.shards.shard(shard))

    # ---- every step ----
    def at_boundary(self, state: LoopState, step_tokens: int, stop: bool, step_time: float) -> bool:
        t0 = time.perf_counter()
        self._step = state.step
        self.fs.advance(step_tokens)
        arrivals = self.comm.take_arrivals() if self.comm else {}
        stop, arrivals = self.unit.boundary(stop, arrivals, self.plan)
        self._apply(arrivals, state.step)
        sent = self._send_due(state.step)
        if self.partial_contributions:
            self._send_requested(state.step)
        if self.settings.blocking_sync and sent and not stop:
            self._report(state, step_time, stop, blocked_s=state.blocked_s)
            stop = self._await_globals(set(sent), state, t0)
        state.blocked_s += time.perf_counter() - t0
        self._report(state, step_time, stop, blocked_s=state.blocked_s)
        return stop

    def _apply(self, arrivals: Arrivals, step: int) -> None:
        for p, (version, tensors) in sorted(arrivals.items()):
            self.fs.apply(p, version, tensors, self.alpha)
            log.info(
                "learner=%s step=%d fragment=%d version=%d applied",
                self.settings.learner_id,
                step,
                p,
                version,
            )

    def _send_due(self, step: int) -> list[int]:
        """Queue the outer gradients of the due fragments (rank 0; the other ranks only count)."""
        due = self.fs.due()
        for p in due:
            if self.comm:
                c = self.fs.take_contribution(p, self.quantizer, self.error_feedback)
                self.comm.submit(c)
                log.info(
                    "learner=%s step=%d fragment=%d version=%d outer gradient queued (%d steps)",
                    self.settings.learner_id,
                    step,
                    p,
                    c.base_version,
                    c.steps,
                )
            else:
                self.fs.mark_sent(p)
        return due

    def _send_requested(self, step: int) -> None:
        """Answer the rounds that asked for this learner's partial progress (docs/algorithm.md §3.4)."""
        chosen = 0
        if self.comm is not None:
            for p, version in self.comm.requests().items():
                c = self.fs.counters[p]
                if version < c.base_version:
                    self.comm.answered(p)  # a round this learner has moved past
                elif should_send_partial(
                    requested_version=version,
                    base_version=c.base_version,
                    steps=c.steps,
                    sent_at=c.sent_at,
                    pending=self.comm.pending(p),
                ):
                    chosen |= 1 << p
        chosen = self.unit.share_int(chosen)  # every rank of the unit counts the same sends
        for p in range(len(self.fs.counters)):
            if not chosen >> p & 1:
                continue
            if self.comm is None:
                self.fs.mark_sent(p)
                continue
            contribution = self.fs.take_contribution(p, self.quantizer, self.error_feedback)
            self.comm.submit(contribution)
            self.comm.answered(p)
            log.info(
                "learner=%s step=%d fragment=%d version=%d partial outer gradient queued (%d steps)",
                self.settings.learner_id,
                step,
                p,
                contribution.base_version,
                contribution.steps,
            )

    def _await_globals(self, waiting: set[int], state: LoopState, t0: float) -> bool:
        """Blocking sync: take arriving global versions until every fragment of ``waiting`` has a new
        one; returns the unit-wide stop decision. A stop request ends the wait, and so does a job
        whose remaining learners can no longer fill a round (the others finished and left).

        Rank 0 waits at most ``BLOCK_TICK_S`` at a time and then tells its peers, so that the other
        ranks of a unit (waiting in the broadcast) never reach their collective timeout."""
        stop, released = False, False
        # once the job could not fill a round, ask again on the first tick of every later wait
        last_check = float("-inf") if self._short_of_learners else time.monotonic()
        while waiting and not stop and not released:
            arrivals: Arrivals = {}
            if self.comm is not None:
                self.comm.wait_for_arrival(waiting, BLOCK_TICK_S)
                arrivals = self.comm.take_arrivals()
                stop = self.stop.is_set()
                self.comm.progress.blocked_s = state.blocked_s + time.perf_counter() - t0
                if time.monotonic() - last_check >= MEMBERS_CHECK_S:
                    last_check, released = time.monotonic(), not self._round_can_close()
                    self._short_of_learners = released
            stop, arrivals = self.unit.boundary(stop, arrivals, self.plan)
            released = self.unit.share_flag(released)
            self._apply(arrivals, state.step)
            waiting -= arrivals.keys()
            self._beat("blocked")
        if waiting:
            why = "stop requested" if stop else "too few learners left to close the round"
            log.info(
                "learner=%s step=%d %s; no longer waiting for fragments %s",
                self.settings.learner_id,
                state.step,
                why,
                sorted(waiting),
            )
        return stop

    def _round_can_close(self) -> bool:
        """Asks the synchronizer which learners are still in the job (unreachable: assume they are)."""
        assert self.shards is not None
        try:
            learners = self.shards.home().status().learners
        except (SyncUnavailable, SyncRejected):
            return True
        return round_can_close((lr.state for lr in learners), self.quorum)

    def _report(self, state: LoopState, step_time: float, stop: bool, *, blocked_s: float) -> None:
        """What the next heartbeat and metrics record say."""
        if not self.comm:
            return
        pr = self.comm.progress
        pr.step, pr.tokens, pr.step_time_s, pr.blocked_s = state.step, state.tokens, step_time, blocked_s
        pr.fragment_steps = {i: c.steps for i, c in enumerate(self.fs.counters)}
        pr.fragment_tokens = {i: c.tokens for i, c in enumerate(self.fs.counters)}
        pr.eval_loss = state.eval_loss
        if stop:
            pr.state = "leaving"
        if self.metrics:
            wire_sent, wire_received = self.comm.wire_bytes()
            self.metrics.set(
                bytes_sent=self.comm.bytes_sent,
                wire_sent=wire_sent,
                wire_received=wire_received,
                versions=self.fs.versions(),
            )

    def _beat(self, phase: str) -> None:
        if self.health is not None:
            self.health.beat(phase)

    # ---- leaving ----
    def close(self) -> None:
        """Send what is pending (bounded), say goodbye, stop the threads."""
        if self.comm is None or self.shards is None:
            if self.client is not None:
                self.client.close()
            return
        flushed, told = self.comm.leave(self.settings.shutdown_timeout_s, self.settings.learner_id)
        if told:
            log.info(
                "learner=%s left the job (pending contributions flushed: %s)",
                self.settings.learner_id,
                flushed,
            )
        self.shards.close()
        if self.client is not None:
            self.client.close()  # a shard's client too, unless the answer did not tell which shard it is
