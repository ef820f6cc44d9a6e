"""The pure answers of start-up: why /readyz is not ready, and the /v1 answer while loading."""

from __future__ import annotations

import pytest
from diloco_sync.startup import RETRY_AFTER_S, not_ready_reason, starting_error


@pytest.mark.parametrize(
    ("loaded", "failure", "storage_ok", "storage_error", "reason"),
    [
        (True, None, True, None, None),
        (True, None, False, "connection refused", "storage unavailable (connection refused)"),
        (False, None, True, None, "loading state"),
        (False, None, False, "connection refused", "loading state: storage unavailable (connection refused)"),
        (False, None, False, None, "loading state: storage unavailable"),
        (False, "wrong credentials", True, None, "start-up failed: wrong credentials"),
    ],
)
def test_not_ready_reason(
    loaded: bool, failure: str | None, storage_ok: bool, storage_error: str | None, reason: str | None
) -> None:
    assert not_ready_reason(loaded, failure, storage_ok, storage_error) == reason


def test_starting_error_is_a_retryable_503_with_retry_after() -> None:
    error = starting_error(not_ready_reason(False, None, False, "connection refused"))
    assert error.status == 503
    assert error.body.code == "starting"
    assert error.body.retryable is True
    assert "loading state: storage unavailable (connection refused)" in error.body.reason
    assert error.headers == {"Retry-After": str(RETRY_AFTER_S)}
