"""The most steps a learner can have trained on a version: bounded by the version's age."""

from __future__ import annotations

from diloco_sync.pace import (
    CLOCK_SLACK_S,
    JOB_BOUND,
    KEPT_VERSIONS,
    UNIT_BOUND,
    kept_times,
    most_steps,
    pace_for,
    pace_problem,
)


def test_steps_are_bounded_by_the_versions_age_at_the_fastest_pace() -> None:
    assert most_steps(100.0, 100.0, 0.01, 16) == 16 + int(CLOCK_SLACK_S / 0.01)
    assert most_steps(100.0, 110.0, 0.01, 16) == 16 + int((10 + CLOCK_SLACK_S) / 0.01)
    assert most_steps(100.0, 90.0, 0.01, 16) == most_steps(100.0, 100.0, 0.01, 16)  # clock behind
    args = {"min_step_s": 0.01, "slack_steps": 16}
    assert pace_problem("a", 0, 3, 1516, 100.0, 110.0, **args) is None
    problem = pace_problem("a", 0, 3, 10**8, 100.0, 110.0, **args)
    assert problem is not None
    assert "more than the 1516" in problem
    assert "--min-step-time-s" in problem


def test_a_unit_is_held_to_its_own_pace_only_where_it_is_slower_than_the_jobs() -> None:
    assert pace_for(0.01, None) == (0.01, JOB_BOUND)
    assert pace_for(0.01, 0.5) == (0.5, UNIT_BOUND)
    assert pace_for(0.01, 0.001) == (0.01, JOB_BOUND)  # a faster unit pace loosens nothing
    assert pace_for(0.01, 0.01) == (0.01, JOB_BOUND)


def test_no_bound_without_a_commit_time_or_a_pace() -> None:
    assert pace_problem("a", 0, 3, 10**8, None, 110.0, min_step_s=0.01, slack_steps=16) is None
    assert pace_problem("a", 0, 3, 10**8, 100.0, 110.0, min_step_s=0.0, slack_steps=16) is None


def test_commit_times_kept_are_bounded() -> None:
    times: dict[int, float] = {}
    for version in range(200):
        times = kept_times(times, version, float(version))
    assert len(times) == KEPT_VERSIONS
    assert min(times) == 200 - KEPT_VERSIONS
    assert times[199] == 199.0
