from __future__ import annotations

import math

from diloco_core.progress import describe_duration, time_left


def test_time_left_is_that_of_the_first_budget_spent() -> None:
    # 100 of 300 s; 1,000 of 10,000 tokens at 10/s (900 s); 50 of 100 steps at 0.5/s (100 s)
    assert time_left([(100.0, 300.0, 1.0), (1_000, 10_000, 10.0), (50, 100, 0.5)]) == 100.0


def test_a_budget_not_moving_or_unbounded_says_nothing() -> None:
    assert time_left([(0, 100, 0.0), (5, math.inf, 1.0)]) is None
    assert time_left([(120, 100, 1.0)]) == 0.0  # overspent: nothing left


def test_durations_read_as_people_write_them() -> None:
    assert [describe_duration(s) for s in (0, 42.4, 185, 3_720, 90_000)] == [
        "0s",
        "42s",
        "3m05s",
        "1h02m",
        "25h00m",
    ]
    assert describe_duration(None) == "?"
    assert describe_duration(math.inf) == "?"
