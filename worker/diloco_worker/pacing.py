"""Pacing of a learner's requests: backoff with jitter between retries, and the bandwidth limit."""

from __future__ import annotations

import random
import time
from collections.abc import Callable


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
