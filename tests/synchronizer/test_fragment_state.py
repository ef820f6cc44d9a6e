"""The fragment state machine, in process: every transition, the ones a phase refuses, and the news
it gives long-polls. Times are parameters (the transitions take ``now``), so no clock is patched."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from diloco_core.bounds import MAX_STEPS, MAX_TOKENS, MAX_TOKENS_PER_STEP
from diloco_core.outer import OuterState
from diloco_sync.contribution import Contribution, fold_problem
from diloco_sync.fragment_state import FragmentState, TransitionError

from tests.synchronizer.helpers import initial_params, tiny_plan

PLAN = tiny_plan()
QUORUM = 2


def contribution(
    learner: str, at: float, base: int = 0, seq: int = 1, blob: bytes | None = None
) -> Contribution:
    return Contribution(
        learner_id=learner, fragment=0, base_version=base, seq=seq, steps=2, tokens=16, tensors={},
        nbytes=0, received_at=at, blob=blob,
    )  # fmt: skip


def fresh() -> FragmentState:
    return FragmentState(spec=PLAN.fragments[0])


def initialised(now: float = 1.0) -> FragmentState:
    fs = fresh()
    fs.begin_init()
    fs.finish_init(initial_params(PLAN, 0), b"v0", now, QUORUM, digest="0" * 32)
    return fs


def test_initial_parameters_are_taken_once_and_a_failed_init_can_be_retried() -> None:
    fs = fresh()
    assert (fs.phase, fs.version, fs.busy) == ("uninitialised", -1, False)
    fs.begin_init()
    assert (fs.phase, fs.busy) == ("initialising", True)
    with pytest.raises(TransitionError):
        fs.begin_init()  # a second init while the first is written
    fs.abort_init()  # the write failed
    assert (fs.phase, fs.version) == ("uninitialised", -1)
    fs.begin_init()
    fs.finish_init(initial_params(PLAN, 0), b"v0", 5.0, QUORUM, digest="0" * 32)
    assert (fs.phase, fs.version, fs.served.payload_for(-1, -1)) == ("open", 0, (0, b"v0"))
    assert (fs.round.version, fs.round.opened_at) == (0, 5.0)
    with pytest.raises(TransitionError):
        fs.begin_init()


def test_restore_starts_from_the_committed_state() -> None:
    fs = fresh()
    outer = OuterState(steps=3)
    fs.restore(
        version=7, params=initial_params(PLAN, 0), payload=b"v7", outer=outer, applied=["a/0/6/1"],
        rounds=7, now=2.0, quorum=QUORUM,
    )  # fmt: skip
    assert (fs.phase, fs.version, fs.rounds, fs.state.outer) == ("open", 7, 7, outer)
    assert fs.is_known("a/0/6/1")  # merged before the restart: a resend is a duplicate
    with pytest.raises(TransitionError):
        fs.restore(
            version=8, params={}, payload=b"", outer=outer, applied=[], rounds=8, now=3.0, quorum=QUORUM
        )


def test_a_reserved_key_is_known_until_released_and_accepting_queues_the_contribution() -> None:
    fs = initialised()
    c = contribution("a", at=2.0)
    assert fs.reserve(c.key)
    assert not fs.reserve(c.key)  # the same contribution sent twice at once: a duplicate
    fs.accept(c, QUORUM)
    fs.release(c.key)
    assert fs.is_known(c.key)  # pending now
    assert fs.pending == {"a": c}
    assert (fs.round.version, fs.round.opened_at, fs.round.first_quorum_at) == (0, 2.0, None)
    refused = contribution("b", at=2.5)
    assert fs.reserve(refused.key)
    fs.release(refused.key)  # refused (stale, unreadable...): the learner may send it again
    assert not fs.is_known(refused.key)
    fs.accept(contribution("b", at=3.0), QUORUM)
    assert fs.round.first_quorum_at == 3.0


def test_a_newer_contribution_of_a_learner_supersedes_its_pending_one() -> None:
    fs = initialised()
    first, second = contribution("a", at=2.0, seq=1), contribution("a", at=3.0, seq=2)
    assert fs.accept(first, QUORUM) == []
    assert fs.accept(second, QUORUM) == [first]
    assert fs.pending == {"a": second}
    assert fs.is_known(first.key)  # a resend of the superseded one is a duplicate
    assert first.key in fs.applied


def test_excluded_contributions_are_dropped_and_the_round_starts_again_with_the_rest() -> None:
    fs = initialised()
    stale, kept = contribution("a", at=2.0), contribution("b", at=4.0)
    fs.accept(stale, QUORUM)
    fs.accept(kept, QUORUM)
    assert fs.round.first_quorum_at == 4.0
    assert fs.exclude(["a", "nobody"], QUORUM) == {"a": stale}
    assert fs.pending == {"b": kept}
    assert (fs.round.opened_at, fs.round.first_quorum_at) == (4.0, None)  # one left: below the quorum
    assert not fs.is_known(stale.key)


def test_merge_then_commit_publishes_the_version_and_settle_frees_the_fragment() -> None:
    fs = initialised()
    a, b = contribution("a", at=2.0), contribution("b", at=2.5)
    fs.accept(a, QUORUM)
    fs.accept(b, QUORUM)
    assert fs.start_merge(["b", "a"]) == [b, a]
    assert (fs.phase, fs.busy, fs.pending) == ("merging", True, {})
    assert fs.is_known(a.key)
    assert not fs.reserve(b.key)  # a resend while it is merged is a duplicate
    late = contribution("c", at=3.0)
    fs.accept(late, QUORUM)  # arrives during the merge: waits for the next round
    assert not fs.round_open_for("d", 0)  # no round is announced while the fragment is busy
    with pytest.raises(TransitionError):
        fs.start_merge(["c"])
    new_outer = OuterState(steps=2)
    fs.commit(
        version=1,
        params=initial_params(PLAN, 0, seed=1),
        payload=b"v1",
        outer=new_outer,
        now=4.0,
        quorum=QUORUM,
        update=b"u1",
    )
    assert (fs.phase, fs.version, fs.served.payload_for(-1, -1), fs.rounds, fs.state.outer) == (
        "committed",
        1,
        (1, b"v1"),
        1,
        new_outer,
    )
    # compressed downloads: the update only to a reader holding the previous version exactly
    assert (fs.served.payload_for(0, 0), fs.served.payload_for(1, 1), fs.served.payload_for(-1, -1)) == (
        (1, b"u1"), (1, b"v1"), (1, b"v1"),
    )  # fmt: skip
    assert fs.applied[-2:] == (b.key, a.key)
    assert (fs.round.version, fs.round.opened_at) == (1, 3.0)  # the next round holds the late one
    with pytest.raises(TransitionError):
        fs.start_merge(["c"])  # old versions are still being deleted
    fs.settle()
    assert (fs.phase, fs.busy) == ("open", False)
    assert fs.start_merge(["c"]) == [late]


def test_an_aborted_merge_leaves_the_fragment_as_it_was() -> None:
    fs = initialised()
    params, outer = fs.state.params, fs.state.outer
    a = contribution("a", at=2.0)
    fs.accept(a, QUORUM)
    fs.start_merge(["a"])
    assert fs.abort(QUORUM) == [a]
    assert (fs.phase, fs.version, fs.state.params, fs.state.outer, fs.rounds) == ("open", 0, params, outer, 0)
    assert not fs.is_known(a.key)  # never merged: the learner's resend counts
    with pytest.raises(TransitionError):
        fs.abort(QUORUM)


@pytest.mark.parametrize(
    ("phase_of", "transition"),
    [
        (fresh, lambda fs: fs.accept(contribution("a", 1.0), QUORUM)),  # no parameters yet
        (fresh, lambda fs: fs.start_merge([])),
        (fresh, lambda fs: fs.finish_init({}, b"", 0.0, QUORUM, digest="0" * 32)),
        (
            initialised,
            lambda fs: fs.commit(version=1, params={}, payload=b"", outer=OuterState(), now=0.0, quorum=1),
        ),
        (initialised, lambda fs: fs.settle()),
        (initialised, lambda fs: fs.abort(QUORUM)),
        (initialised, lambda fs: fs.abort_init()),
    ],
)
def test_a_phase_refuses_the_transitions_it_does_not_allow(phase_of, transition) -> None:  # type: ignore[no-untyped-def]
    fs = phase_of()
    before = (fs.phase, fs.version)
    with pytest.raises(TransitionError):
        transition(fs)
    assert (fs.phase, fs.version) == before


def test_a_contribution_held_in_memory_becomes_durable_only_while_it_is_pending() -> None:
    fs = initialised()
    held = contribution("a", at=2.0, blob=b"payload")
    fs.accept(held, QUORUM)
    assert fs.mark_durable(held, "pending/a")
    assert (held.storage_key, held.blob) == ("pending/a", None)
    merged = contribution("b", at=2.5, blob=b"payload")
    fs.accept(merged, QUORUM)
    fs.start_merge(["b"])
    assert not fs.mark_durable(merged, "pending/b")  # written too late: that copy is not needed
    assert (merged.storage_key, merged.blob) == (None, b"payload")


def test_long_poll_wakes_on_publish() -> None:
    async def scenario() -> tuple[str | None, str | None]:
        fs = fresh()
        waiter = asyncio.create_task(fs.wait_newer(-1, 10.0))
        await asyncio.sleep(0.01)
        fs.begin_init()
        fs.finish_init({"wte.weight": np.zeros((16, 8), np.float32)}, b"blob", 1.0, QUORUM, digest="0" * 32)
        woke = await waiter
        timed_out = await fs.wait_newer(0, 0.05)
        return woke, timed_out

    assert asyncio.run(scenario()) == ("version", None)


def test_an_opening_round_wakes_the_learners_that_have_not_joined_it() -> None:
    async def scenario() -> tuple[str | None, str | None, str | None, bool]:
        fs = initialised()
        waiter = asyncio.create_task(fs.wait_newer(0, 10.0, round_for="b"))
        await asyncio.sleep(0.01)
        fs.accept(contribution("a", at=1.0), quorum=1)  # the round on version 0 opens
        woke = await waiter
        joined = await fs.wait_newer(0, 0.05, round_for="a")  # a is in the round: nothing to tell it
        not_asked = await fs.wait_newer(0, 0.05)  # a plain long-poll never hears of rounds
        fs.start_merge(["a"])
        return woke, joined, not_asked, fs.round_open_for("b", 0)

    assert asyncio.run(scenario()) == ("round", None, None, False)


def refusal(fs: FragmentState, learner: str, base: int, since: int, through: int, **kwargs: bool) -> str:
    """``fs.refusal(...)`` of the steps ``since < step <= through`` (one token a step) as "code:
    reason", "" when the contribution may be taken."""
    found = fs.refusal(learner, base, since, through - since, through - since, **kwargs)
    return f"{found[1]}: {found[2]}" if found else ""


