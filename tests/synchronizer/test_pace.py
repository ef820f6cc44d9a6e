"""The most steps a learner can have trained on a version: bounded by the version's age."""

from __future__ import annotations

from diloco_sync.pace import CLOCK_SLACK_S, KEPT_VERSIONS, kept_times, most_steps, pace_problem


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
