"""The receiving side of a learner's communication: a long-poll thread per fragment
(``Communicator`` starts them) that fetches each new global version, whole or as the update to the
copy held, into an arrivals slot the training loop drains, and hears of open rounds (module ``comms``)."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

import numpy as np
from diloco_core import downlink
from diloco_core.codec import CodecError, Payload, decode
from diloco_core.fragments import FragmentPlan

from .pacing import backoff_delay
from .sync_client import RoundOpen, ShardClients, SyncClient, SyncRejected, SyncUnavailable

if TYPE_CHECKING:
    from .comms import CommSettings

log = logging.getLogger("diloco_worker.comms")
# per fragment, a global version held exactly and its values (the base of the next version's update)
Held = dict[int, tuple[int, dict[str, np.ndarray]]]


class Poller:
    """The global versions waiting for the training loop (``take_arrivals``), the newest delivered
    per fragment, the versions held for updates and the rounds that asked for this learner."""

    def __init__(
        self,
        shards: ShardClients,
        plan: FragmentPlan,
        settings: CommSettings,
        stop: threading.Event,
        *,
        versions: dict[int, int],
        stage: Callable[[int, dict[str, np.ndarray]], Mapping[str, np.ndarray]],
        held: Held | None,
    ) -> None:
        self.shards, self.plan, self.settings, self.stop = shards, plan, settings, stop
        self.updates = 0  # global versions that came as updates to the copy held (compressed downloads)
        self._stage = stage
        self._arrivals: dict[int, tuple[int, Mapping[str, np.ndarray]]] = {}
        self._known = dict(versions)  # newest version each poller has delivered
        # with hold_versions: per fragment, the newest version held exactly and its values
        self._held: Held = dict(held or {}) if settings.hold_versions else {}
        self._resync: set[int] = set()
        self._requests: dict[int, int] = {}  # fragment → version of a round asking for this learner
        self._announced: dict[int, int] = {}  # fragment → version of the last round heard of
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._rng = random.Random()

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

    def known_version(self, p: int) -> int:
        """The newest global version of ``p`` delivered (-1: none, or asked to fetch it again)."""
        with self._lock:
            return self._known.get(p, -1)

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

    def poll_loop(self, p: int) -> None:
        """Fetch fragment ``p``'s new global versions until the learner stops. A failure is logged and
        retried after a backoff: the thread lives as long as the learner."""
        client, attempt = self.shards.owner(p), 0
        while not self.stop.is_set():
            try:
                attempt = self._poll_once(p, client, attempt)
            except Exception:
                attempt += 1
                log.exception("fragment=%d polling failed unexpectedly, will retry", p)
                self.stop.wait(backoff_delay(attempt, self._rng))

    def _poll_once(self, p: int, client: SyncClient, attempt: int) -> int:
        """One long-poll of fragment ``p``, its answer delivered; the failed polls in a row after it."""
        with self._lock:
            known = self._known.get(p, -1)
            announce = self.settings.announce_rounds and known >= 0 and self._announced.get(p) != known
            have = self._held[p][0] if p in self._held else -1
        try:
            got = client.fetch(
                p, newer_than=known, wait_s=self.settings.poll_wait_s, announce_rounds=announce, have=have
            )
        except (SyncUnavailable, SyncRejected) as exc:
            if not self.stop.is_set():
                log.debug("fragment=%d fetch failed: %s", p, exc)
            self.stop.wait(backoff_delay(attempt + 1, self._rng))
            return attempt + 1
        if got is None:
            return 0
        if isinstance(got, RoundOpen):
            self._round_opened(p, got)
            return 0
        try:
            tensors = self._version_from(p, got.version, decode(got.payload, fragment=self.plan.fragments[p]))
        except CodecError as exc:
            log.error("fragment=%d version=%d undecodable global payload: %s", p, got.version, exc)
            self.stop.wait(backoff_delay(3, self._rng))
            return 0
        if tensors is None:  # an update from a version this learner does not hold: take it whole
            return 0
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
        return 0

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
