"""Repeated log lines are rate-limited per kind; the time is each record's own."""

from __future__ import annotations

import logging

from diloco_sync.logs import RepeatLimiter


def _record(
    msg: str, at: float, *args: object, level: int = logging.ERROR, name: str = "asyncio"
) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, msg, args or None, None)
    record.created = at
    return record


def test_a_storm_of_one_kind_passes_a_burst_per_window_then_says_how_many_were_dropped() -> None:
    limiter = RepeatLimiter(burst=3, window_s=10.0)
    passed = [
        limiter.filter(_record("socket.accept() out of system resource", 100.0 + i / 1000))
        for i in range(1000)
    ]
    assert sum(passed) == 3
    later = _record("socket.accept() out of system resource", 111.0)
    assert limiter.filter(later)
    assert "997 more like this were not logged" in later.getMessage()


def test_kinds_are_told_apart_by_template_and_numbers_do_not_make_a_new_kind() -> None:
    limiter = RepeatLimiter(burst=1, window_s=10.0)
    assert limiter.filter(_record("closed connection from %s:%d", 0.0, "10.0.0.1", 5000))
    assert not limiter.filter(_record("closed connection from %s:%d", 0.1, "10.0.0.2", 5001))
    assert limiter.filter(_record("Exception in callback TimerHandle(when=12.5)", 0.2))
    assert not limiter.filter(_record("Exception in callback TimerHandle(when=13.75)", 0.3))
    assert limiter.filter(_record("another message", 0.4))


def test_lines_below_warning_are_never_dropped() -> None:
    limiter = RepeatLimiter(burst=1, window_s=10.0)
    rounds = [
        _record("fragment %d: version %d", i / 10, 0, i, level=logging.INFO, name="x") for i in range(50)
    ]
    assert all(limiter.filter(r) for r in rounds)


def test_the_kinds_remembered_are_bounded() -> None:
    limiter = RepeatLimiter(burst=1, window_s=10.0, max_kinds=4)
    for i in range(100):
        limiter.filter(_record(f"kind {chr(65 + i % 26)}{chr(65 + i // 26)}", 0.0))
    assert len(limiter._kinds) == 4
