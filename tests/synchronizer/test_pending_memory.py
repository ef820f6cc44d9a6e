"""The pending contributions' memory budget: a learner's first contribution to a fragment's round is
always taken, a further part only within the budget (503 ``pending_full`` before its body, retryable),
and the room comes back when a round merges what was held."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from diloco_sync.contribution import Contribution, held_bytes
from diloco_sync.errors import ApiError
from diloco_sync.pending_memory import Arriving, holds, may_take

from tests.synchronizer.helpers import encode_grad, outer_grad
from tests.synchronizer.inprocess import PLAN, in_process


def test_the_first_contribution_is_always_taken_a_further_one_only_within_the_budget() -> None:
    assert may_take(10**12, 10**9, 0, first=True)
    assert may_take(600, 400, 1000, first=False)
    assert not may_take(601, 400, 1000, first=False)


def test_bodies_are_counted_while_received_and_released_when_refused() -> None:
    arriving = Arriving()
    with arriving.hold("a", 0, 100):
        with arriving.hold("a", 0, 50):
            assert (arriving.bytes, arriving.has("a", 0), arriving.has("a", 1)) == (150, True, False)
        with pytest.raises(RuntimeError), arriving.hold("b", 1, 7):
            raise RuntimeError("the body was refused")
        assert (arriving.bytes, arriving.has("b", 1)) == (100, False)
    assert (arriving.bytes, arriving.has("a", 0)) == (0, False)


def _grad(learner: str, seq: int) -> bytes:
    return encode_grad(outer_grad(PLAN, 0, seed=ord(learner) + 100 * seq), 0, 0)


def test_a_further_part_beyond_the_budget_waits_for_the_round_and_loses_nothing(tmp_path: Path) -> None:
    """A budget smaller than one part: each learner's first part is taken (so the round reaches its
    quorum of two), learner a's next part is refused before anything of it is stored and taken once
    the round has merged the first; what the contributions hold is what the desk reports."""
    sync = in_process(tmp_path, quorum=2, service={"pending_memory_bytes": 1})

    async def scenario() -> None:
        await sync.start("ab")
        fs = sync.service.fragments.get(0)
        first = await sync.send("a", 0, _grad("a", 1), base_version=0, steps=4, tokens=32, seq=1)
        assert first.status == "accepted"
        stored = sync.pending_objects()
        with pytest.raises(ApiError) as refused:
            await sync.send("a", 0, _grad("a", 2), base_version=0, steps=4, tokens=32, seq=2, since=4)
        assert (refused.value.status, refused.value.code) == (503, "pending_full")
        assert refused.value.body.retryable
        assert refused.value.headers == {"Retry-After": "1"}
        assert sync.pending_objects() == stored
        assert fs.pending["a"].through == 4
        again = await sync.send("a", 0, _grad("a", 1), base_version=0, steps=4, tokens=32, seq=1)
        assert again.status == "duplicate"  # a repeat holds nothing: never refused for room
        assert sync.desk.held_bytes() == held_bytes(fs.pending["a"].tensors) > 1
        other = await sync.send("b", 0, _grad("b", 1), base_version=0, steps=4, tokens=32, seq=1)
        assert other.status == "accepted"  # its first: the round's quorum is never kept away
        assert sync.desk.held_bytes() == holds(fs.pending.values())
        sync.runner.tick()
        assert await fs.wait_newer(0, 5.0) == "version"
        assert sync.desk.held_bytes() == 0
        later = await sync.send("a", 0, _grad("a", 2), base_version=0, steps=4, tokens=32, seq=2, since=4)
        assert (later.status, fs.pending["a"].since) == ("accepted", 4)

    asyncio.run(scenario())


def test_within_the_budget_a_further_part_is_folded_into_the_pending_one(tmp_path: Path) -> None:
    sync = in_process(tmp_path, quorum=2)

    async def scenario() -> None:
        await sync.start("a")
        for seq in (1, 2):
            result = await sync.send(
                "a", 0, _grad("a", seq), base_version=0, steps=4, tokens=32, seq=seq, since=4 * (seq - 1)
            )
            assert result.status == "accepted"
        fs = sync.service.fragments.get(0)
        assert (fs.pending["a"].through, len(fs.pending["a"].parts)) == (8, 1)

    asyncio.run(scenario())


def test_a_second_body_of_the_learner_for_the_fragment_is_not_its_first(tmp_path: Path) -> None:
    """While one body of learner a for fragment 0 is being received, another is a further part:
    refused beyond the budget; one for fragment 1 is a first."""
    sync = in_process(tmp_path, service={"pending_memory_bytes": 1})

    async def scenario() -> None:
        await sync.start("a")
        with sync.desk.room("a", 0, 0, 1, 100):
            with pytest.raises(ApiError, match="pending_full"):
                sync.desk.room("a", 0, 0, 2, 100)
            with sync.desk.room("a", 1, 0, 1, 100):
                assert sync.desk.held_bytes() == 200
        assert sync.desk.held_bytes() == 0

    asyncio.run(scenario())


def test_a_part_the_pending_contribution_waits_for_is_taken_whatever_the_budget(tmp_path: Path) -> None:
    """After a restart lost learner a's first part (only buffered in memory), its second waits in
    pending with a gap before it: the resent first part is what lets it into a round, so it is taken
    although the budget is full."""
    sync = in_process(tmp_path, quorum=1, service={"pending_memory_bytes": 1})

    async def scenario() -> None:
        await sync.start("a")
        fs = sync.service.fragments.get(0)
        second = Contribution(
            learner_id="a", fragment=0, base_version=0, seq=2, steps=4, tokens=32, since=4,
            tensors=outer_grad(PLAN, 0, seed=7), nbytes=1, received_at=sync.clock(),
        )  # fmt: skip
        sync.desk.replay([second])
        assert not fs.ready(fs.pending["a"])
        first = await sync.send("a", 0, _grad("a", 1), base_version=0, steps=4, tokens=32, seq=1)
        assert first.status == "accepted"
        assert (fs.pending["a"].since, fs.pending["a"].through) == (0, 8)

    asyncio.run(scenario())
