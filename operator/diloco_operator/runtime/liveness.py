"""Liveness of the DiLoCoJob watch: is the watch still delivering what the API holds?

kopf's health endpoint is served by its own task and says nothing about the watch streams, so a
stream that hangs (a half-open connection) or a watcher that stopped would be reported alive while
no job is reconciled any more. The check here compares the watch with a LIST:

* every event the watch delivers (kopf ``on.event``, cheap) records the job's uid and
  resourceVersion (``WatchState.heard``);
* the liveness probe lists the jobs' metadata and marks a job *due* when the API holds a version of
  it that the watch has not delivered, from the first probe that saw the gap (``lagging``); any event
  the watch then delivers for that job clears it;
* the probe fails when some job has been due for longer than the threshold (``watch_is_alive``).

Why this and not "no event for N seconds": an idle operator (no jobs, or jobs whose status no longer
changes) hears nothing at all, for hours, and is perfectly healthy; with this check nothing is due
then, so it stays live without any periodic write. A watch that died is caught as soon as anything
changes: a job created, edited or deleted (the resync timer also patches the status whenever it
changes). Compared per job rather than by "any event", so one dead stream of several (``--namespace a
--namespace b``) is caught too. No periodic self-touch, no extra RBAC: the LIST needs the ``list``
the watch needs anyway.

A replica paused by kopf peering (a peer with a higher or the same priority is alive) has its
watch closed on purpose; ``paused_by_peers`` tells so from the peering object, and the check is
skipped while it holds.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass
class WatchState:
    """What the watch delivered, and since when the API has been ahead of it, per job uid.

    Written by the event handler (kopf's event loop) and the probe (a worker thread): the lock
    keeps an event that arrives during a probe from being forgotten.
    """

    seen: dict[str, str] = field(default_factory=dict)  # uid -> resourceVersion last delivered
    due: dict[str, float] = field(default_factory=dict)  # uid -> when the probe first saw a newer one
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def heard(self, uid: str, resource_version: str, *, deleted: bool) -> None:
        """The watch delivered an event about ``uid``: it is not behind on that job any more."""
        with self.lock:
            self.due.pop(uid, None)
            if deleted:
                self.seen.pop(uid, None)
            else:
                self.seen[uid] = resource_version

    def compare(self, listed: Mapping[str, str], now: float) -> dict[str, float]:
        """Record what a LIST (uid -> resourceVersion) shows the watch is behind on; returns it."""
        with self.lock:
            self.due = lagging(listed, self.seen, self.due, now)
            return dict(self.due)

    def pause(self) -> None:
        """The watch is closed on purpose (peering): nothing is due from it."""
        with self.lock:
            self.due = {}


def lagging(
    listed: Mapping[str, str], seen: Mapping[str, str], due: Mapping[str, float], now: float
) -> dict[str, float]:
    """The jobs of a LIST (uid -> resourceVersion) whose version the watch has not delivered.

    A job keeps the time it was first found behind until the watch delivers an event for it; jobs
    no longer listed are dropped (deleted: nothing more to deliver about them).
    """
    return {uid: due.get(uid, now) for uid, rv in listed.items() if seen.get(uid) != rv}


def watch_is_alive(due: Mapping[str, float], now: float, threshold: float) -> bool:
    """Alive unless the API has held a version of some job undelivered for longer than ``threshold``."""
    return all(now - since <= threshold for since in due.values())


def paused_by_peers(peering: Mapping[str, Any] | None, priority: int, now: datetime, own_id: str) -> bool:
    """Whether kopf peering keeps this replica paused (its watches closed on purpose).

    kopf pauses a replica while another live peer (any id but its own) has a higher priority or
    the same one. The peering object's status maps peer ids to ``priority``, ``lifetime`` and
    ``lastseen``; a peer is live until ``lastseen + lifetime``. Whether this replica's own entry is
    there or fresh does not matter, as for kopf. A missing peering object: kopf waits for it.
    """
    if peering is None:
        return True
    others = [
        p
        for peer_id, p in (peering.get("status") or {}).items()
        if peer_id != own_id and isinstance(p, Mapping) and _is_live(p, now)
    ]
    return any(int(p.get("priority", 0)) >= priority for p in others)


def _is_live(peer: Mapping[str, Any], now: datetime) -> bool:
    lastseen = peer.get("lastseen")
    if not lastseen:
        return True  # kopf counts a peer that never said when as seen now
    seen = datetime.fromisoformat(str(lastseen).replace("Z", "+00:00"))
    return (now - seen).total_seconds() < int(peer.get("lifetime", 60))
