"""The storage layout: object keys, and the pending-contribution objects and their refusals."""

from __future__ import annotations

import pytest
from diloco_core.layout import (
    PENDING_HEAD_SIZE,
    Layout,
    LayoutError,
    PendingMeta,
    contribution_key,
    pack_pending,
    pending_head,
    unpack_pending,
    version_of_key,
)


def test_pending_objects_round_trip_and_reject_garbage() -> None:
    meta = PendingMeta(
        learner_id="l-1", fragment=2, base_version=7, seq=3, steps=4, tokens=99, received_at=1.5
    )
    assert unpack_pending(pack_pending(meta, b"payload")) == (meta, b"payload")
    with pytest.raises(LayoutError, match="not a pending"):
        unpack_pending(b"XXXX\x00\x00\x00\x00")
    with pytest.raises(LayoutError, match="truncated"):
        unpack_pending(pack_pending(meta, b"")[:12])


def test_a_pending_object_written_before_its_metadata_reads_as_any_other_once_filled_in() -> None:
    longest = PendingMeta(
        learner_id="l" * 128, fragment=2**63 - 1, base_version=2**63 - 1, seq=2**63 - 1, steps=2**63 - 1,
        tokens=2**63 - 1, received_at=-1.2345678901234567e-300, since=2**63 - 1,
    )  # fmt: skip
    for meta in (
        longest,
        PendingMeta(learner_id="a", fragment=0, base_version=0, seq=0, steps=1, tokens=0, received_at=0.0),
    ):
        placeholder = pending_head(None)
        assert len(placeholder) == len(pending_head(meta)) == PENDING_HEAD_SIZE
        with pytest.raises(LayoutError, match="metadata"):
            unpack_pending(placeholder + b"payload")  # not filled in: never read as a contribution
        assert unpack_pending(pending_head(meta) + b"payload") == (meta, b"payload")
    with pytest.raises(LayoutError, match="exceeds"):
        pending_head(longest, room=100)


def test_layout_keys_and_versions() -> None:
    layout = Layout(1)
    assert layout.params(3, 12) == "shard-001/fragments/3/params-0000000012.bin"
    assert version_of_key(layout.params(3, 12)) == 12
    assert version_of_key(layout.outer(0, 5)) == 5
    assert version_of_key("shard-001/fragments/3/.tmp-x") is None
    assert layout.pending(1, "a", 2, 3) == "shard-001/pending/1/a/2-3.bin"
    assert contribution_key("a", 1, 2, 3) == "a/1/2/3"
