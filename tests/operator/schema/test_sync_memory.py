"""The synchronizer's memory budgets from the spec and its memory limit; a spec whose budgets cannot
fit in its limit is refused with what to change."""

from __future__ import annotations

import pytest
from diloco_operator.schema.spec import SpecError, parse_spec
from diloco_operator.schema.sync_memory import BASE_BYTES, Budgets, SynchronizerMemory, budgets

GI, MI = 2**30, 2**20


def test_without_a_limit_only_what_the_spec_sets_is_given() -> None:
    assert budgets(None, None) == Budgets()
    memory = SynchronizerMemory(rounds="20Gi", served_in_memory=0)
    assert budgets(memory, None) == Budgets(rounds=20 * GI, served_in_memory=0)


def test_a_limit_gives_each_unset_budget_its_share_of_the_room_above_the_floor() -> None:
    room = 16 * GI - BASE_BYTES
    left = room - 2 * (room // 3) - 64 * MI
    assert budgets(None, 16 * GI) == Budgets(
        rounds=room // 3, served_in_memory=64 * MI, outage_buffer=room // 3, pending=left
    )
    small = 512 * MI - BASE_BYTES
    small_left = small - 2 * (small // 3) - small // 8
    assert budgets(None, 512 * MI) == Budgets(small // 3, small // 8, small // 3, small_left)  # an eighth
    set_rounds = budgets(SynchronizerMemory(rounds="10Gi"), 16 * GI)
    assert (set_rounds.rounds, set_rounds.outage_buffer) == (10 * GI, room // 3)
    assert set_rounds.pending == room - 10 * GI - room // 3 - 64 * MI  # what the others leave


def test_the_pending_contributions_take_what_the_others_leave_or_what_the_spec_sets() -> None:
    room = 8 * GI - BASE_BYTES
    all_taken = SynchronizerMemory(rounds="4Gi", outage_buffer=room - 4 * GI - 64 * MI)
    assert budgets(all_taken, 8 * GI).pending == 0  # one contribution per learner and fragment at a time
    given = budgets(SynchronizerMemory(pending="2Gi"), 8 * GI)
    assert (given.pending, given.settings()["pending_memory_bytes"]) == (2 * GI, 2 * GI)
    with pytest.raises(ValueError, match=r"pending \(8,589,934,592 B\)"):
        budgets(SynchronizerMemory(pending="8Gi"), 8 * GI)


def test_budgets_that_do_not_fit_in_the_limit_are_refused_with_their_sizes() -> None:
    with pytest.raises(ValueError, match=r"rounds \(12,884,901,888 B\).*raise the limit"):
        budgets(SynchronizerMemory(rounds="12Gi"), 16 * GI)
    with pytest.raises(ValueError, match="is not above the 256 Mi"):
        budgets(None, 200 * MI)


def test_the_spec_refuses_budgets_beyond_the_limit_and_a_bad_quantity_by_their_fields() -> None:
    base = {
        "images": {"worker": "w", "synchronizer": "s"},
        "storage": {"bucket": "diloco"},
        "learnerUnits": [{"name": "a"}],
    }
    too_much = {"resources": {"limits": {"memory": "4Gi"}}, "memory": {"outageBuffer": "4Gi"}}
    with pytest.raises(SpecError, match="synchronizer.memory: rounds"):
        parse_spec(base | {"synchronizer": too_much})
    with pytest.raises(SpecError, match="synchronizer.memory.rounds: 'lots' is not a quantity"):
        parse_spec(base | {"synchronizer": {"memory": {"rounds": "lots"}}})
    spec = parse_spec(base | {"synchronizer": {"resources": {"limits": {"memory": "4Gi"}}}})
    assert spec.synchronizer.memory_budgets.rounds == (4 * GI - BASE_BYTES) // 3