def progress(
    seq: int, since: int, value: float, *, steps: int = 4, base: int = 0, at: float = 2.0
) -> Contribution:
    """Learner a's progress after step ``since`` on ``base``: ``steps`` steps, every value ``value``."""
    return Contribution(
        learner_id="a", fragment=0, base_version=base, seq=seq, steps=steps, tokens=8 * steps,
        tensors={"w": np.full(2, value, np.float32)}, nbytes=0, received_at=at + seq, since=since,
    )  # fmt: skip


def test_a_continuation_adds_to_the_pending_contribution_and_both_keys_are_known() -> None:
    fs = initialised()
    assert refusal(fs, "a", 0, 0, 4) == ""
    fs.accept(progress(1, 0, 4.0), QUORUM)
    assert refusal(fs, "a", 0, 4, 8) == ""  # continues it
    assert refusal(fs, "a", 0, 2, 6) != ""  # would take steps 3 and 4 twice
    assert refusal(fs, "a", 0, 0, 8) == ""  # covers it: supersedes it
    assert fs.accept(progress(2, 4, 4.0), QUORUM) == []  # nothing superseded: added up
    pending = fs.pending["a"]
    assert (pending.since, pending.steps, pending.tokens, pending.through) == (0, 8, 64, 8)
    np.testing.assert_array_equal(pending.tensors["w"], [8.0, 8.0])
    assert [c.key for c in pending.received()] == ["a/0/0/1", "a/0/0/2"]
    assert fs.is_known("a/0/0/1")
    assert fs.is_known("a/0/0/2")


