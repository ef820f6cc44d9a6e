"""How far a run has to go: the time left to the first of its budgets, and durations as people read them."""

from __future__ import annotations

import math
from collections.abc import Iterable


def time_left(budgets: Iterable[tuple[float, float, float]]) -> float | None:
    """Seconds until the first budget is spent. Each budget is (done, total, rate per second); one not yet
    moving (rate 0) says nothing. None when no budget says anything."""
    left = [
        max(0.0, total - done) / rate for done, total, rate in budgets if rate > 0 and math.isfinite(total)
    ]
    return min(left) if left else None


def describe_duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``42s`` (``?`` when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    hours, rest = divmod(s, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
