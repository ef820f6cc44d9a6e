"""The synchronizer's logging: one format for its own and uvicorn's lines, and repeated lines
rate-limited so that a storm (a failing accept loop, thousands of slow clients) cannot fill a disk.

``RepeatLimiter`` lets through the first ``burst`` warnings and errors of each kind (same logger,
level and message template; for a message logged already formatted, its text with every number
taken out) in a window of ``window_s`` seconds and drops the rest; the next record of that kind to
pass says how many were dropped. Kinds are forgotten oldest first beyond ``max_kinds``. Lines below
WARNING (one per round, per registration) are never dropped.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_BURST = 10
LOG_WINDOW_S = 60.0
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")


@dataclass
class _Kind:
    window_start: float
    passed: int = 0
    dropped: int = 0


class RepeatLimiter(logging.Filter):
    """A handler filter; time is each record's own ``created``, so it is a pure function of them."""

    def __init__(self, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S, max_kinds: int = 1024) -> None:
        super().__init__()
        self.burst, self.window_s, self.max_kinds = burst, window_s, max_kinds
        self._kinds: OrderedDict[tuple[str, int, str], _Kind] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        template = str(record.msg) if record.args else _NUMBERS.sub("#", str(record.msg)[:500])
        key = (record.name, record.levelno, template)
        with self._lock:
            kind = self._kinds.get(key)
            if kind is None or record.created - kind.window_start >= self.window_s:
                dropped = kind.dropped if kind is not None else 0
                kind = _Kind(window_start=record.created)
                self._kinds[key] = kind
                while len(self._kinds) > self.max_kinds:
                    self._kinds.popitem(last=False)
            else:
                dropped = 0
            self._kinds.move_to_end(key)
            if kind.passed >= self.burst:
                kind.dropped += 1
                return False
            kind.passed += 1
        if dropped:
            record.msg = f"{record.getMessage()} [{dropped} more like this were not logged in the {self.window_s:.0f}s before]"
            record.args = None
        return True


def configure_logging(level: str) -> None:
    """Log to stderr in one format, every handler behind a ``RepeatLimiter`` (uvicorn's lines too:
    give uvicorn ``log_config=None`` so that its loggers propagate here)."""
    logging.basicConfig(level=level, format=FORMAT)
    limiter = RepeatLimiter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(limiter)
