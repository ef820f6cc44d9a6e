"""Storage retries back off by doubling up to a cap."""

from __future__ import annotations

from diloco_sync.storage_guard import backoff_delays


def test_backoff_doubles_up_to_the_cap() -> None:
    assert backoff_delays(0.1, 1.0) == [0.1, 0.2, 0.4, 0.8, 1.0]
