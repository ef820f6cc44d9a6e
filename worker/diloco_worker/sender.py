"""The sending side of a learner's communication: one queue per fragment, a sender thread per
synchronizer shard (``Communicator`` starts them), retries with backoff, and the resends of what the
synchronizer only buffered (module ``comms``)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from .fragment_state import Outgoing
from .pacing import TokenBucket, backoff_delay
from .sync_client import ShardClients, SyncClient, SyncRejected, SyncUnavailable

log = logging.getLogger("diloco_worker.comms")
BUFFERED_RESEND_S = 5.0  # how often a contribution the synchronizer only buffered is sent again


def _due(fragments: list[int], retry_at: dict[int, float]) -> list[int]:
    """The fragments whose next send may go now (none of them is waiting out a backoff)."""
    now = time.monotonic()
    return [p for p in fragments if retry_at.get(p, 0.0) <= now]


def _wait_s(fragments: list[int], retry_at: dict[int, float]) -> float:
    """How long the send loop sleeps: until the first backoff ends, at most half a second."""
    now = time.monotonic()
    return min([0.5, *(max(0.0, retry_at.get(p, 0.0) - now) for p in fragments)])


class Sender:
    """The outer gradients waiting to be sent (``slots``, per fragment, oldest first), being sent
    (``inflight``) and answered as only buffered; ``known_version(p)``: the newest global version of
    ``p`` the learner has, ``resync(p)``: fetch ``p`` again, ``step()``: the learner's step (for logs)."""

    def __init__(
        self,
        shards: ShardClients,
        codec: str,
        bandwidth_limit: float,
        stop: threading.Event,
        *,
        known_version: Callable[[int], int],
        resync: Callable[[int], None],
        step: Callable[[], int],
    ) -> None:
        self.shards, self.codec, self.stop = shards, codec, stop
        self._known_version, self._resync, self._step = known_version, resync, step
        self.bytes_sent = 0
        self.sent = self.rejected = 0
        self.slots: dict[int, list[Outgoing]] = {}  # per fragment, oldest first
        self.inflight: dict[int, Outgoing] = {}  # per fragment, the outer gradient being sent
        self._buffered: dict[int, list[tuple[float, Outgoing]]] = {}  # answered not durable: (resend at, c)
        self._cv = threading.Condition()
        self._bucket = TokenBucket(bandwidth_limit)
        self._bucket_lock = threading.Lock()  # the bandwidth limit is the learner's, shared by the senders
        self._rng = random.Random()

    def submit(self, c: Outgoing) -> None:
        with self._cv:
            self.slots.setdefault(c.fragment, []).append(c)
            self._cv.notify_all()

    def pending(self, p: int) -> bool:
        """True while an outer gradient of fragment ``p`` waits to be sent or is being sent."""
        with self._cv:
            return p in self.slots or p in self.inflight

    def flush(self, timeout_s: float) -> bool:
        """Wait until the pending contributions are sent (or given up); True when nothing is left."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while (self.slots or self.inflight) and time.monotonic() < deadline:
                self._cv.wait(timeout=0.05)
            return not self.slots and not self.inflight

    def unacknowledged(self) -> list[Outgoing]:
        """The contributions the synchronizer has not durably taken, per fragment in sequence order:
        waiting, being sent, or answered as only buffered (but for those a newer version of their
        fragment superseded, which are not sent again)."""
        with self._cv:
            held = [c for waiting in self.slots.values() for c in waiting]
            held += self.inflight.values()
            held += [
                c
                for p, kept in self._buffered.items()
                for _, c in kept
                if c.base_version >= self._known_version(p)
            ]
        # one answered as only buffered is in ``_buffered`` before it leaves ``inflight``
        unique = {(c.fragment, c.seq): c for c in held}
        return [unique[k] for k in sorted(unique)]

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _mine(self, shard: int) -> list[int]:
        """The filled slots of the fragments ``shard`` owns (call with ``_cv`` held)."""
        return [p for p in self.slots if self.shards.routes.owner(p) == shard]

    def send_loop(self, shard: int) -> None:
        """Send the outer gradients of ``shard``'s fragments, oldest first. A fragment whose send
        failed is retried after its own backoff, before anything newer of it, while the others' go
        on: one fragment waiting for room at the synchronizer (``pending_full``) does not hold back
        another's first part, which its round may need. An unexpected failure of a send is logged and
        retried the same way: the thread lives as long as the learner, and drops nothing."""
        client = self.shards.shard(shard)
        attempts: dict[int, int] = {}  # per fragment, failed sends in a row
        retry_at: dict[int, float] = {}  # per fragment, when its next send may go
        while not self.stop.is_set():
            with self._cv:
                while not (due := _due(self._mine(shard), retry_at)) and not self.stop.is_set():
                    self._cv.wait(timeout=_wait_s(self._mine(shard), retry_at))
                    self._requeue_buffered(shard)
                if self.stop.is_set() and not self._mine(shard):
                    return
                if not due:
                    continue
                p = min(due, key=lambda k: self.slots[k][0].seq)
                c = self.slots[p].pop(0)
                if not self.slots[p]:
                    del self.slots[p]
                self.inflight[p] = c
            ok = False
            try:
                ok = self._send_one(client, c)
            except Exception:
                log.exception(
                    "step=%d fragment=%d version=%d send failed unexpectedly, will retry",
                    self._step(),
                    c.fragment,
                    c.base_version,
                )
            finally:
                with self._cv:
                    self.inflight.pop(p, None)
                    if ok:
                        attempts.pop(p, None)
                        retry_at.pop(p, None)
                    else:
                        self.slots.setdefault(c.fragment, []).insert(0, c)  # retried before anything newer
                        attempts[p] = attempts.get(p, 0) + 1
                        retry_at[p] = time.monotonic() + backoff_delay(attempts[p], self._rng)
                    self._cv.notify_all()

    def _requeue_buffered(self, shard: int) -> None:
        """Queue again the buffered contributions of ``shard``'s fragments that are due for a resend
        (in sequence order, before anything newer), dropping those a newer version superseded (call
        with ``_cv`` held)."""
        now = time.monotonic()
        for p in [p for p in self._buffered if self.shards.routes.owner(p) == shard]:
            known = self._known_version(p)
            due = [c for at, c in self._buffered[p] if at <= now and c.base_version >= known]
            self._buffered[p] = [
                (at, c) for at, c in self._buffered[p] if at > now and c.base_version >= known
            ]
            if not self._buffered[p]:
                del self._buffered[p]
            if due:
                self.slots[p] = sorted([*due, *self.slots.get(p, [])], key=lambda c: c.seq)

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
            slot = [*earlier, c, *self.slots.get(c.fragment, [])]
            self.slots[c.fragment] = sorted(slot, key=lambda x: x.seq)
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
        payload = c.encode(self.codec)
        with self._bucket_lock:
            delay = self._bucket.delay_for(len(payload))
        self.stop.wait(delay)
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
                self._step(),
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
                    self._step(),
                    c.fragment,
                    c.base_version,
                    exc.reason,
                )
                return False
            if exc.code == "out_of_order" and self._resend_earlier_first(c):
                log.info(
                    "step=%d fragment=%d version=%d the synchronizer holds none of the earlier buffered "
                    "parts: sending them first (%s)",
                    self._step(),
                    c.fragment,
                    c.base_version,
                    exc,
                )
                return True
            with self._cv:
                self.rejected += 1
            log.warning(
                "step=%d fragment=%d version=%d contribution refused (%s); resynchronising",
                self._step(),
                c.fragment,
                c.base_version,
                exc,
            )
            self._resync(c.fragment)
            return True
        with self._cv:
            self.bytes_sent += len(payload)
            self.sent += 1
        log.info(
            "step=%d fragment=%d version=%d sent %d bytes (%d inner steps) in %.2fs: %s (pending %d)",
            self._step(),
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
