import statistics
from itertools import pairwise

import pytest

from diloco.runner.chaos import ChaosEvent, build_chaos_schedule, due_events


def test_same_seed_same_schedule_and_other_seed_differs() -> None:
    a = build_chaos_schedule(seed=1, mtbf_s=10, repair_s=2, learners=[0, 1, 2], horizon_s=100)
    b = build_chaos_schedule(seed=1, mtbf_s=10, repair_s=2, learners=[0, 1, 2], horizon_s=100)
    c = build_chaos_schedule(seed=2, mtbf_s=10, repair_s=2, learners=[0, 1, 2], horizon_s=100)
    assert a == b
    assert a != c


def test_every_kill_is_followed_by_its_restart_after_the_repair_time() -> None:
    schedule = build_chaos_schedule(seed=3, mtbf_s=5, repair_s=4, learners=[0, 1, 2, 3], horizon_s=60)
    assert schedule == tuple(sorted(schedule, key=lambda e: e.at_s))
    for learner in range(4):
        mine = [e for e in schedule if e.learner == learner]
        assert [e.action for e in mine] == ["kill", "restart"] * (len(mine) // 2)
        for kill, restart in zip(mine[::2], mine[1::2], strict=True):
            assert restart.at_s == pytest.approx(kill.at_s + 4)
            assert kill.at_s < 60


def test_a_learner_is_never_killed_while_down() -> None:
    schedule = build_chaos_schedule(seed=0, mtbf_s=1, repair_s=3, learners=[0], horizon_s=200)
    times = [e.at_s for e in schedule]
    assert all(b >= a for a, b in pairwise(times))
    kills = [e.at_s for e in schedule if e.action == "kill"]
    assert all(b - a >= 3 for a, b in pairwise(kills))


def test_time_between_failures_is_exponential_with_the_given_mean() -> None:
    schedule = build_chaos_schedule(seed=7, mtbf_s=10, repair_s=0, learners=[0], horizon_s=100_000)
    kills = [e.at_s for e in schedule if e.action == "kill"]
    gaps = [b - a for a, b in pairwise(kills)]
    assert statistics.mean(gaps) == pytest.approx(10, rel=0.05)
    # exponential: the standard deviation equals the mean (a constant gap would give 0)
    assert statistics.stdev(gaps) == pytest.approx(10, rel=0.1)


def test_no_chaos_when_mtbf_is_zero_and_bad_input_is_rejected() -> None:
    assert build_chaos_schedule(seed=0, mtbf_s=0, repair_s=1, learners=[0, 1], horizon_s=100) == ()
    with pytest.raises(ValueError, match="repair time"):
        build_chaos_schedule(seed=0, mtbf_s=1, repair_s=-1, learners=[0], horizon_s=10)


def test_due_events_advances_the_cursor() -> None:
    schedule = (ChaosEvent(1.0, 0, "kill"), ChaosEvent(2.0, 1, "kill"), ChaosEvent(3.0, 0, "restart"))
    due, cursor = due_events(schedule, 0, 2.5)
    assert due == list(schedule[:2])
    assert cursor == 2
    due, cursor = due_events(schedule, cursor, 2.9)
    assert due == []
    due, cursor = due_events(schedule, cursor, 10)
    assert due == [schedule[2]]
    assert cursor == 3
