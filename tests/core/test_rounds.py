"""The round policy as a table of (state, now) cases: quorum, grace deadline, staleness."""

from __future__ import annotations

import pytest
from diloco_core.rounds import (
    Decision,
    RoundEntry,
    RoundState,
    add_contribution,
    decide,
    grace_cap,
    grace_left,
    grace_window,
    is_stale,
    open_round,
    staleness,
)

POLICY = {"step_time": 1.0, "sync_time": 0.2, "overlap": 2, "gamma": 0.5, "cap": 1.0}


def c(learner: str, at: float, base: int = 5) -> RoundEntry:
    return RoundEntry(learner=learner, base_version=base, steps=8, tokens=800, arrived_at=at)


def test_grace_window_is_the_clipped_share_of_the_slack() -> None:
    assert grace_window(
        step_time=1.0, quorum_time=0.3, sync_time=0.2, overlap=2, gamma=0.5, cap=10
    ) == pytest.approx(0.75)
    assert grace_window(step_time=1.0, quorum_time=0.3, sync_time=0.2, overlap=2, gamma=0.5, cap=0.4) == 0.4
    assert grace_window(step_time=1.0, quorum_time=3.0, sync_time=0.2, overlap=2, gamma=0.5, cap=1) == 0.0
    assert grace_window(step_time=1.0, quorum_time=0.0, sync_time=0.0, overlap=0, gamma=0.5, cap=1) == 0.0


@pytest.mark.parametrize("step_time", [0.05, 86_400.0, 1e300, float("inf"), float("nan")])
def test_the_grace_cap_holds_whatever_step_time_is_reported(step_time: float) -> None:
    """Step times come from learners: the cap in seconds bounds the wait whatever they say."""
    cap = grace_cap(step_time=step_time, cap_steps=1.0, max_s=30.0)
    assert 0.0 <= cap <= 30.0
    window = grace_window(step_time=step_time, quorum_time=0.0, sync_time=0.0, overlap=2, gamma=0.5, cap=cap)
    assert 0.0 <= window <= 30.0
    state = add_contribution(open_round(0, 5, 0.0), c("a", 1.0), quorum=1)
    decision = decide(state, now=1.0, quorum=1, alive=2, step_time=step_time, sync_time=0.0, overlap=2,
                      gamma=0.5, cap=cap)  # fmt: skip
    assert decision.deadline is not None
    assert decision.deadline <= 1.0 + 30.0


def test_the_grace_cap_is_cap_steps_step_times_below_the_limit() -> None:
    assert grace_cap(step_time=2.0, cap_steps=1.5, max_s=30.0) == 3.0
    assert grace_cap(step_time=2.0, cap_steps=0.0, max_s=30.0) == 0.0


def test_staleness_helpers() -> None:
    assert staleness(3, 5) == 2
    assert staleness(6, 5) == 0
    assert not is_stale(3, 5, max_staleness=2)
    assert is_stale(2, 5, max_staleness=2)


def _state(*contribs: RoundEntry, quorum: int, opened: float = 10.0) -> RoundState:
    s = open_round(fragment=1, version=5, now=opened)
    for x in contribs:
        s = add_contribution(s, x, quorum=quorum, max_staleness=2)
    return s


@pytest.mark.parametrize(
    ("contribs", "quorum", "alive", "now", "expected"),
    [
        # below the quorum: wait, with no deadline
        ((c("a", 10.1),), 2, 3, 11.0, Decision("wait", None, ())),
        # quorum reached at 10.4 (quorum_time 0.4): grace = 0.5 * (2 - 0.4 - 0.2) = 0.7 -> deadline 11.1
        ((c("a", 10.1), c("b", 10.4)), 2, 3, 10.5, Decision("wait", pytest.approx(11.1), ())),
        ((c("a", 10.1), c("b", 10.4)), 2, 3, 11.1, Decision("merge", pytest.approx(11.1), ("a", "b"))),
        # a third learner arriving in the grace window joins
        (
            (c("a", 10.1), c("b", 10.4), c("c", 10.9)),
            2,
            4,
            11.2,
            Decision("merge", pytest.approx(11.1), ("a", "b", "c")),
        ),
        # every alive learner has contributed: merge at once
        ((c("a", 10.1), c("b", 10.4)), 2, 2, 10.4, Decision("merge", 10.4, ("a", "b"))),
        # K = 1: the first contribution opens a grace window of 0.5 * (2 - 0.5 - 0.2) = 0.65
        ((c("a", 10.5),), 1, 3, 10.6, Decision("wait", pytest.approx(11.15), ())),
    ],
)
def test_decide(contribs, quorum, alive, now, expected) -> None:  # type: ignore[no-untyped-def]
    state = _state(*contribs, quorum=quorum)
    got = decide(state, now=now, quorum=quorum, alive=alive, max_staleness=2, **POLICY)
    assert (got.action, got.deadline, got.participants) == (
        expected.action,
        expected.deadline,
        expected.participants,
    )


def test_stale_contributions_are_excluded_with_a_reason_and_do_not_count_for_the_quorum() -> None:
    state = _state(c("old", 10.1, base=1), c("new", 10.2, base=5), quorum=2)
    assert state.first_quorum_at is None
    got = decide(state, now=20.0, quorum=2, alive=3, max_staleness=2, **POLICY)
    assert got.action == "wait"
    assert got.excluded == (("old", "stale: base version 1 is 4 behind (max 2)"),)
    got = decide(state, now=20.0, quorum=1, alive=2, max_staleness=2, **POLICY)
    assert got.action == "merge"
    assert got.participants == ("new",)
    future = _state(c("x", 10.1, base=9), quorum=1)
    assert "newer than the current" in decide(future, now=11, quorum=1, alive=1, **POLICY).excluded[0][1]


def test_a_learner_resending_replaces_its_earlier_contribution() -> None:
    state = _state(c("a", 10.1), c("a", 10.3), quorum=1)
    assert list(state.pending) == ["a"]
    assert state.pending["a"].arrived_at == 10.3
    assert state.first_quorum_at == 10.1


def test_decide_is_pure() -> None:
    state = _state(c("a", 10.1), quorum=1)
    first = decide(state, now=10.2, quorum=1, alive=2, **POLICY)
    assert decide(state, now=10.2, quorum=1, alive=2, **POLICY) == first
    assert state == _state(c("a", 10.1), quorum=1)
    with pytest.raises(ValueError, match="quorum"):
        decide(state, now=0, quorum=0, alive=1, **POLICY)


def test_grace_left_counts_down_to_the_deadline_decide_sets() -> None:
    waiting = _state(c("a", 10.1), quorum=2)
    assert grace_left(waiting, now=10.5, **POLICY) is None  # no quorum yet: no deadline
    state = _state(c("a", 10.1), c("b", 10.4), quorum=2)
    deadline = decide(state, now=10.5, quorum=2, alive=3, max_staleness=2, **POLICY).deadline
    assert deadline == pytest.approx(11.1)
    assert grace_left(state, now=10.5, **POLICY) == pytest.approx(deadline - 10.5)
    assert grace_left(state, now=12.0, **POLICY) == 0.0  # past the deadline: nothing left, never negative