def test_progress_merged_or_being_merged_is_never_taken_again() -> None:
    fs = initialised()
    fs.accept(progress(1, 0, 4.0), QUORUM)
    fs.start_merge(["a"])
    assert "merged already" in refusal(fs, "a", 0, 0, 8)  # being merged
    assert refusal(fs, "a", 0, 4, 8) == ""
    fs.commit(
        version=1, params=initial_params(PLAN, 0), payload=b"v1", outer=OuterState(), now=3.0, quorum=QUORUM
    )
    fs.settle()
    assert fs.merged_through == {"a": (0, 4)}
    assert "through step 4" in refusal(fs, "a", 0, 0, 8)  # the whole progress from the base again
    assert refusal(fs, "a", 0, 4, 8) == ""  # only what followed: a contribution of its own
    assert refusal(fs, "a", 1, 0, 4) == ""  # a new base starts afresh


def test_a_restarted_fragment_remembers_how_far_each_learner_was_merged() -> None:
    fs = fresh()
    fs.restore(
        version=1, params=initial_params(PLAN, 0), payload=b"v1", outer=OuterState(), applied=["a/0/0/1"],
        rounds=1, now=1.0, quorum=QUORUM, merged_through={"a": (0, 4)},
    )  # fmt: skip
    assert refusal(fs, "a", 0, 0, 4) != ""
    assert refusal(fs, "a", 0, 4, 8) == ""


