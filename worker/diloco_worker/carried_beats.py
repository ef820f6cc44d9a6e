"""Heartbeats carried by requests a learner sends anyway: its contributions (answered at once, unlike
a long-poll) carry the heartbeat (``X-DiLoCo-Heartbeat``, about 270 bytes) once half an interval has
passed since the last one recorded or sent, and the heartbeat thread sends a request of its own
(about 560 bytes, and its answer) only when none was recorded for a whole interval and none was
sent for half of one. A learner that contributes often so sends one request less per interval; an
idle one, or one whose synchronizer ignores the header, still sends its heartbeat every interval.
Two heartbeats are never sent less than half an interval apart: the synchronizer holds a reported
step time to the pace between a learner's heartbeats, which two close together would misjudge."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping

from diloco_core import protocol as proto


class CarriedBeats:
    """When one connection last had a heartbeat recorded, and what it carries; shared by threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._last_at = -math.inf  # the newest heartbeat recorded (sent at)
        self._sent_at = -math.inf  # the newest sent, carried or not, recorded or not yet answered
        self._make: Callable[[], proto.Heartbeat] | None = None
        self._every_s = math.inf

    def carry(self, make: Callable[[], proto.Heartbeat], every_s: float) -> None:
        """Requests carry ``make()`` from now on, once ``every_s / 2`` has passed since the last beat."""
        with self._lock:
            self._make, self._every_s = make, every_s

    def header(self, now: float) -> dict[str, str]:
        """The header a request sent at ``now`` carries (none while a beat is recent or nothing is set)."""
        with self._lock:
            due = now - max(self._last_at, self._sent_at) >= self._every_s / 2
            make = self._make if due else None
            if make is not None:
                self._sent_at = now
        if make is None:
            return {}
        return {proto.HEARTBEAT_HEADER: make().model_dump_json(exclude_defaults=True)}

    def answered(self, sent_at: float, headers: Mapping[str, str]) -> None:
        """A request sent at ``sent_at`` was answered: a beat if the answer says its heartbeat was recorded."""
        if headers.get(proto.HEARTBEAT_RECORDED_HEADER) == "1":
            self.beat(sent_at)

    def sending(self, at: float) -> None:
        """A heartbeat request of its own is being sent at ``at``."""
        with self._lock:
            self._sent_at = max(self._sent_at, at)

    def beat(self, at: float) -> None:
        """A heartbeat sent at ``at`` was recorded."""
        with self._lock:
            self._last_at = max(self._last_at, at)

    def due_in(self, every_s: float) -> float:
        """Seconds until this connection owes the synchronizer a heartbeat of its own (<= 0: now):
        a whole interval after the last recorded, and half of one after the last sent."""
        with self._lock:
            return max(self._last_at + every_s, self._sent_at + every_s / 2) - self.clock()
