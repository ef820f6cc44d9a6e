"""The round runner in process, on a fake clock: quorum, grace deadline, merge and commit, and a
failed round that leaves its fragment as it was."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from diloco_sync import round_loop
from diloco_sync.persistence import StateStore
from diloco_sync.round_memory import may_start, round_cost
from diloco_sync.service import RoundOpen

from tests.synchronizer.inprocess import PLAN, InProcess, in_process


async def settled(sync: InProcess, p: int = 0) -> None:
    """Wait (in real time, briefly) until the merge task of fragment ``p`` has finished."""
    fs = sync.service.fragments.get(p)
    for _ in range(500):
        if not fs.busy:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"fragment {p} is still {fs.phase}")


async def gone(sync: InProcess) -> list[str]:
    """The pending objects once the background deletes have run."""
    for _ in range(200):
        if not sync.pending_objects():
            break
        await asyncio.sleep(0.01)
    return sync.pending_objects()


def test_a_round_waits_for_the_quorum_then_the_grace_window_then_merges(tmp_path: Path) -> None:
    sync = in_process(tmp_path, quorum=2, grace_gamma=0.5, grace_cap_steps=1.0)

    async def scenario() -> None:
        await sync.start("abc", step_time_s=1.0)
        clock, runner, fs = sync.clock, sync.runner, sync.service.fragments.get(0)
        opened = clock.now
        assert await sync.contribute("a") == "accepted"
        assert runner.tick() == pytest.approx(clock.now + runner.tick_s)  # below the quorum: no deadline
        clock.advance(0.2)
        assert await sync.contribute("b") == "accepted"
        # quorum after 0.2 s: grace = 0.5 * (overlap 1 x step 1.0 - 0.2 - sync 0) = 0.4
        assert runner.tick() == pytest.approx(clock.now + 0.4)
        announced = await sync.service.fetch("c", 0, 0, 0.0, announce_rounds=True)
        assert announced == RoundOpen(0, pytest.approx(0.4))
        clock.advance(0.3)
        runner.tick()
        assert fs.phase == "open"  # still inside the grace window
        clock.advance(0.1)
        runner.tick()
        assert fs.phase == "merging"
        assert await fs.wait_newer(0, 5.0) == "version"
        await settled(sync)
        assert (fs.version, fs.rounds, fs.phase, fs.pending) == (1, 1, "open", {})
        record = sync.service.recent_rounds[-1]
        assert record.participants == ["a", "b"]
        assert (record.quorum_wait_s, record.grace_s) == (pytest.approx(0.2), pytest.approx(0.4))
        assert fs.state.outer.steps == 1
        assert await gone(sync) == []  # merged: the stored copies are deleted
        assert clock.now - opened == pytest.approx(0.6)

    asyncio.run(scenario())
    manifest = StateStore(sync.service.store.store, 0, "in-process").load_manifest()
    assert manifest is not None
    assert manifest.fragments[0].version == 1


def test_a_round_merges_at_once_when_every_alive_learner_is_in(tmp_path: Path) -> None:
    sync = in_process(tmp_path, quorum=1)

    async def scenario() -> None:
        await sync.start("ab", step_time_s=10.0)
        fs = sync.service.fragments.get(0)
        await sync.contribute("a")
        deadline = sync.runner.tick()
        assert deadline == pytest.approx(sync.clock.now + 5.0)  # K = 1 reached: a grace window
        assert fs.phase == "open"
        await sync.contribute("b")
        sync.runner.tick()  # both alive learners are in: no reason to wait
        assert fs.phase == "merging"
        await fs.wait_newer(0, 5.0)
        await settled(sync)
        assert sync.service.recent_rounds[-1].participants == ["a", "b"]

    asyncio.run(scenario())


def test_a_round_whose_only_contribution_cannot_merge_excludes_it_and_leaves_the_fragment_as_it_was(
    tmp_path: Path,
) -> None:
    sync = in_process(tmp_path, quorum=1, delayed_nesterov=2)

    async def scenario() -> None:
        await sync.start("a")
        fs = sync.service.fragments.get(0)
        await sync.contribute("a", seq=1)
        sync.runner.tick()
        await fs.wait_newer(0, 5.0)
        await settled(sync)
        version, params, outer = fs.version, fs.state.params, fs.state.outer
        assert outer.steps == 1
        # tokens beyond what a learner may report (the route refuses them; the desk is called directly
        # here): the round cannot compute the weight, so the contribution is excluded, not the round failed
        await sync.contribute("a", base=1, seq=2, tokens=10**200)
        assert len(sync.pending_objects()) == 1
        sync.runner.tick()
        assert fs.phase == "merging"
        await settled(sync)
        assert (fs.version, fs.state.params, fs.state.outer, fs.rounds, fs.pending, fs.checked.excluded) == (
            version,
            params,
            outer,
            1,
            {},
            1,
        )
        assert await sync.contribute("a", base=1, seq=2) == "duplicate"  # it was answered; it is done with
        for _ in range(200):  # its stored copy is deleted in the background: a restart does not replay it
            if not sync.pending_objects():
                break
            await asyncio.sleep(0.01)
        assert sync.pending_objects() == []
        assert len(sync.service.recent_rounds) == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(("budget_rounds", "together"), [(0, False), (1, False), (2, True)])
def test_rounds_start_together_while_what_they_hold_fits_the_round_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget_rounds: int, together: bool
) -> None:
    """Both fragments ready at one tick, with room for none, one or two rounds: with room for one,
    the second fragment's mathematics starts only after the first's commit (with none, too: a round
    starts whenever no other is in progress); with room for two, both merge before either commits.
    (The mathematics is slowed by a pause so that a second round would start during it if it may.)"""
    cost = max(round_cost(f.numel) for f in PLAN.fragments)
    sync = in_process(tmp_path, quorum=1, service={"round_memory_bytes": budget_rounds * cost})
    events: list[tuple[str, int]] = []
    run_round, write = round_loop.run_round, sync.runner.committer.write

    def slow_round(spec: Any, *args: Any) -> Any:
        events.append(("merge", spec.index))
        time.sleep(0.3)
        return run_round(spec, *args)

    async def recorded_write(fs: Any, *args: Any) -> Any:
        entry = await write(fs, *args)
        events.append(("commit", fs.index))
        return entry

    monkeypatch.setattr(round_loop, "run_round", slow_round)
    monkeypatch.setattr(sync.runner.committer, "write", recorded_write)

    async def scenario() -> None:
        await sync.start("a")  # its contributions make every round: both merge at the next tick
        for p in (0, 1):
            assert await sync.contribute("a", p) == "accepted"
        sync.runner.tick()
        for p in (0, 1):
            await settled(sync, p)

    asyncio.run(scenario())
    assert sync.service.versions() == {0: 1, 1: 1}
    assert sync.runner.memory.held == 0
    kinds = [kind for kind, _ in events]
    if together:
        assert kinds == ["merge", "merge", "commit", "commit"]
    else:
        assert kinds == ["merge", "commit", "merge", "commit"]
        assert events[0][1] == events[1][1] != events[2][1] == events[3][1]


def test_a_round_may_start_when_none_holds_memory_or_when_it_fits() -> None:
    assert may_start(held=0, cost=10, budget=0)  # however large: nothing else is in progress
    assert may_start(held=5, cost=5, budget=10)
    assert not may_start(held=6, cost=5, budget=10)
    assert round_cost(1000) == 6 * 4 * 1000
    assert round_cost(1000, read_back=True) == 10 * 4 * 1000  # and the state it reads back
