"""Where a fragment's parameters and outer state wait between rounds, and where a round reads them
back from: its local copy, or the committed objects (also tested with real processes in
``test_stored_version``)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from diloco_core import codec
from diloco_core.fragments import Fragment, build_plan
from diloco_core.outer import OuterState
from diloco_core.storage import FilesystemStore
from diloco_sync.held_state import HeldState, InStorage, copy_state, kept_in_storage, read_state
from diloco_sync.persistence import StateStore
from diloco_sync.publication import Stored
from diloco_sync.state_copy import StateCopy

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


def test_a_local_copy_goes_to_one_round_and_is_freed_by_a_new_version(tmp_path: Path) -> None:
    held = HeldState()
    first = StateCopy.write(tmp_path, {"params": PARAMS, "outer": OUTER.to_arrays()})
    held.hold(PARAMS, OUTER, Stored("params-key", 100), "outer-key")
    held.keep(first)
    at = held.for_round()
    assert at == InStorage("params-key", "outer-key", first)
    assert held.for_round() == InStorage("params-key", "outer-key")  # a failed round: the next reads storage
    second = StateCopy.write(tmp_path, {"params": PARAMS, "outer": OUTER.to_arrays()})
    held.hold(PARAMS, OUTER, Stored("params-key-2", 100), "outer-key-2")
    held.keep(second)
    held.hold(PARAMS, OUTER, Stored("params-key-3", 100), "outer-key-3")
    third = StateCopy.write(tmp_path, {"params": PARAMS, "outer": OUTER.to_arrays()})
    held.keep(third)
    held.hold(PARAMS, OUTER, b"served from memory", "outer-key-4")
    fourth = StateCopy.write(tmp_path, {"params": PARAMS, "outer": OUTER.to_arrays()})
    held.keep(fourth)
    assert (second.closed, third.closed, fourth.closed) == (True, True, True)  # no round will read them
    assert not first.closed  # the round it went to frees it
    first.close()


def _committed(tmp_path: Path) -> tuple[StateStore, Fragment, InStorage]:
    spec = build_plan([("w", [4])], 1, 4, 1).fragments[0]
    store = StateStore(FilesystemStore(tmp_path / "store"), 0, "job")
    store.store.put("params", codec.encode_params(PARAMS, 0, 1))
    outer = codec.encode(OUTER.to_arrays(), fragment=0, base_version=1, kind="params", quantizer="fp32")
    store.store.put("outer", outer)
    return store, spec, InStorage("params", "outer")


def _state_is(
    got: tuple[dict[str, np.ndarray], OuterState, str], params: dict[str, np.ndarray], source: str
) -> None:
    assert got[2] == source
    assert got[0].keys() == params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(got[0][name], value)
    assert got[1].steps == OUTER.steps
    np.testing.assert_array_equal(got[1].momentum["w"], OUTER.momentum["w"])


def test_a_round_reads_its_state_from_the_local_copy_and_frees_it(tmp_path: Path) -> None:
    store, spec, at = _committed(tmp_path)
    copied = {"w": np.full(4, 2, np.float32)}  # unlike the objects: shows which was read
    copy = StateCopy.write(tmp_path, {"params": copied, "outer": OUTER.to_arrays()})
    _state_is(read_state(store, spec, replace(at, copy=copy)), copied, "local copy")
    assert copy.closed
    _state_is(read_state(store, spec, replace(at, copy=copy)), PARAMS, "storage")  # a retry reads storage
    _state_is(read_state(store, spec, at), PARAMS, "storage")


def test_a_local_copy_that_cannot_be_read_back_leaves_the_round_to_the_objects(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, spec, at = _committed(tmp_path)
    copy = StateCopy.write(tmp_path, {"params": {"w": np.full(4, 2, np.float32)}, "outer": OUTER.to_arrays()})
    assert copy._file is not None
    os.ftruncate(copy._file.fileno(), 8)
    _state_is(read_state(store, spec, replace(at, copy=copy)), PARAMS, "storage")
    assert copy.closed
    assert "its local copy cannot be read" in caplog.text


def test_a_copy_that_cannot_be_made_is_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_bytes(b"")
    assert copy_state(tmp_path / "file", PARAMS, OUTER) is None
    assert copy_state(tmp_path, {"w": np.zeros(4)}, OUTER) is None  # not float32: never raised after a commit
    assert "cannot be written" in caplog.text
    made = copy_state(tmp_path, PARAMS, OUTER)
    assert made is not None
    made.close()
