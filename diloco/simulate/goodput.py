"""Goodput per mode and chip count, averaged over seeds, and its comparison with the paper's Table 1.

``simulate_cell`` runs one (mode, chips) cell; ``goodput_table`` runs the grid. Each cell, learner and
seed gets its own random stream derived from (seed, mode, chips, learner), so a cell's result does
not depend on which other cells are in the table.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from diloco.simulate.events import Tally, all_paused_seconds, simulate_elastic_learner, simulate_restart_job
from diloco.simulate.model import Row, SimParams, paper_value


def _rng(seed: int, row: Row, chips: int, learner: int) -> np.random.Generator:
    tag = zlib.crc32(f"{row.key}/{chips}/{learner}".encode())
    return np.random.default_rng([seed, tag])


@dataclass(frozen=True)
class Cell:
    """One table cell: mean goodput over seeds (fraction), per-seed values and the paper's value.

    ``uptime`` is the fraction of the horizon in which training advanced (at least one learner
    was not paused).
    """

    row: Row
    chips: int
    goodputs: tuple[float, ...]
    failures: int
    uptime: float
    paper_percent: float | None

    @property
    def goodput(self) -> float:
        return float(np.mean(self.goodputs))

    @property
    def percent(self) -> float:
        return 100.0 * self.goodput

    @property
    def error_points(self) -> float | None:
        """Our goodput minus the paper's, in percentage points."""
        return None if self.paper_percent is None else self.percent - self.paper_percent


def _combine(tallies: Sequence[Tally]) -> Tally:
    return Tally(
        sum(t.useful_chip_s for t in tallies),
        sum(t.allocated_chip_s for t in tallies),
        sum(t.failures for t in tallies),
        all_paused_seconds([t.pauses for t in tallies]),
    )


def simulate_once(row: Row, chips: int, params: SimParams, horizon_s: float, seed: int) -> Tally:
    """One run of one cell. For M learners ``paused_s`` is the time all learners were paused at once."""
    if chips < 1:
        raise ValueError(f"chips must be >= 1, got {chips}")
    if horizon_s <= 0:
        raise ValueError(f"horizon must be > 0 seconds, got {horizon_s}")
    if row.mode == "dp":
        return simulate_restart_job(chips, params, horizon_s, _rng(seed, row, chips, 0))
    learners = 1 if row.mode == "elastic" else row.learners
    if learners < 1 or learners > chips:
        raise ValueError(f"learners must be between 1 and the chip count {chips}, got {learners}")
    per_learner = chips / learners
    return _combine(
        [
            simulate_elastic_learner(per_learner, params, horizon_s, _rng(seed, row, chips, m))
            for m in range(learners)
        ]
    )


def simulate_cell(row: Row, chips: int, params: SimParams, horizon_s: float, seeds: Sequence[int]) -> Cell:
    if not seeds:
        raise ValueError("at least one seed is needed")
    tallies = [simulate_once(row, chips, params, horizon_s, s) for s in seeds]
    uptime = float(np.mean([1.0 - t.paused_s / horizon_s for t in tallies]))
    return Cell(
        row=row,
        chips=chips,
        goodputs=tuple(t.goodput for t in tallies),
        failures=sum(t.failures for t in tallies),
        uptime=uptime,
        paper_percent=paper_value(row, chips),
    )


@dataclass(frozen=True)
class Table:
    chips: tuple[int, ...]
    rows: tuple[Row, ...]
    cells: dict[tuple[str, int], Cell]

    def cell(self, row: Row, chips: int) -> Cell:
        return self.cells[(row.key, chips)]

    def max_error(self, keys: Sequence[str]) -> float:
        """Largest |ours - paper| in points over the rows with these keys (0 if no paper cells)."""
        errors = [
            abs(c.error_points)
            for (k, _), c in self.cells.items()
            if k in keys and c.error_points is not None
        ]
        return max(errors, default=0.0)

    def to_dict(self) -> dict[str, object]:
        return {
            "chips": list(self.chips),
            "rows": [
                {
                    "mode": row.mode,
                    "learners": row.learners,
                    "label": row.label,
                    "cells": [
                        {
                            "chips": c,
                            "goodput_percent": round(self.cell(row, c).percent, 2),
                            "per_seed_percent": [round(100 * g, 2) for g in self.cell(row, c).goodputs],
                            "paper_percent": self.cell(row, c).paper_percent,
                            "uptime_percent": round(100 * self.cell(row, c).uptime, 2),
                            "failures": self.cell(row, c).failures,
                        }
                        for c in self.chips
                    ],
                }
                for row in self.rows
            ],
        }


def goodput_table(
    chips: Sequence[int], rows: Sequence[Row], params: SimParams, horizon_s: float, seeds: Sequence[int]
) -> Table:
    cells = {(row.key, c): simulate_cell(row, c, params, horizon_s, seeds) for row in rows for c in chips}
    return Table(tuple(chips), tuple(rows), cells)
