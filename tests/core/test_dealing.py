"""The job's data dealt in ranges (diloco_core.dealing): no stream position twice, whatever units come,
go, restart or change their range size; the same answer for the same position; bounds."""

from __future__ import annotations

import itertools

import pytest
from diloco_core.dealing import AHEAD, DealError, DealRecord, DealtRange, covering, deal, held_through
from hypothesis import given, settings
from hypothesis import strategies as st


def test_a_unit_reads_its_ranges_in_order_and_a_second_unit_gets_what_nobody_holds() -> None:
    record = DealRecord()
    record, a0 = deal(record, "a", 0, 8)
    record, b0 = deal(record, "b", 0, 8)
    record, a1 = deal(record, "a", 8, 8)
    assert (a0.offset, a0.start) == (0, 0)
    assert (b0.offset, b0.start) == (0, 8)
    assert (a1.offset, a1.start) == (8, 16)
    assert record.next == 24


def test_the_same_position_gets_the_same_range_and_changes_nothing() -> None:
    record, first = deal(DealRecord(), "a", 3, 8)
    again, same = deal(record, "a", 5, 8)
    assert same == first
    assert again is record
    # a restarted unit asking with another size keeps the ranges it holds
    _, resized = deal(record, "a", 7, 16)
    assert resized == first


def test_a_position_past_the_ranges_deals_every_range_up_to_it() -> None:
    record, got = deal(DealRecord(), "a", 2 * 8 + 1, 8)
    assert [r.offset for r in record.units["a"]] == [0, 8, 16]
    assert got == record.units["a"][-1]
    assert got.stream(17) == 17


def test_a_unit_cannot_take_the_jobs_data_by_asking_far_ahead() -> None:
    record, _ = deal(DealRecord(), "a", 0, 8)
    with pytest.raises(DealError, match="may ask for positions"):
        deal(record, "a", 8 + AHEAD * 8, 8)
    with pytest.raises(DealError):
        deal(record, "a", -1, 8)
    with pytest.raises(DealError, match="a range holds"):
        deal(record, "a", 8, 0)


def test_a_resized_unit_keeps_its_ranges_and_takes_new_ones_of_its_new_size() -> None:
    record, _ = deal(DealRecord(), "a", 0, 8)
    record, _ = deal(record, "b", 0, 8)
    record, bigger = deal(record, "a", 8, 32)
    assert (bigger.offset, bigger.start, bigger.size) == (8, 16, 32)
    assert covering(record.units["a"], 7) == DealtRange(offset=0, start=0, size=8)
    assert covering(record.units["a"], 39) == bigger
    assert covering(record.units["a"], 40) is None


def test_the_record_survives_a_round_trip_through_json() -> None:
    record, _ = deal(DealRecord(), "a", 20, 8)
    assert DealRecord.model_validate_json(record.model_dump_json()) == record


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 3), st.sampled_from([4, 8, 12])),
        max_size=60,
    )
)
def test_no_stream_position_is_dealt_twice_however_units_come_and_go(
    steps: list[tuple[str, int, int]],
) -> None:
    """Units ask in any interleaving, jump ahead within the bound, change their range size (a resize),
    stop asking (removed) or start late (added): every stream position belongs to at most one unit, and
    each unit's ranges run contiguously from position 0 of its own sequence."""
    record = DealRecord()
    for unit, ahead, size in steps:
        position = held_through(record.units.get(unit, [])) + ahead * size // 2
        record, got = deal(record, unit, position, size)
        assert got.holds(position)
    owner: dict[int, str] = {}
    for unit, ranges in record.units.items():
        assert ranges[0].offset == 0
        assert all(r.offset + r.size == n.offset for r, n in itertools.pairwise(ranges))
        for r in ranges:
            for g in range(r.start, r.start + r.size):
                assert owner.setdefault(g, unit) == unit, f"stream position {g} dealt twice"
    assert sorted(owner) == list(range(record.next))  # and none left out between the ranges
