"""Where a fragment's parameters and outer state wait between rounds: the pure part (the objects a
round reads them back from are tested with real processes in ``test_stored_version``)."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core.outer import OuterState
from diloco_sync.held_state import HeldState, InStorage, kept_in_storage
from diloco_sync.publication import Stored

PARAMS = {"w": np.ones(4, np.float32)}
OUTER = OuterState(steps=3, momentum={"w": np.zeros(4, np.float32)})


def test_a_version_served_from_memory_keeps_its_state_in_memory() -> None:
    assert kept_in_storage(b"payload", "outer-key") is None
    held = HeldState()
    held.hold(PARAMS, OUTER, b"payload", "outer-key")
    assert (held.params, held.outer, held.in_storage) == (PARAMS, OUTER, None)
    assert held.for_round() == (PARAMS, OUTER)


def test_a_version_served_from_storage_lets_its_state_go() -> None:
    at = InStorage("params-key", "outer-key")
    assert kept_in_storage(Stored("params-key", 100), "outer-key") == at
    held = HeldState()
    held.hold(PARAMS, OUTER, Stored("params-key", 100), "outer-key")
    assert (held.params, held.in_storage, held.for_round()) == (None, at, at)
    with pytest.raises(RuntimeError, match="in storage"):
        _ = held.outer
    held.hold(PARAMS, OUTER, b"smaller again", "outer-key")  # a later version in memory
    assert held.for_round() == (PARAMS, OUTER)


def test_before_the_initial_parameters_only_a_fresh_outer_state_is_held() -> None:
    held = HeldState()
    assert (held.params, held.outer) == (None, OuterState())
    with pytest.raises(RuntimeError, match="no parameters"):
        held.for_round()


def test_a_version_served_from_memory_cannot_be_held_without_its_parameters() -> None:
    held = HeldState()
    held.hold(None, OUTER, Stored("params-key", 100), "outer-key")  # a restart's large version, unread
    assert held.for_round() == InStorage("params-key", "outer-key")
    with pytest.raises(ValueError, match="needs its parameters"):
        held.hold(None, OUTER, b"payload", "outer-key")
