"""The assumptions of the goodput simulator: distributions, calibrated constants and the paper's table.

Everything the simulator assumes lives here as data, so the documentation (docs/simulator.md), the
CLI and the tests read the same numbers.

Failure model (Decoupled DiLoCo, docs/algorithm.md §2.4, §3.11): every chip is interrupted as a Poisson
process with mean time between interruptions ``mtbi_s`` (1 year). A group of n chips therefore fails
at rate n / MTBI; the simulator only ever handles groups (the whole job, slices, learners), never
single chips.

Modes:

* ``dp`` — data-parallel without elasticity: any failure stops the whole job for a restart time
  drawn from ``restart`` and loses the progress made since the last checkpoint (checkpoints every
  ``checkpoint_interval_s`` of progress, written asynchronously at no cost). Failures that happen
  while the job is restarting are absorbed by that restart (it replaces all bad hardware at once).
* ``elastic`` — elastic data-parallel over slices of ``slice_chips`` chips: a slice failure pauses the
  job for ``t_down_s`` (re-shard without the slice) and the job carries on without it; the slice
  comes back after a repair time drawn from ``slice_repair`` and is admitted with a pause of
  ``t_up_s``. Slices that come back within ``admit_window_s`` of the previous admission wait and
  are admitted together at the end of that window. Events that arrive during a pause are absorbed.
* ``decoupled`` with M learners — each learner is an independent elastic data-parallel job over
  N / M chips; a failure pauses only its own learner.

Goodput = useful chip-time / allocated chip-time, with all N chips allocated for the whole horizon.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Literal

import numpy as np

SECONDS_PER_YEAR = 365.25 * 86400.0

DistributionKind = Literal["fixed", "exponential", "lognormal", "expweibull"]


@dataclass(frozen=True)
class Distribution:
    """A positive random duration in seconds.

    * ``fixed``: always ``scale``.
    * ``exponential``: mean ``scale``.
    * ``lognormal``: median ``scale``, log-space standard deviation ``shape``.
    * ``expweibull``: exponentiated Weibull, CDF ``(1 - exp(-(x/scale)**shape))**alpha``.
    """

    kind: DistributionKind
    scale: float
    shape: float = 1.0
    alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "exponential", "lognormal", "expweibull"):
            raise ValueError(f"unknown distribution kind {self.kind!r}")
        if not (math.isfinite(self.scale) and self.scale >= 0):
            raise ValueError(f"distribution scale must be a finite number >= 0, got {self.scale!r}")
        if self.shape <= 0 or self.alpha <= 0:
            raise ValueError(f"distribution shape and alpha must be > 0, got {self.shape!r}, {self.alpha!r}")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Draw ``size`` durations (float64 seconds)."""
        if self.kind == "fixed":
            return np.full(size, self.scale)
        if self.kind == "exponential":
            return rng.exponential(self.scale, size) if self.scale > 0 else np.zeros(size)
        if self.kind == "lognormal":
            return self.scale * np.exp(self.shape * rng.standard_normal(size))
        return self.quantile(rng.random(size))

    def quantile(self, u: np.ndarray) -> np.ndarray:
        """Inverse CDF at probabilities ``u`` in [0, 1)."""
        if self.kind == "fixed":
            return np.full(u.shape, self.scale)
        if self.kind == "exponential":
            result: np.ndarray = -self.scale * np.log1p(-u)
        elif self.kind == "lognormal":
            normal = NormalDist()
            z = np.array([normal.inv_cdf(min(max(float(p), 1e-12), 1 - 1e-12)) for p in u.ravel()])
            result = self.scale * np.exp(self.shape * z.reshape(u.shape))
        else:
            result = self.scale * (-np.log1p(-(u ** (1.0 / self.alpha)))) ** (1.0 / self.shape)
        return result

    def mean(self) -> float:
        """The expected duration (closed form where there is one, else a fine quantile average)."""
        if self.kind in ("fixed", "exponential"):
            return self.scale
        if self.kind == "lognormal":
            return self.scale * math.exp(self.shape**2 / 2)
        grid = (np.arange(200_000) + 0.5) / 200_000
        return float(self.quantile(grid).mean())

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.scale:g} s"
        if self.kind == "exponential":
            return f"exponential, mean {self.scale:g} s"
        if self.kind == "lognormal":
            return f"lognormal, median {self.scale:g} s, sigma {self.shape:g} (mean {self.mean():.0f} s)"
        return (
            f"exponentiated Weibull, scale {self.scale:g} s, k {self.shape:g}, alpha {self.alpha:g} "
            f"(mean {self.mean():.0f} s)"
        )


@dataclass(frozen=True)
class SimParams:
    """The constants of the failure model. The defaults are the calibrated ones (docs/simulator.md)."""

    mtbi_s: float = SECONDS_PER_YEAR
    restart: Distribution = field(default_factory=lambda: Distribution("lognormal", 66.0, 0.4))
    checkpoint_interval_s: float = 2.0
    slice_chips: int = 256
    slice_repair: Distribution = field(default_factory=lambda: Distribution("expweibull", 300.0, 1.0, 1.5))
    t_down_s: float = 17.0
    t_up_s: float = 10.0
    admit_window_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.mtbi_s > 0:
            raise ValueError(f"mtbi_s must be > 0 (use math.inf for no failures), got {self.mtbi_s!r}")
        for name in ("checkpoint_interval_s", "t_down_s", "t_up_s", "admit_window_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.slice_chips < 1:
            raise ValueError(f"slice_chips must be >= 1, got {self.slice_chips!r}")

    def with_mtbi_years(self, years: float) -> SimParams:
        return replace(self, mtbi_s=years * SECONDS_PER_YEAR)


Mode = Literal["dp", "elastic", "decoupled"]


@dataclass(frozen=True)
class Row:
    """One row of the goodput table: a mode and (for ``decoupled``) its number of learners."""

    mode: Mode
    learners: int = 1

    @property
    def label(self) -> str:
        if self.mode == "dp":
            return "DP, no elasticity"
        if self.mode == "elastic":
            return "DP, elastic"
        return f"Decoupled M={self.learners}"

    @property
    def key(self) -> str:
        return self.mode if self.mode != "decoupled" else f"decoupled-{self.learners}"


PAPER_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)

# Decoupled DiLoCo, Table 1: goodput (%) per row and chip count, MTBI 1 year per chip.
PAPER_TABLE: dict[str, tuple[float, ...]] = {
    "dp": (72, 57, 38, 27, 18),
    "elastic": (88, 80, 69, 58, 40),
    "decoupled-2": (94, 88, 80, 70, 54),
    "decoupled-4": (96, 93, 89, 82, 73),
    "decoupled-8": (98, 96, 94, 88, 80),
    "decoupled-16": (99, 98, 96, 93, 86),
}


def paper_value(row: Row, chips: int) -> float | None:
    """The paper's goodput (%) for this cell, or None when the paper has no such cell."""
    values = PAPER_TABLE.get(row.key)
    if values is None or chips not in PAPER_CHIPS:
        return None
    return values[PAPER_CHIPS.index(chips)]


def default_rows(learners: tuple[int, ...] = (2, 4, 8, 16)) -> tuple[Row, ...]:
    return (Row("dp"), Row("elastic"), *(Row("decoupled", m) for m in learners))
