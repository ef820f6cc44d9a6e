"""The storage prefix's owner: the marker's decisions, its refusals and how they are found again."""

from __future__ import annotations

import pytest
from diloco_core.ownership import (
    CONFLICT,
    JobMarker,
    MarkerUnreadable,
    claim_decision,
    conflict_message,
    encode_marker,
    find_conflict,
    new_marker,
    parse_marker,
)

WHERE = "s3://bucket/jobs/job.json"
MINE = new_marker("team-a/llm", "llm", 1_700_000_000.0)


@pytest.mark.parametrize(
    ("existing", "owner", "decision"),
    [
        (None, "team-a/llm", "claim"),
        (MINE, "team-a/llm", "owned"),
        (MINE, "team-b/llm", "refuse"),  # the same job name in another namespace is another job
        (new_marker("llm", "llm", 0.0), "team-a/llm", "refuse"),
    ],
)
def test_claim_decision(existing: JobMarker | None, owner: str, decision: str) -> None:
    assert claim_decision(existing, owner) == decision


def test_marker_round_trips_as_json() -> None:
    raw = encode_marker(MINE)
    assert raw.startswith(b"{")
    assert parse_marker(raw, WHERE) == MINE


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"\x80\x04garbage", "not a job marker"),
        (b"{}", "not a job marker"),
        (b'{"owner": "a", "job_id": "a", "claimed_at": 1, "extra": 2}', "not a job marker"),
        (b'{"format": 2, "owner": "a", "job_id": "a", "claimed_at": 1}', "format 2, newer"),
    ],
)
def test_an_unreadable_marker_is_a_clear_error(raw: bytes, problem: str) -> None:
    with pytest.raises(MarkerUnreadable) as err:
        parse_marker(raw, WHERE)
    message = str(err.value)
    assert WHERE in message
    assert problem in message
    assert "delete it if no other job uses this storage prefix" in message


def test_conflict_message_names_the_owner_and_the_way_out() -> None:
    message = conflict_message(MINE, "team-b/llm", WHERE)
    assert message.startswith(CONFLICT)
    assert "'team-a/llm'" in message
    assert "'team-b/llm'" in message
    assert "2023-11-14T22:13:20+00:00" in message  # when it was claimed
    assert "give this job its own storage prefix" in message
    assert f"delete {WHERE}" in message


def test_find_conflict_in_a_log_tail() -> None:
    message = conflict_message(MINE, "team-b/llm", WHERE)
    tail = f"INFO starting\nERROR cannot start: {message}\nINFO shutting down\ndiloco synchronizer: cannot start: {message}\n"
    assert find_conflict(tail) == message
    assert find_conflict("INFO starting\nERROR storage unavailable\n") is None
    assert find_conflict("") is None