def test_an_earlier_contribution_resent_after_a_later_one_is_added_to_it() -> None:
    """After a restart lost a buffered contribution (steps 1-4) but kept the next (steps 5-8), the
    learner resends the first: the two are added up, in step order, neither supersedes the other."""
    fs = initialised()
    assert "out_of_order" in refusal(fs, "a", 0, 4, 8)  # a live request must not jump over steps 1-4
    assert refusal(fs, "a", 0, 4, 8, in_order=False) == ""  # read back from storage: it waits for them
    fs.accept(progress(2, 4, 3.0), QUORUM)
    assert not fs.ready(fs.pending["a"])
    assert fs.round.pending == {}  # outside the round until the gap is filled
    assert refusal(fs, "a", 0, 0, 4) == ""
    assert fs.accept(progress(1, 0, 4.0), QUORUM) == []
    assert fs.ready(fs.pending["a"])
    assert set(fs.round.pending) == {"a"}
    pending = fs.pending["a"]
    assert (pending.since, pending.through, pending.steps) == (0, 8, 8)
    np.testing.assert_array_equal(pending.tensors["w"], [7.0, 7.0])
    assert sorted(c.key for c in pending.received()) == ["a/0/0/1", "a/0/0/2"]


def test_a_part_before_the_pending_one_with_a_gap_between_is_not_added_to_it() -> None:
    """A restart kept steps 9-12 (written) and lost 1-8 (buffered): the learner resends 1-4, then
    5-8. 1-4 is taken and merged on its own; 9-12 waits behind the gap until 5-8 fills it, and the
    steps merged are exactly those sent."""
    fs = initialised()
    fs.accept(progress(3, 8, 3.0), QUORUM)  # read back from storage
    assert refusal(fs, "a", 0, 0, 4) == ""
    assert fs.accept(progress(1, 0, 1.0), QUORUM) == []
    head = fs.pending["a"]
    assert (head.since, head.through, head.steps, fs.ready(head)) == (0, 4, 4, True)
    assert [(w.since, w.through) for w in fs.waiting["a"]] == [(8, 12)]
    assert fs.is_known("a/0/0/3")  # a resend of the waiting part is a duplicate
    assert refusal(fs, "a", 0, 6, 10).startswith("overlaps_pending")  # shares steps 9-10 with it
    merged(fs, "a")
    assert fs.merged_through == {"a": (0, 4)}
    waiting = fs.pending["a"]  # the waiting part is the pending one now, still behind its gap
    assert ((waiting.since, waiting.through), fs.ready(waiting), fs.waiting) == ((8, 12), False, {})
    assert refusal(fs, "a", 0, 4, 8) == ""  # the lost steps 5-8 are still taken
    fs.accept(progress(2, 4, 2.0), QUORUM)
    joined = fs.pending["a"]
    assert (joined.since, joined.through, joined.steps, fs.ready(joined)) == (4, 12, 8, True)
    np.testing.assert_array_equal(joined.tensors["w"], [5.0, 5.0])
    merged(fs, "a", version=2)
    assert fs.merged_through == {"a": (0, 12)}


