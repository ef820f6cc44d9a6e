"""A fragment's state kept in a local file between rounds: read back bit for bit, and refused (as
``OSError``, after which a round reads the committed objects) when it is not what was written."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from diloco_core import direct_io
from diloco_sync.state_copy import StateCopy, layout

GROUPS = {
    "params": {"b": np.arange(5, dtype=np.float32), "a": np.full((3, 4), np.nan, np.float32)},
    "outer": {
        "momentum/a": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
        "__step__": np.ones(1, np.float32),
    },
}


def _same(got: dict[str, dict[str, np.ndarray]], want: dict[str, dict[str, np.ndarray]]) -> None:
    assert got.keys() == want.keys()
    for group, arrays in want.items():
        assert list(got[group]) == list(arrays)
        for name, value in arrays.items():
            assert got[group][name].dtype == np.float32
            assert got[group][name].shape == value.shape
            assert got[group][name].tobytes() == value.tobytes()  # bit for bit, NaN included


def test_the_state_reads_back_bit_for_bit_and_the_file_has_no_name(tmp_path: Path, direct: bool) -> None:
    copy = StateCopy.write(tmp_path, GROUPS)
    assert list(tmp_path.iterdir()) == []  # unnamed: a crash leaves nothing behind
    assert copy.nbytes == sum(a.nbytes for arrays in GROUPS.values() for a in arrays.values())
    got = copy.read()
    _same(got, GROUPS)
    got["params"]["b"][0] = 7  # new arrays, the caller's to change
    _same(copy.read(), GROUPS)
    copy.close()
    copy.close()
    assert copy.closed
    with pytest.raises(OSError, match="closed"):
        copy.read()


def test_the_arrays_lie_one_after_another_in_the_order_given() -> None:
    placed = layout(GROUPS)
    assert [(g, n, o) for g, n, _, o in placed] == [
        ("params", "b", 0),
        ("params", "a", 20),
        ("outer", "momentum/a", 68),
        ("outer", "__step__", 116),
    ]
    strided = {"params": {"w": np.arange(8, dtype=np.float32)[::2]}}
    assert layout(strided)[0][2].flags.c_contiguous
    with pytest.raises(TypeError, match="float64"):
        layout({"params": {"w": np.zeros(2)}})


@pytest.fixture(params=["direct", "page-cache"])
def direct(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Written and read past the page cache, or through it as where the filesystem refuses
    ``O_DIRECT`` (as ``direct_io.open_direct`` says then)."""
    if request.param == "page-cache":
        monkeypatch.setattr(direct_io, "open_direct", lambda path, flags: None)
    return request.param == "direct"


def test_a_copy_whose_bytes_changed_or_that_ends_early_is_refused(tmp_path: Path, direct: bool) -> None:
    copy = StateCopy.write(tmp_path, GROUPS)
    assert copy._file is not None
    fd = copy._file.fileno()
    os.pwrite(fd, b"\x01", 21)  # a byte of params/a
    with pytest.raises(OSError, match="params/a in the state's local copy is not what was written"):
        copy.read()
    os.ftruncate(fd, 30)  # within params/a
    short = "holds 30 bytes, not the 120 written" if direct else "ends at 30, before its last array"
    with pytest.raises(OSError, match=short):
        copy.read()
    copy.close()


def test_a_copy_that_cannot_be_written_leaves_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(OSError):
        StateCopy.write(blocker / "below", GROUPS)  # a folder that cannot be made
