"""Background communication of one learner: the training thread never waits on the network.

- one queue per fragment: every outer gradient is sent, in order (each carries only the progress
  made since the one before it, so none may be skipped); a sender thread per synchronizer shard
  sends the queues of the fragments that shard owns, and retries failures with exponential backoff
  and jitter; one answered as only buffered (``durable: false``: the synchronizer's storage is
  down) is sent again every ``BUFFERED_RESEND_S`` with the same sequence number until an answer says
  it is durable (a synchronizer that restarted and lost it takes it anew, one that wrote it answers
  ``duplicate``), or until the learner took a newer version of the fragment (which supersedes it);
  a later part refused as ``out_of_order`` (the restarted synchronizer lacks the buffered ones
  before it) sends the buffered parts at once, in order, and itself after them;
- one long-poll thread per fragment, asking the fragment's shard, that fetches new global versions
  into an arrivals slot, which the training loop drains at a step boundary; with
  ``announce_rounds`` it also hears when a round on the learner's version opens, and leaves a
  request the training loop answers (:mod:`.pull`);
- a heartbeat thread per shard reporting progress (step, tokens, step time, blocked time, bytes sent).

So a shard that is down delays only its own fragments' sends and keeps only its own heartbeats failing.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np
from diloco_core import bounds, downlink
from diloco_core import protocol as proto
from diloco_core.codec import CodecError, Payload, decode
from diloco_core.fragments import FragmentPlan

from .fragment_state import Outgoing
from .sync_client import RoundOpen, ShardClients, SyncClient, SyncRejected, SyncUnavailable

log = logging.getLogger("diloco_worker.comms")
# per fragment, a global version held exactly and its values (the base of the next version's update)
Held = dict[int, tuple[int, dict[str, np.ndarray]]]
BUFFERED_RESEND_S = 5.0  # how often a contribution the synchronizer only buffered is sent again


def backoff_delay(attempt: int, rng: random.Random, *, base: float = 0.2, cap: float = 10.0) -> float:
    """Exponential backoff with jitter: uniform in [1/2, 1] times min(cap, base * 2**attempt)."""
    return min(cap, base * 2.0 ** min(attempt, 30)) * (0.5 + 0.5 * rng.random())


class TokenBucket:
    """Limits sent bytes per second (``rate`` ≤ 0: unlimited)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self._clock, self._free_at = rate, clock, clock()

    def delay_for(self, nbytes: int) -> float:
        """Seconds to wait before sending ``nbytes``; books the bandwidth."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.rate
        return start - now + nbytes / self.rate


def _within(seconds: float, high: float) -> float:
    """A measured duration as reported: in [0, high], 0 when it is not a number."""
    return min(max(seconds, 0.0), high) if math.isfinite(seconds) else 0.0


@dataclass
class Progress:
    """What heartbeats report; written by the training loop, read by the heartbeat thread."""

    step: int = 0
    tokens: int = 0
    step_time_s: float = 0.0
    fragment_steps: dict[int, int] = field(default_factory=dict)
    fragment_tokens: dict[int, int] = field(default_factory=dict)
    eval_loss: float | None = None
    blocked_s: float = 0.0
    state: proto.LearnerState = "training"


@dataclass(frozen=True)
class CommSettings:
    quantizer: str = "int4"
    heartbeat_interval_s: float = 2.0
    poll_wait_s: float = 10.0
    bandwidth_limit: float = 0.0
    announce_rounds: bool = False  # ask to hear of rounds this learner should join (partial progress)
    # keep each fragment's newest version in host memory, so that the next one can come as the update
    # from it (the job's ``down_codec``, ``diloco_core.downlink``)
    hold_versions: bool = False


class Communicator:
    def __init__(
        self,
        client: SyncClient | ShardClients,
        plan: FragmentPlan,
        settings: CommSettings,
        *,
        versions: dict[int, int],
        on_unknown_learner: Callable[[int], None] = lambda shard: None,
        stage: Callable[[int, dict[str, np.ndarray]], Mapping[str, np.ndarray]] = lambda p, arrays: arrays,
        held: Held | None = None,
    ) -> None:
        """``client``: one synchronizer, or the clients of every shard; ``on_unknown_learner(shard)``
        is called when a shard no longer knows this learner (it registers again there); ``stage(p,
        arrays)`` prepares a decoded global version in the poller thread (the learner's device copy);
        ``held``: global versions the learner holds exactly, whole as decoded (with ``hold_versions``,
        the next versions of those fragments can come as updates)."""
        self.shards = (
            client if isinstance(client, ShardClients) else ShardClients.single(client, len(plan.fragments))
        )
        self.plan, self.settings = plan, settings
        self.progress = Progress()
        self.bytes_sent = 0
        self.sent = self.rejected = 0
        self.updates = 0  # global versions that came as updates to the copy held (compressed downloads)
        self._on_unknown = on_unknown_learner
        self._stage = stage
        self._slots: dict[int, list[Outgoing]] = {}  # per fragment, oldest first
        self._arrivals: dict[int, tuple[int, Mapping[str, np.ndarray]]] = {}
        self._known = dict(versions)  # newest version each poller has delivered
        # with hold_versions: per fragment, the newest version held exactly and its values
        self._held: Held = dict(held or {}) if settings.hold_versions else {}
        self._resync: set[int] = set()
        self._requests: dict[int, int] = {}  # fragment → version of a round asking for this learner
        self._announced: dict[int, int] = {}  # fragment → version of the last round heard of
        self._inflight: set[int] = set()  # fragments whose outer gradient is being sent
        self._buffered: dict[int, list[tuple[float, Outgoing]]] = {}  # answered not durable: (resend at, c)
        self._cv = threading.Condition()
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._bucket = TokenBucket(settings.bandwidth_limit)
        self._bucket_lock = threading.Lock()  # the bandwidth limit is the learner's, shared by the senders
        self._rng = random.Random()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        targets: list[tuple[str, Callable[[], None]]] = []
        for i in self.shards.indices:
            suffix = f"-{i}" if self.shards.routes.num_shards > 1 else ""
            targets += [
                (f"sender{suffix}", functools.partial(self._send_loop, i)),
                (f"heartbeat{suffix}", functools.partial(self._hb_loop, i)),
            ]
        targets += [
            (f"poll-{f.index}", functools.partial(self._poll_loop, f.index)) for f in self.plan.fragments
        ]
        for name, fn in targets:
            t = threading.Thread(target=fn, name=f"diloco-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    # ---- called by the training thread (never blocks on the network) ----
    def submit(self, c: Outgoing) -> None:
        with self._cv:
            self._slots.setdefault(c.fragment, []).append(c)
            self._cv.notify_all()

    def take_arrivals(self) -> dict[int, tuple[int, Mapping[str, np.ndarray]]]:
        with self._lock:
            out, self._arrivals = self._arrivals, {}
        return out

    def requests(self) -> dict[int, int]:
        """The open rounds that asked for this learner's partial progress (fragment → version); a
        request lasts until it is answered (:meth:`answered`) or a newer version arrives."""
        with self._lock:
            return dict(self._requests)

    def answered(self, p: int) -> None:
        with self._lock:
            self._requests.pop(p, None)

    def pending(self, p: int) -> bool:
        """True while an outer gradient of fragment ``p`` waits to be sent or is being sent."""
        with self._cv:
            return p in self._slots or p in self._inflight

    def wait_for_arrival(self, fragments: Collection[int], timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until a global version of one of ``fragments`` is waiting to be
        taken (blocking sync only); True when one is."""
        with self._arrived:
            return self._arrived.wait_for(lambda: any(p in self._arrivals for p in fragments), timeout_s)

    def resync(self, p: int) -> None:
        """Fetch fragment ``p``'s current global version even if it is not newer than the last seen."""
        with self._lock:
            self._resync.add(p)
            self._known[p] = -1
            self._held.pop(p, None)

    # ---- shutdown ----
    def flush(self, timeout_s: float) -> bool:
        """Wait until the pending contributions are sent (or given up); True when nothing is left."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while (self._slots or self._inflight) and time.monotonic() < deadline:
                self._cv.wait(timeout=0.05)
            return not self._slots and not self._inflight

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()

    # ---- threads ----
    def _mine(self, shard: int) -> list[int]:
        """The filled slots of the fragments ``shard`` owns (call with ``_cv`` held)."""
        return [p for p in self._slots if self.shards.routes.owner(p) == shard]

    def _send_loop(self, shard: int) -> None:
        """Send the outer gradients of ``shard``'s fragments, oldest first."""
        client, attempt = self.shards.shard(shard), 0
        while not self._stop.is_set():
            with self._cv:
                while not self._mine(shard) and not self._stop.is_set():
                    self._cv.wait(timeout=0.5)
                    self._requeue_buffered(shard)
                mine = self._mine(shard)
                if self._stop.is_set() and not mine:
                    return
                p = min(mine, key=lambda k: self._slots[k][0].seq)
                c = self._slots[p].pop(0)
                if not self._slots[p]:
                    del self._slots[p]
                self._inflight.add(p)
            ok = self._send_one(client, c)
            with self._cv:
                self._inflight.discard(p)
                if not ok:
                    self._slots.setdefault(c.fragment, []).insert(0, c)  # retried before anything newer
                self._cv.notify_all()
            attempt = 0 if ok else attempt + 1
            if not ok:
                self._stop.wait(backoff_delay(attempt, self._rng))

    def _requeue_buffered(self, shard: int) -> None:
        """Queue again the buffered contributions of ``shard``'s fragments that are due for a resend
        (in sequence order, before anything newer), dropping those a newer version superseded (call
        with ``_cv`` held)."""
        now = time.monotonic()
        for p in [p for p in self._buffered if self.shards.routes.owner(p) == shard]:
            with self._lock:
                known = self._known.get(p, -1)
            due = [c for at, c in self._buffered[p] if at <= now and c.base_version >= known]
            self._buffered[p] = [
                (at, c) for at, c in self._buffered[p] if at > now and c.base_version >= known
            ]
            if not self._buffered[p]:
                del self._buffered[p]
            if due:
                self._slots[p] = sorted([*due, *self._slots.get(p, [])], key=lambda c: c.seq)

    def _resend_earlier_first(self, c: Outgoing) -> bool:
        """The synchronizer lacks progress before ``c`` (it restarted and lost parts it had only
        buffered): queue this fragment's buffered parts of ``c``'s base for sending now, ``c`` after
        them. False when none is earlier than ``c`` (then nothing here can fill the gap)."""
        with self._cv:
            held = self._buffered.get(c.fragment, [])
            earlier = [b for _, b in held if b.base_version == c.base_version and b.seq < c.seq]
            if not earlier:
                return False
            rest = [(at, b) for at, b in held if all(b is not e for e in earlier)]
            if rest:
                self._buffered[c.fragment] = rest
            else:
                self._buffered.pop(c.fragment, None)
            slot = [*earlier, c, *self._slots.get(c.fragment, [])]
            self._slots[c.fragment] = sorted(slot, key=lambda x: x.seq)
            self._cv.notify_all()
        return True

    def buffered(self, p: int) -> list[int]:
        """The sequence numbers of fragment ``p``'s contributions that the synchronizer only buffered."""
        with self._cv:
            return [c.seq for _, c in self._buffered.get(p, [])]

    def _send_one(self, client: SyncClient, c: Outgoing) -> bool:
        """True when the contribution is done with (accepted or refused for good).

        Its log lines name the learner's step when the send ended (``progress.step``, the newest the
        training thread reported); the step the outer gradient was taken at is on the "queued" line."""
        payload = c.encode(self.settings.quantizer)
        with self._bucket_lock:
            delay = self._bucket.delay_for(len(payload))
        self._stop.wait(delay)
        started = time.monotonic()
        try:
            res = client.contribute(
                c.fragment,
                payload,
                base_version=c.base_version,
                steps=c.steps,
                tokens=c.tokens,
                seq=c.seq,
                since=c.since,
            )
        except SyncUnavailable as exc:
            log.warning(
                "step=%d fragment=%d version=%d send failed, will retry: %s",
                self.progress.step,
                c.fragment,
                c.base_version,
                exc,
            )
            return False
        except SyncRejected as exc:
            if exc.status == 401:  # the token expired or was revoked: its renewal is on its way
                log.warning(
                    "step=%d fragment=%d version=%d the learner token was refused (%s): retrying with "
                    "the renewed one",
                    self.progress.step,
                    c.fragment,
                    c.base_version,
                    exc.reason,
                )
                return False
            if exc.code == "out_of_order" and self._resend_earlier_first(c):
                log.info(
                    "step=%d fragment=%d version=%d the synchronizer holds none of the earlier buffered "
                    "parts: sending them first (%s)",
                    self.progress.step,
                    c.fragment,
                    c.base_version,
                    exc,
                )
                return True
            with self._cv:
                self.rejected += 1
            log.warning(
                "step=%d fragment=%d version=%d contribution refused (%s); resynchronising",
                self.progress.step,
                c.fragment,
                c.base_version,
                exc,
            )
            self.resync(c.fragment)
            return True
        with self._cv:
            self.bytes_sent += len(payload)
            self.sent += 1
        log.info(
            "step=%d fragment=%d version=%d sent %d bytes (%d inner steps) in %.2fs: %s (pending %d)",
            self.progress.step,
            c.fragment,
            c.base_version,
            len(payload),
            c.steps,
            time.monotonic() - started,
            res.status,
            res.pending,
        )
        if not res.durable:  # lost if the synchronizer dies before its storage is back: send it again later
            with self._cv:
                self._buffered.setdefault(c.fragment, []).append((time.monotonic() + BUFFERED_RESEND_S, c))
        return True

    def _poll_loop(self, p: int) -> None:
        client, attempt = self.shards.owner(p), 0
        while not self._stop.is_set():
            with self._lock:
                known = self._known.get(p, -1)
                announce = self.settings.announce_rounds and known >= 0 and self._announced.get(p) != known
                have = self._held[p][0] if p in self._held else -1
            try:
                got = client.fetch(
                    p, newer_than=known, wait_s=self.settings.poll_wait_s, announce_rounds=announce, have=have
                )
                attempt = 0
            except (SyncUnavailable, SyncRejected) as exc:
                if not self._stop.is_set():
                    log.debug("fragment=%d fetch failed: %s", p, exc)
                attempt += 1
                self._stop.wait(backoff_delay(attempt, self._rng))
                continue
            if got is None:
                continue
            if isinstance(got, RoundOpen):
                self._round_opened(p, got)
                continue
            try:
                tensors = self._version_from(
                    p, got.version, decode(got.payload, fragment=self.plan.fragments[p])
                )
            except CodecError as exc:
                log.error("fragment=%d version=%d undecodable global payload: %s", p, got.version, exc)
                self._stop.wait(backoff_delay(attempt + 3, self._rng))
                continue
            if tensors is None:  # an update from a version this learner does not hold: take it whole
                continue
            staged = self._stage(p, tensors)
            with self._lock:
                forced = p in self._resync
                if got.version > self._known.get(p, -1) or forced:
                    self._known[p] = got.version
                    self._resync.discard(p)
                    if self._requests.get(p, got.version) < got.version:
                        del self._requests[p]  # that round is over
                    self._arrivals[p] = (got.version, staged)
                    self._arrived.notify_all()

    def held_versions(self) -> Held:
        """Per fragment, the newest global version held exactly and its values (with ``hold_versions``)."""
        with self._lock:
            return {p: (version, dict(values)) for p, (version, values) in self._held.items()}

    def _version_from(self, p: int, version: int, payload: Payload) -> dict[str, np.ndarray] | None:
        """A new global version's values: the payload's (a whole version), or the learner's copy of
        the previous version plus the payload (an update); None when the update does not fit the
        copy held, which is then dropped so that the next poll asks for the whole version."""
        with self._lock:
            held = self._held.pop(p, None)
        if payload.kind == "update":
            made = None if held is None else downlink.apply_decoded(held[0], held[1], payload)
            if made is None or made[0] != version:
                log.warning("fragment=%d version=%d: update for another version, taking it whole", p, version)
                return None
            tensors: dict[str, np.ndarray] = made[1]
            self.updates += 1
        else:
            tensors = dict(payload.tensors)
        if self.settings.hold_versions:
            with self._lock:
                self._held[p] = (version, tensors)
        return tensors

    def _round_opened(self, p: int, r: RoundOpen) -> None:
        """Leave a request for the training loop; the next polls wait for the version only."""
        with self._lock:
            self._announced[p] = r.version
            if r.version == self._known.get(p, -1):
                self._requests[p] = r.version
        log.debug("fragment=%d round on version %d open (grace left %s s)", p, r.version, r.deadline_s)

    def _hb_loop(self, shard: int) -> None:
        """Keep this learner alive on ``shard`` (each shard has its own learner registry)."""
        client, attempt = self.shards.shard(shard), 0
        while not self._stop.wait(
            self.settings.heartbeat_interval_s if attempt == 0 else backoff_delay(attempt, self._rng)
        ):
            try:
                client.heartbeat(self.heartbeat())
                attempt = 0
            except SyncUnavailable as exc:
                attempt += 1
                log.debug("shard=%d heartbeat failed: %s", shard, exc)
            except SyncRejected as exc:
                attempt += 1
                if exc.status in (401, 404):
                    log.warning("shard=%d does not know this learner (%s); registering again", shard, exc)
                    try:
                        self._on_unknown(shard)
                    except Exception as reg_exc:  # a failed re-registration is retried on the next beat
                        log.warning("re-registration failed: %s", reg_exc)

    def wire_bytes(self) -> tuple[int, int]:
        """Bytes at the socket this learner's connections sent and received so far (every shard's)."""
        return self.shards.home().wire.totals()

    def heartbeat(self) -> proto.Heartbeat:
        """The progress to report, within the bounds the synchronizer accepts (a diverged model's NaN
        loss is not reported: the synchronizer would refuse the whole heartbeat)."""
        p = self.progress
        loss = p.eval_loss
        wire_sent, wire_received = self.wire_bytes()
        return proto.Heartbeat(
            step=min(max(0, p.step), bounds.MAX_STEPS),
            tokens=min(max(0, p.tokens), bounds.MAX_TOKENS),
            step_time_s=_within(p.step_time_s, bounds.MAX_STEP_TIME_S),
            state=p.state,
            fragment_steps={k: min(max(0, v), bounds.MAX_STEPS) for k, v in p.fragment_steps.items()},
            fragment_tokens={k: min(max(0, v), bounds.MAX_TOKENS) for k, v in p.fragment_tokens.items()},
            eval_loss=loss
            if loss is not None and math.isfinite(loss) and abs(loss) <= bounds.MAX_LOSS
            else None,
            bytes_sent=min(self.bytes_sent, bounds.MAX_BYTES),
            wire_sent=min(wire_sent, bounds.MAX_BYTES),
            wire_received=min(wire_received, bounds.MAX_BYTES),
            blocked_s=_within(p.blocked_s, bounds.MAX_SECONDS),
        )