def test_parts_read_back_with_a_gap_between_them_wait_until_it_is_filled() -> None:
    """At start-up storage holds steps 1-4 and 9-12 (5-8 was only buffered): 9-12 is not added to
    1-4; once the learner resends 5-8, all three are one contribution of steps 1-12."""
    fs = initialised()
    for c in (progress(1, 0, 1.0), progress(3, 8, 3.0)):
        assert refusal(fs, "a", 0, c.since, c.through, in_order=False) == ""
        fs.accept(c, QUORUM)
    head = fs.pending["a"]
    assert (head.since, head.through) == (0, 4)
    assert [(w.since, w.through) for w in fs.waiting["a"]] == [(8, 12)]
    fs.accept(progress(2, 4, 2.0), QUORUM)
    whole = fs.pending["a"]
    assert (whole.since, whole.through, whole.steps, fs.waiting) == (0, 12, 12, {})
    np.testing.assert_array_equal(whole.tensors["w"], [6.0, 6.0])
    assert sorted(c.key for c in whole.received()) == ["a/0/0/1", "a/0/0/2", "a/0/0/3"]


def test_a_waiting_part_held_in_memory_becomes_durable_and_is_dropped_when_stale() -> None:
    fs = initialised()
    fs.accept(progress(1, 0, 1.0), QUORUM)
    late = progress(3, 8, 3.0)
    late.blob = b"held"
    fs.accept(late, QUORUM)  # read back out of order: waits behind the pending part
    assert fs.mark_durable(late, "pending/a-3")
    assert (late.storage_key, late.blob) == ("pending/a-3", None)
    merged(fs, "a")  # steps 1-4; 9-12 still waits for 5-8
    rounds_of_b(fs, (2, 3))
    assert [c.key for c in fs.drop_stale_gaps(max_staleness=1)] == ["a/0/0/3"]
    assert (fs.pending, fs.waiting) == ({}, {})


def part(learner: str, seq: int, since: int, *, base: int = 0, at: float = 1.0) -> Contribution:
    return Contribution(
        learner_id=learner, fragment=0, base_version=base, seq=seq, steps=4, tokens=32, tensors={},
        nbytes=0, received_at=at, since=since,
    )  # fmt: skip


@pytest.mark.parametrize("ending", ["reject", "abort"])
def test_a_merge_that_merges_nothing_leaves_the_part_taken_after_it_out_of_the_round(ending: str) -> None:
    """Steps 5-8 taken while steps 1-4 were being merged join the next round as ready; when that merge
    merges nothing (its checks excluded everything) or fails, they have a gap before them again: they
    leave the round, so the next round does not record steps 1-4 as merged."""
    fs = initialised()
    fs.accept(part("a", 1, 0), QUORUM)
    fs.start_merge(["a"])
    assert fs.refusal("a", 0, 4, 4, 32) is None
    fs.accept(part("a", 2, 4), QUORUM)
    assert "a" in fs.round.pending  # ready behind the part being merged
    fs.reject(QUORUM) if ending == "reject" else fs.abort(QUORUM)
    assert not fs.ready(fs.pending["a"])
    assert fs.round.pending == {}


