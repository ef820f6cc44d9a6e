"""The simulator's invariants and its agreement with the paper's Table 1.

Tolerances (percentage points per cell): the data-parallel rows were calibrated and stay within 6;
the decoupled rows were not fitted, they fall out of the elastic model, and stay within 6 as well
(about 4 at most with the default 3 seeds x 7 days; see docs/simulator.md).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from diloco.simulate.goodput import Table, goodput_table, simulate_cell
from diloco.simulate.model import PAPER_CHIPS, Row, SimParams, default_rows

DAY = 86400.0
DP_TOLERANCE = 6.0
DECOUPLED_TOLERANCE = 6.0
LEARNERS = (2, 4, 8, 16)


@pytest.fixture(scope="module")
def table() -> Table:
    return goodput_table(PAPER_CHIPS, default_rows(LEARNERS), SimParams(), 4 * DAY, seeds=(1, 2))


def _percents(table: Table, row: Row) -> list[float]:
    return [table.cell(row, c).percent for c in table.chips]


def test_no_failures_give_full_goodput_in_every_mode() -> None:
    params = replace(SimParams(), mtbi_s=math.inf)
    no_failures = goodput_table((150_000, 2_400_000), default_rows(LEARNERS), params, DAY, seeds=(1,))
    for cell in no_failures.cells.values():
        assert cell.goodput == pytest.approx(1.0, abs=1e-12)
        assert cell.failures == 0
        assert cell.uptime == 1.0


def test_more_learners_never_lower_goodput(table: Table) -> None:
    for chips in PAPER_CHIPS:
        by_learners = [table.cell(Row("elastic"), chips).percent]
        by_learners += [table.cell(Row("decoupled", m), chips).percent for m in LEARNERS]
        assert by_learners == sorted(by_learners), (chips, by_learners)
        assert table.cell(Row("dp"), chips).percent < by_learners[0]


def test_data_parallel_goodput_falls_with_chip_count(table: Table) -> None:
    for row in (Row("dp"), Row("elastic")):
        values = _percents(table, row)
        assert all(a > b for a, b in itertools.pairwise(values)), (row.label, values)


def test_data_parallel_rows_agree_with_the_paper(table: Table) -> None:
    assert table.max_error(["dp", "elastic"]) <= DP_TOLERANCE


def test_decoupled_rows_agree_with_the_paper(table: Table) -> None:
    assert table.max_error([f"decoupled-{m}" for m in LEARNERS]) <= DECOUPLED_TOLERANCE


def test_headline_at_1_2m_chips(table: Table) -> None:
    decoupled = table.cell(Row("decoupled", 8), 1_200_000).percent
    dp = table.cell(Row("dp"), 1_200_000).percent
    assert decoupled == pytest.approx(88, abs=DECOUPLED_TOLERANCE)
    assert dp == pytest.approx(27, abs=DP_TOLERANCE)
    assert decoupled - dp > 50


def test_m_learners_behave_like_one_elastic_job_with_m_times_fewer_chips(table: Table) -> None:
    # The paper's rule of thumb, e.g. M=8 at 1.2M chips ~ elastic at 150k.
    for m in LEARNERS:
        for chips in PAPER_CHIPS:
            if chips // m in PAPER_CHIPS:
                ours = table.cell(Row("decoupled", m), chips).percent
                elastic = table.cell(Row("elastic"), chips // m).percent
                assert ours == pytest.approx(elastic, abs=1.0), (m, chips)


def test_decoupled_uptime_is_near_total_from_four_learners(table: Table) -> None:
    for m in (4, 8, 16):
        assert table.cell(Row("decoupled", m), 2_400_000).uptime > 0.99
    assert table.cell(Row("dp"), 2_400_000).uptime < 0.3


def test_a_seed_fixes_the_result() -> None:
    params = SimParams()
    a = simulate_cell(Row("decoupled", 4), 600_000, params, DAY, seeds=(5,))
    b = simulate_cell(Row("decoupled", 4), 600_000, params, DAY, seeds=(5,))
    c = simulate_cell(Row("decoupled", 4), 600_000, params, DAY, seeds=(6,))
    assert a == b
    assert a.goodputs != c.goodputs


@pytest.mark.parametrize(
    ("row", "chips", "horizon", "message"),
    [
        (Row("dp"), 0, DAY, "chips must be >= 1"),
        (Row("dp"), 1000, 0.0, "horizon must be > 0"),
        (Row("decoupled", 32), 16, DAY, "learners must be between 1 and the chip count 16"),
    ],
)
def test_bad_cell_is_rejected(row: Row, chips: int, horizon: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate_cell(row, chips, SimParams(), horizon, seeds=(1,))


def test_no_seeds_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one seed"):
        simulate_cell(Row("dp"), 1000, SimParams(), DAY, seeds=())
