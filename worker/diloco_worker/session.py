"""The DiLoCo side of a learner: register, first contact, the step-boundary hook, leaving.

Only the unit's rank 0 talks to the synchronizer (:mod:`.handshake`, :mod:`.catch_up`); the other
ranks follow its decisions through :meth:`Unit.boundary`, so every rank applies the same global
fragments at the same step. A synchronous job's learners wait at the boundary after sending
(:mod:`.blocking_sync`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from diloco_core.fragments import FragmentPlan

from .blocking_sync import BlockingSync
from .catch_up import first_globals
from .comms import CommSettings, Communicator
from .distributed import Arrivals, Unit
from .fragment_state import FragmentState, Outgoing
from .handshake import Handshake, JobTerms
from .health import Health
from .lockstep import lockstep_counters
from .metrics import MetricsLog
from .poller import Held
from .pull import should_send_partial
from .settings import WorkerSettings
from .sync_client import ShardClients, SyncClient
from .train import LoopState
from .unacknowledged import Unacknowledged, parts_to_resend

log = logging.getLogger("diloco_worker.session")


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
        self.stop, self.metrics, self.health = stop, metrics, health
        self.terms = JobTerms()  # the job's, from the synchronizer (rank 0 tells the others its schedule)
        self.client: SyncClient | None = None  # the synchronizer (shard) the learner was given
        self.handshake: Handshake | None = None
        self.comm: Communicator | None = None
        self._held_back: set[int] = set()  # fragments due while their previous part waited (``_send_due``)
        # a synchronous job sends in lockstep: nothing to pull there
        self.partial_contributions = settings.partial_contributions and not settings.blocking_sync
        self.blocking = (
            BlockingSync(
                unit,
                plan,
                self.terms,
                learner_id=settings.learner_id,
                stop=stop,
                apply=self._apply,
                beat=self._beat,
            )
            if settings.blocking_sync
            else None
        )
        if unit.is_leader:
            if client is None:
                raise ValueError("the unit's leader talks to the synchronizer: it needs a client")
            self.client = client
            self.handshake = Handshake(
                settings,
                plan,
                fragments,
                client,
                self.terms,
                tokens_per_step=tokens_per_step,
                stop=stop,
                beat=self._beat,
            )

    # ---- start-up ----
    def connect(
        self,
        state: LoopState,
        resumed: bool,
        held: Held | None = None,
        outgoing: Sequence[Outgoing] = (),
    ) -> None:
        """Register (rank 0), take the current global state, start the background threads. ``held``:
        global versions the learner holds exactly (its checkpoint's, with compressed downloads);
        ``outgoing``: the checkpoint's outer gradients the synchronizer had not durably taken (rank 0
        sends them again before anything new)."""
        kept = dict(held or {})
        arrivals: Arrivals = {}
        if self.handshake is not None:
            self.handshake.step = state.step
            versions = self.handshake.join()
            if versions is not None:
                arrivals = first_globals(self.handshake, kept, versions)
        # as decoded, and the checkpoint's copies of the fragments that needed nothing new
        first = {**kept, **{p: (version, dict(tensors)) for p, (version, tensors) in arrivals.items()}}
        _, arrivals = self.unit.boundary(False, arrivals, self.plan)
        self.terms.share(self.unit)  # every rank counts by the job's schedule and mixes with its alpha
        self.fs.set_schedule(self.terms.schedule)
        for p, (version, tensors) in sorted(arrivals.items()):
            if resumed:
                self.fs.apply(p, version, tensors, self.terms.alpha)
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
        if self.handshake is not None and self.handshake.shards is not None:
            self._start_communicator(self.handshake, self.handshake.shards, state, first, outgoing)

    def _start_communicator(
        self,
        handshake: Handshake,
        shards: ShardClients,
        state: LoopState,
        first: Held,
        outgoing: Sequence[Outgoing],
    ) -> None:
        """Rank 0's sender, pollers and heartbeats, from the versions taken at start; the sender has
        the checkpoint's parts not durably taken queued first, oldest first."""
        settings = CommSettings(
            codec=self.terms.codec,
            heartbeat_interval_s=self.terms.heartbeat_interval_s,
            poll_wait_s=self.settings.poll_wait_s,
            bandwidth_limit=self.settings.bandwidth_limit,
            announce_rounds=self.partial_contributions,
            hold_versions=self.terms.down_codec != "fp32",
        )
        self.comm = Communicator(
            shards,
            self.plan,
            settings,
            versions=self.fs.versions(),
            on_unknown_learner=handshake.reregister,
            stage=self.fs.store.stage,
            held=first,
        )
        # a resumed learner reports where its checkpoint left it from the first heartbeat on (one
        # that resumed at the end of training leaves before it steps: it reports nothing else)
        self.comm.progress.step, self.comm.progress.tokens = state.step, state.tokens
        self.comm.progress.eval_loss = state.eval_loss
        again = parts_to_resend(outgoing, self.fs.versions(), self.terms.codec)
        for c in again:
            self.comm.submit(c)
        if outgoing:
            log.info(
                "learner=%s step=%d %d outer gradient part(s) not durably taken at the checkpoint: %d sent "
                "again first, %d superseded",
                self.settings.learner_id,
                state.step,
                len(outgoing),
                len(again),
                len(outgoing) - len(again),
            )
        self.comm.start()

    def unacknowledged(self) -> Unacknowledged | None:
        """The outer gradients the synchronizer has not durably taken (for the checkpoint): None in a
        process that does not send."""
        if self.comm is None:
            return None
        return Unacknowledged(self.terms.codec, tuple(self.comm.unacknowledged()))

    def held(self) -> Held:
        """The global versions held exactly now (for the checkpoint): none without compressed downloads."""
        return self.comm.held_versions() if self.comm is not None else {}

    # ---- every step ----
    def at_boundary(self, state: LoopState, step_tokens: int, stop: bool, step_time: float) -> bool:
        t0 = time.perf_counter()
        if self.handshake is not None:
            self.handshake.step = state.step
        self.fs.advance(step_tokens)
        arrivals = self.comm.take_arrivals() if self.comm else {}
        stop, arrivals = self.unit.boundary(stop, arrivals, self.plan)
        self._send_held_back(arrivals, state.step)
        self._apply(arrivals, state.step)
        sent = self._send_due(state.step, leaving=stop)
        if self.partial_contributions:
            self._send_requested(state.step)
        if self.blocking is not None and sent and not stop:
            self._report(state, step_time, stop, blocked_s=state.blocked_s)
            stop = self.blocking.await_globals(self.comm, set(sent), state, t0)
        state.blocked_s += time.perf_counter() - t0
        self._report(state, step_time, stop, blocked_s=state.blocked_s)
        return stop

    def _apply(self, arrivals: Arrivals, step: int) -> None:
        for p, (version, tensors) in sorted(arrivals.items()):
            self.fs.apply(p, version, tensors, self.terms.alpha)
            log.info(
                "learner=%s step=%d fragment=%d version=%d applied",
                self.settings.learner_id,
                step,
                p,
                version,
            )

    def _send_due(self, step: int, *, leaving: bool = False) -> list[int]:
        """Queue the outer gradients of the due fragments and of those held back (rank 0; the other
        ranks only count).

        A fragment whose previous part is still waiting to be sent (the synchronizer answered
        ``pending_full`` until a round frees room, or the link is slow) is held back: its progress
        keeps growing and is queued at the first boundary where that part is sent, a new version of
        it arrives (``_send_held_back``, before the version is taken) or the learner is ``leaving``;
        so a learner queues one part per fragment while it waits, and drops nothing it trained. A
        synchronous job never holds one back (its learners wait for the round after each send)."""
        owed = set(self.fs.due()) | {p for p in self._held_back if self.fs.counters.unsent(p)}
        due, before, self._held_back = sorted(owed), self._held_back, set()
        if due and not leaving and self.blocking is None:
            waiting = [self.comm is not None and self.comm.pending(p) for p in due]
            waiting = self.unit.share_flags(waiting)  # every rank holds back the same fragments
            self._held_back = {p for p, wait in zip(due, waiting, strict=True) if wait}
            due = [p for p in due if p not in self._held_back]
        for p in sorted(self._held_back - before):
            log.info(
                "learner=%s step=%d fragment=%d outer gradient held back: the previous part is still waiting "
                "to be sent",
                self.settings.learner_id,
                step,
                p,
            )
        for p in due:
            self._queue(p, step)
        return due

    def _send_held_back(self, arrivals: Arrivals, step: int) -> None:
        """Queue the progress of the held-back fragments a new version arrived for, on the version it
        was trained on, before the new one replaces it (the same on every rank: both come from rank 0)."""
        for p in sorted(self._held_back & set(arrivals)):
            if self.fs.counters.unsent(p):
                self._queue(p, step)
        self._held_back -= set(arrivals)

    def _queue(self, p: int, step: int) -> None:
        """Take fragment ``p``'s outer gradient and queue it for sending (rank 0; the others count it)."""
        if not self.comm:
            self.fs.mark_sent(p)
            return
        c = self.fs.take_contribution(p, self.terms.codec, self.terms.error_feedback)
        self.comm.submit(c)
        log.info(
            "learner=%s step=%d fragment=%d version=%d outer gradient queued (%d steps)",
            self.settings.learner_id,
            step,
            p,
            c.base_version,
            c.steps,
        )

    def _send_requested(self, step: int) -> None:
        """Answer the rounds that asked for this learner's partial progress (docs/algorithm.md §3.4)."""
        chosen: set[int] = set()
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
                    chosen.add(p)
        chosen = self.unit.share_set(chosen, len(self.fs.counters))  # every rank counts the same sends
        for p in sorted(chosen):
            if self.comm is None:
                self.fs.mark_sent(p)
                continue
            contribution = self.fs.take_contribution(p, self.terms.codec, self.terms.error_feedback)
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
        shards = self.handshake.shards if self.handshake is not None else None
        if self.comm is None or shards is None:
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
        shards.close()
        if self.client is not None:
            self.client.close()  # a shard's client too, unless the answer did not tell which shard it is