def test_a_part_taken_behind_one_the_checks_excluded_is_not_in_the_next_round() -> None:
    fs = initialised()
    fs.accept(part("a", 1, 0), QUORUM)
    fs.accept(part("b", 1, 0), QUORUM)
    fs.start_merge(["a", "b"])
    fs.accept(part("a", 2, 4), QUORUM)
    fs.commit(
        version=1, params=initial_params(PLAN, 0), payload=b"v1", outer=OuterState(), now=3.0, quorum=QUORUM,
        merged={"b/0/0/1"},
    )  # fmt: skip  # the checks excluded a's steps 1-4
    assert not fs.ready(fs.pending["a"])
    assert fs.round.pending == {}
    fs.settle()
    assert fs.merged_through == {"b": (0, 4)}
    assert fs.refusal("a", 0, 0, 4, 32) is None  # steps 1-4 may be sent again: they join steps 5-8
    fs.accept(part("a", 1, 0, at=4.0), QUORUM)
    whole = fs.pending["a"]
    assert ((whole.since, whole.through), set(fs.round.pending)) == ((0, 8), {"a"})


def test_a_part_on_a_newer_base_with_a_gap_before_it_takes_the_replaced_part_out_of_the_round() -> None:
    """Read back at start-up: steps 1-4 on version 0 (ready, in the round), then steps 5-8 on version
    1 (steps 1-4 on version 1 were lost): the newer part supersedes the older, and the round no
    longer holds the older one's entry."""
    fs = initialised()
    fs.accept(part("b", 1, 0), QUORUM)
    merged(fs, "b")
    older = part("a", 1, 0, base=0)
    fs.accept(older, QUORUM)
    assert fs.round.pending["a"].base_version == 0
    assert fs.refusal("a", 1, 4, 4, 32, in_order=False) is None
    assert fs.accept(part("a", 3, 4, base=1, at=2.0), QUORUM) == [older]
    assert not fs.ready(fs.pending["a"])
    assert fs.round.pending == {}


def test_a_part_on_a_newer_base_supersedes_the_parts_on_the_older_one_waiting_behind_a_gap() -> None:
    fs = initialised()
    head, late = part("a", 1, 0), part("a", 3, 8)
    fs.accept(head, QUORUM)
    fs.accept(late, QUORUM)  # read back: waits behind the gap of steps 5-8
    fs.accept(part("b", 1, 0), QUORUM)
    merged(fs, "b")
    newer = part("a", 4, 0, base=1, at=3.0)
    assert fs.accept(newer, QUORUM) == [head, late]
    assert (fs.pending["a"], fs.waiting) == (newer, {})
    assert fs.is_known(late.key)


def merged(fs: FragmentState, *learners: str, keys: set[str] | None = None, version: int = 1) -> None:
    """Merge the pending contributions of ``learners`` into ``version``; ``keys``: those the checks kept."""
    fs.start_merge(learners)
    fs.commit(
        version=version, params=initial_params(PLAN, 0), payload=b"v", outer=OuterState(), now=3.0,
        quorum=QUORUM, merged=keys,
    )  # fmt: skip
    fs.settle()


def rounds_of_b(fs: FragmentState, versions: tuple[int, ...]) -> None:
    """Learner b's steps 1-4 on each version before ``versions``, merged into it (the fragment moves on)."""
    for version in versions:
        fs.accept(part("b", version, 0, base=version - 1, at=2.0 + version), QUORUM)
        merged(fs, "b", version=version)


def test_progress_on_a_base_older_than_the_newest_merged_one_is_refused() -> None:
    """Merged on base 3, then on base 6: a replay of the base-3 progress is not merged a second time."""
    fs = fresh()
    fs.restore(
        version=6, params=initial_params(PLAN, 0), payload=b"v6", outer=OuterState(), applied=[], rounds=6,
        now=1.0, quorum=QUORUM, merged_through={"a": (3, 4)},
    )  # fmt: skip
    fs.accept(progress(1, 0, 1.0, base=6), QUORUM)
    merged(fs, "a", version=7)
    assert fs.merged_through == {"a": (6, 4)}
    assert refusal(fs, "a", 3, 0, 4).startswith("already_merged: learner a's progress on version 6")
    assert refusal(fs, "a", 3, 4, 8).startswith("already_merged")  # nor any later part of it
    assert refusal(fs, "a", 6, 4, 8) == ""


