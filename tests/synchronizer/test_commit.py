"""What a commit keeps: idempotency keys that could still be resent."""

from __future__ import annotations

from diloco_sync.commit import applied_to_keep


def test_applied_keys_forget_what_would_be_stale_anyway() -> None:
    keys = ["a/0/1/0", "a/0/5/1", "b/0/6/0", "c/0/3/9"]
    assert applied_to_keep(keys, version=7, max_staleness=2) == ["a/0/5/1", "b/0/6/0"]
