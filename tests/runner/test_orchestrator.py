from __future__ import annotations

from diloco.runner.cli import parse_settings
from diloco.runner.orchestrator import run_time_left


def test_the_run_ends_at_its_first_budget_at_the_pace_so_far() -> None:
    s = parse_settings(["--time-limit", "600", "--max-steps", "300"])
    # 100 s in, the slowest learner at step 50 of 300: 500 s more, as the time limit leaves
    assert run_time_left(s, 100.0, 4_096, [50, 80, 90]) == 500.0
    # the slowest at step 150: 100 s more, well before the time limit
    assert run_time_left(s, 100.0, 4_096, [150, 200]) == 100.0
    budget = parse_settings(["--time-limit", "600", "--max-steps", "300", "--token-budget", "8192"])
    assert run_time_left(budget, 100.0, 4_096, [10]) == 100.0  # half the tokens in 100 s


def test_no_estimate_before_the_run_has_started() -> None:
    assert run_time_left(parse_settings([]), 0.0, 0, []) is None
