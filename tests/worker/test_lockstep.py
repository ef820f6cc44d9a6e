"""Where a (re)joining learner of a synchronous job stands in the round cycle (pure arithmetic)."""

from __future__ import annotations

from diloco_core.fragments import FragmentPlan, build_plan
from diloco_worker.lockstep import lockstep_counters, round_can_close

H, P = 16, 4  # offsets 0, 4, 8, 12


def _plan() -> FragmentPlan:
    plan = build_plan([(f"w{i}", (8, 8)) for i in range(P)], P, H, overlap=0)
    assert [f.offset for f in plan.fragments] == [0, 4, 8, 12]
    return plan


def _next_due(counters: dict[int, int]) -> list[int]:
    """Fragments in the order they fall due from here (a fragment is due after H steps)."""
    return sorted(counters, key=lambda p: H - counters[p])


def test_a_fresh_job_starts_every_fragment_at_minus_its_offset() -> None:
    plan = _plan()
    assert lockstep_counters(plan, {0: 0, 1: 0, 2: 0, 3: 0}) == {0: 0, 1: -4, 2: -8, 3: -12}
    assert lockstep_counters(plan, {}) == {0: 0, 1: -4, 2: -8, 3: -12}


def test_a_learner_resuming_behind_the_others_takes_the_round_they_wait_for() -> None:
    # the others merged rounds at 16/32/48 (fragment 0), 20/36/52 (1), 24/40/56 (2) and 28/44 (3):
    # they wait at step 60 for fragment 3, so the rejoining learner must send fragment 3 first, and
    # never fragment 1 again before them (each side would wait for the other's fragment for ever)
    counters = lockstep_counters(_plan(), {0: 3, 1: 3, 2: 3, 3: 2})
    assert counters == {0: 8, 1: 4, 2: 0, 3: 12}
    assert _next_due(counters) == [3, 0, 1, 2]
    assert H - counters[3] == 4  # the newest merge was at step 56; fragment 3's round closes at 60


def test_counters_follow_the_versions_not_the_learners_own_history() -> None:
    plan = _plan()
    # only fragment 0 merged once (step 16): fragment 1 is next, due at step 20, i.e. in 4 steps
    counters = lockstep_counters(plan, {0: 1, 1: 0, 2: 0, 3: 0})
    assert counters == {0: 0, 1: 12, 2: 8, 3: 4}
    assert _next_due(counters) == [1, 2, 3, 0]


def test_a_dead_learner_still_counts_for_the_round_but_one_that_left_does_not() -> None:
    assert round_can_close(["training", "dead"], quorum=2)
    assert round_can_close(["training", "rejoining"], quorum=2)
    assert not round_can_close(["training", "left"], quorum=2)
    assert not round_can_close(["training", "leaving", "dead"], quorum=3)
    assert round_can_close(["training"], quorum=1)
