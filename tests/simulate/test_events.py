"""The event core against closed forms, where the model has one."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from diloco.simulate.events import all_paused_seconds, simulate_elastic_learner, simulate_restart_job
from diloco.simulate.model import Distribution, SimParams

DAY = 86400.0


def test_no_failures_means_all_chip_time_is_useful() -> None:
    params = replace(SimParams(), mtbi_s=math.inf)
    rng = np.random.default_rng(0)
    for tally in (
        simulate_restart_job(1_200_000, params, DAY, rng),
        simulate_elastic_learner(1_200_000, params, DAY, rng),
    ):
        assert tally.goodput == 1.0
        assert tally.failures == 0
        assert tally.paused_s == 0.0


def test_restart_job_matches_renewal_formula() -> None:
    # Up-times Exp(rate), restarts fixed R, no lost work: goodput = 1 / (1 + rate * R).
    params = replace(SimParams(), restart=Distribution("fixed", 60.0), checkpoint_interval_s=0.0)
    chips = 600_000
    rate = chips / params.mtbi_s
    tally = simulate_restart_job(chips, params, 20 * DAY, np.random.default_rng(1))
    assert tally.goodput == pytest.approx(1 / (1 + rate * 60.0), abs=0.01)
    assert tally.failures == pytest.approx(rate * 20 * DAY / (1 + rate * 60.0), rel=0.05)


def test_checkpoint_interval_costs_half_an_interval_per_failure() -> None:
    base = replace(SimParams(), restart=Distribution("fixed", 30.0), checkpoint_interval_s=0.0)
    chips, horizon = 150_000, 20 * DAY
    rate = chips / base.mtbi_s
    without = simulate_restart_job(chips, base, horizon, np.random.default_rng(2)).goodput
    with_ckpt = simulate_restart_job(
        chips, replace(base, checkpoint_interval_s=20.0), horizon, np.random.default_rng(2)
    ).goodput
    # Same random stream: the only difference is the lost work, about interval / 2 per failure.
    assert without - with_ckpt == pytest.approx(rate * 10.0 / (1 + rate * 30.0), rel=0.15)


def test_elastic_learner_matches_pause_formula() -> None:
    # Short repairs, admissions one by one, failures rare enough that pauses seldom overlap: every
    # failure costs one T_down and one T_up pause of the whole job: goodput ~ 1 / (1 + rate (Td + Tu)).
    params = replace(
        SimParams(), slice_repair=Distribution("fixed", 60.0), admit_window_s=0.0, t_down_s=20.0, t_up_s=10.0
    )
    chips = 20_000
    rate = chips / params.mtbi_s
    tally = simulate_elastic_learner(chips, params, 20 * DAY, np.random.default_rng(3))
    assert tally.goodput == pytest.approx(1 / (1 + rate * 30.0), abs=0.003)


def test_return_during_a_pause_is_absorbed() -> None:
    # A repair of zero seconds returns the slice inside its own T_down pause: no T_up pause at all.
    params = replace(
        SimParams(), slice_repair=Distribution("fixed", 0.0), admit_window_s=0.0, t_down_s=20.0, t_up_s=10.0
    )
    chips = 20_000
    rate = chips / params.mtbi_s
    tally = simulate_elastic_learner(chips, params, 20 * DAY, np.random.default_rng(3))
    assert tally.goodput == pytest.approx(1 / (1 + rate * 20.0), abs=0.003)


def test_elastic_learner_loses_capacity_while_slices_repair() -> None:
    # No pauses; only training slices fail, so in steady state the training fraction u satisfies
    # 1 - u = u * slice_chips * repair / MTBI: goodput = 1 / (1 + slice_chips * repair / MTBI).
    params = replace(
        SimParams(),
        t_down_s=0.0,
        t_up_s=0.0,
        admit_window_s=0.0,
        slice_repair=Distribution("fixed", 6 * 3600.0),
    )
    tally = simulate_elastic_learner(100_000, params, 30 * DAY, np.random.default_rng(4))
    expected = 1 / (1 + params.slice_chips * 6 * 3600.0 / params.mtbi_s)
    assert tally.goodput == pytest.approx(expected, abs=0.003)
    assert tally.goodput < 1.0


def test_batched_admission_pauses_less_than_one_pause_per_return() -> None:
    base = replace(SimParams(), admit_window_s=0.0)
    chips, horizon = 2_400_000, 2 * DAY
    one_by_one = simulate_elastic_learner(chips, base, horizon, np.random.default_rng(5))
    batched = simulate_elastic_learner(
        chips, replace(base, admit_window_s=300.0), horizon, np.random.default_rng(5)
    )
    assert batched.paused_s < one_by_one.paused_s


def test_same_seed_same_result_different_seed_different_result() -> None:
    params = SimParams()
    a = simulate_elastic_learner(300_000, params, DAY, np.random.default_rng(7))
    b = simulate_elastic_learner(300_000, params, DAY, np.random.default_rng(7))
    c = simulate_elastic_learner(300_000, params, DAY, np.random.default_rng(8))
    assert a == b
    assert a != c


def test_all_paused_seconds_is_the_intersection_of_pause_sets() -> None:
    a = np.array([[0.0, 10.0], [20.0, 30.0]])
    b = np.array([[5.0, 25.0]])
    c = np.array([[8.0, 40.0]])
    assert all_paused_seconds([a]) == pytest.approx(20.0)
    assert all_paused_seconds([a, b]) == pytest.approx(5.0 + 5.0)
    assert all_paused_seconds([a, b, c]) == pytest.approx(2.0 + 5.0)
    assert all_paused_seconds([a, np.empty((0, 2))]) == 0.0
    # Touching intervals do not overlap.
    assert all_paused_seconds([np.array([[0.0, 5.0]]), np.array([[5.0, 9.0]])]) == 0.0