def test_a_part_is_taken_only_where_the_learners_progress_is_held_through() -> None:
    fs = initialised()
    assert refusal(fs, "a", 0, 10**12, 10**12 + 4).startswith("out_of_order")  # far in the future
    assert "held through step 0" in refusal(fs, "a", 0, 4, 8)
    fs.accept(progress(1, 0, 1.0), QUORUM)
    assert "held through step 4" in refusal(fs, "a", 0, 8, 12)  # would skip steps 5-8
    assert refusal(fs, "a", 0, 4, 8) == ""
    assert refusal(fs, "a", 0, 2, 6).startswith("overlaps_pending")
    merged(fs, "a")
    assert refusal(fs, "a", 0, 0, 4).startswith("already_merged")
    assert "held through step 4" in refusal(fs, "a", 0, 8, 12)
    assert refusal(fs, "a", 0, 4, 8) == ""
    assert refusal(fs, "a", 1, 0, 4) == ""  # a newer base starts at step 0
    assert refusal(fs, "a", 1, 4, 8).startswith("out_of_order")


def test_excluded_progress_is_not_recorded_as_merged_and_its_keys_are_done_with() -> None:
    fs = initialised()
    fs.accept(progress(1, 0, 1.0), QUORUM)
    b = Contribution(
        learner_id="b", fragment=0, base_version=0, seq=1, steps=4, tokens=32, tensors={}, nbytes=0,
        received_at=2.5,
    )  # fmt: skip
    fs.accept(b, QUORUM)
    merged(fs, "a", "b", keys={"b/0/0/1"})  # the checks left a out
    assert fs.merged_through == {"b": (0, 4)}
    assert fs.is_known("a/0/0/1")  # a resend of it is a duplicate
    assert refusal(fs, "a", 0, 0, 4) == ""  # its steps were never merged


def test_the_sum_of_a_learners_parts_is_held_to_the_bounds_of_one_contribution() -> None:
    big = Contribution(
        learner_id="a", fragment=0, base_version=0, seq=1, steps=10**8, tokens=MAX_TOKENS, tensors={},
        nbytes=0, received_at=1.0,
    )  # fmt: skip
    assert fold_problem(big, 1, 0) is None
    assert "claim 100000000000000001 tokens in 200000000 steps" in (fold_problem(big, 10**8, 1) or "")
    assert fold_problem(big, MAX_STEPS, 0) is not None
    small = progress(1, 0, 1.0)
    assert "tokens per step" in (fold_problem(small, 1, 5 * MAX_TOKENS_PER_STEP) or "")
    assert fold_problem(small, 4, 32) is None


def test_a_part_waiting_for_a_lost_earlier_one_is_dropped_once_its_base_is_stale() -> None:
    fs = initialised()
    fs.accept(progress(2, 4, 1.0), QUORUM)  # read back from storage; steps 1-4 were lost
    assert fs.drop_stale_gaps(max_staleness=1) == []
    rounds_of_b(fs, (1, 2))
    assert [c.key for c in fs.drop_stale_gaps(max_staleness=1)] == ["a/0/0/2"]
    assert fs.pending == {}


def test_a_reader_several_versions_behind_walks_the_chain_of_updates_while_it_is_smaller() -> None:
    fs = fresh()
    fs.begin_init()
    fs.finish_init(initial_params(PLAN, 0), b"v0" * 100, 0.0, QUORUM, digest="0" * 32)
    for version in (1, 2, 3):
        c = contribution(f"l{version}", at=float(version), base=version - 1)
        fs.accept(c, QUORUM)
        fs.start_merge([c.learner_id])
        fs.commit(
            version=version, params=initial_params(PLAN, 0, seed=version), payload=b"v" * 200, outer=OuterState(),
            now=float(version), quorum=QUORUM, update=b"u%d" % version,
        )  # fmt: skip
        fs.settle()
    assert fs.served.payload_for(0, 0) == (1, b"u1")  # the first link: the reader asks again from version 1
    assert fs.served.payload_for(1, 1) == (2, b"u2")
    assert fs.served.payload_for(2, 2) == (3, b"u3")
    assert fs.served.payload_for(0, 2) == (3, b"v" * 200)  # it says it has a newer one than it holds: whole
    assert fs.served.payload_for(-1, 0) == (3, b"v" * 200)  # holds nothing exactly
