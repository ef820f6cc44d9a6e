"""Polling with deadlines, so tests wait for conditions instead of sleeping fixed times."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    pass


def wait_for(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.2,
    describe: Callable[[], str] | None = None,
) -> T:
    """Call `probe` until it returns something truthy and return that; raise after `timeout` s.

    Exceptions raised by `probe` count as "not yet" and the last one is reported on timeout.
    `describe` adds the current state to the timeout message.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = probe()
        except Exception as exc:  # the probe's failure is "not ready yet"
            last_error = exc
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            details = f"; last error: {last_error!r}" if last_error else ""
            state = f"; state: {describe()}" if describe else ""
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}{details}{state}")
        time.sleep(interval)
