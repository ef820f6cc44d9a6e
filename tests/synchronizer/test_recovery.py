"""What a restart takes up of a committed version (``recovery.load_fragment``), on a real
filesystem store: a version served from memory with its parameters and outer state, a larger one
served from storage with no copy of its state, and not read at all when the manifest records its
size, so that a restart of a large model holds at most one fragment at a time."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
from diloco_core import downlink
from diloco_core.codec import encode_params
from diloco_core.fragments import build_plan
from diloco_core.layout import FragmentRecord
from diloco_core.outer import OuterState
from diloco_core.storage import FilesystemStore
from diloco_sync.merging import write_outer_state
from diloco_sync.persistence import StateStore
from diloco_sync.publication import Stored
from diloco_sync.recovery import load_fragment

PLAN = build_plan([("w", [64, 64])], 1, inner_steps=4, overlap=1)
SPEC = PLAN.fragments[0]
PARAMS = {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64)}
OUTER = OuterState(steps=2, momentum={"w": np.full((64, 64), 0.5, np.float32)})


def committed(tmp_path: Path, version: int, *, recorded: bool) -> tuple[StateStore, FragmentRecord, int]:
    """Version ``version`` of fragment 0 committed; its record (with its size where ``recorded``)."""
    state = StateStore(FilesystemStore(tmp_path), 0, "job")
    blob = encode_params(PARAMS, 0, version)
    record = FragmentRecord(
        version=version,
        params_key=state.layout.params(0, version),
        outer_key=state.layout.outer(0, version),
        params_bytes=len(blob) if recorded else None,
    )
    outer = partial(write_outer_state, state=OUTER, fragment=0, version=version)
    state.commit_version(0, record, params_blob=blob, outer=outer, round_log=None, count_round=True)
    return state, record, len(blob)


def test_a_version_within_the_memory_limit_is_taken_up_with_its_state(tmp_path: Path) -> None:
    state, record, size = committed(tmp_path, 3, recorded=True)
    loaded = load_fragment(state, SPEC, record, in_memory_bytes=size)
    assert loaded.params is not None
    assert loaded.outer is not None
    np.testing.assert_array_equal(loaded.params["w"], PARAMS["w"])
    assert OuterState.from_arrays(loaded.outer).steps == 2
    assert loaded.payload == state.read(record.params_key)
    assert loaded.initial_digest is None


def test_a_larger_version_whose_size_is_recorded_is_served_from_storage_unread(tmp_path: Path) -> None:
    state, record, size = committed(tmp_path, 3, recorded=True)
    for key in (record.params_key, record.outer_key):  # nothing to read: taking it up must not try
        assert key is not None
        state.delete(key)
    loaded = load_fragment(state, SPEC, record, in_memory_bytes=size - 1)
    assert (loaded.params, loaded.outer, loaded.payload) == (None, None, Stored(record.params_key, size))


def test_a_larger_version_of_an_older_manifest_is_read_once_and_let_go(tmp_path: Path) -> None:
    state, record, size = committed(tmp_path, 3, recorded=False)
    loaded = load_fragment(state, SPEC, record, in_memory_bytes=size - 1)
    assert (loaded.params, loaded.outer, loaded.payload) == (None, None, Stored(record.params_key, size))


def test_a_large_version_0_keeps_only_its_digest(tmp_path: Path) -> None:
    state, record, size = committed(tmp_path, 0, recorded=True)
    loaded = load_fragment(state, SPEC, record, in_memory_bytes=size - 1)
    assert (loaded.params, loaded.payload) == (None, Stored(record.params_key, size))
    assert loaded.initial_digest == downlink.digest(PARAMS)
