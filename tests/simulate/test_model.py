"""The simulator's distributions, constants and the paper's table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diloco.simulate.model import PAPER_CHIPS, PAPER_TABLE, Distribution, Row, SimParams, paper_value


@pytest.mark.parametrize(
    "dist",
    [
        Distribution("fixed", 30.0),
        Distribution("exponential", 30.0),
        Distribution("lognormal", 60.0, 0.5),
        Distribution("expweibull", 300.0, 1.0, 1.5),
        Distribution("expweibull", 100.0, 2.0, 0.7),
    ],
)
def test_sample_mean_matches_the_stated_mean(dist: Distribution) -> None:
    draws = dist.sample(np.random.default_rng(0), 200_000)
    assert (draws >= 0).all()
    assert draws.mean() == pytest.approx(dist.mean(), rel=0.02)


def test_expweibull_quantile_inverts_its_cdf() -> None:
    dist = Distribution("expweibull", 300.0, 1.3, 1.5)
    u = np.array([0.1, 0.5, 0.9, 0.99])
    x = dist.quantile(u)
    cdf = (1 - np.exp(-((x / dist.scale) ** dist.shape))) ** dist.alpha
    np.testing.assert_allclose(cdf, u, rtol=1e-9)


def test_lognormal_quantile_median_is_its_scale() -> None:
    assert Distribution("lognormal", 66.0, 0.4).quantile(np.array([0.5]))[0] == pytest.approx(66.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "gamma", "scale": 1.0}, "unknown distribution kind 'gamma'"),
        ({"kind": "fixed", "scale": -1.0}, "scale must be a finite number >= 0"),
        ({"kind": "lognormal", "scale": 1.0, "shape": 0.0}, "shape and alpha must be > 0"),
    ],
)
def test_bad_distribution_is_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Distribution(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mtbi_s": 0.0}, "mtbi_s must be > 0"),
        ({"slice_chips": 0}, "slice_chips must be >= 1"),
        ({"t_down_s": -1.0}, "t_down_s must be a finite number >= 0"),
        ({"admit_window_s": math.inf}, "admit_window_s must be a finite number >= 0"),
    ],
)
def test_bad_params_are_rejected(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimParams(**kwargs)  # type: ignore[arg-type]


def test_default_mtbi_is_one_year_per_chip() -> None:
    assert SimParams().mtbi_s == pytest.approx(365.25 * 86400)
    assert SimParams().with_mtbi_years(2.0).mtbi_s == pytest.approx(2 * 365.25 * 86400)


def test_paper_table_lookup() -> None:
    assert paper_value(Row("decoupled", 8), 1_200_000) == 88
    assert paper_value(Row("dp"), 1_200_000) == 27
    assert paper_value(Row("decoupled", 3), 1_200_000) is None
    assert paper_value(Row("dp"), 1000) is None
    assert all(len(v) == len(PAPER_CHIPS) for v in PAPER_TABLE.values())
    assert Row("decoupled", 4).label == "Decoupled M=4"
