"""The learner's token from a file: re-read when the file changes, as the kubelet swaps a mounted
Secret (a new folder, then the ``..data`` link moved over), and kept while the file is away."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from diloco_worker.credentials import TokenSource


def _swap(mount: Path, token: str, n: int) -> None:
    """What the kubelet does to a Secret volume: write a new timestamped folder, point ``..data``
    at it with an atomic rename; ``token`` is a link to ``..data/token``."""
    folder = mount / f"..2026_{n}"
    folder.mkdir()
    (folder / "token").write_text(token + "\n")
    tmp = mount / "..data_tmp"
    tmp.symlink_to(folder.name)
    os.replace(tmp, mount / "..data")
    if not (mount / "token").is_symlink():
        (mount / "token").symlink_to("..data/token")


def test_a_renewed_token_is_used_from_the_next_request(tmp_path: Path) -> None:
    _swap(tmp_path, "first", 1)
    source = TokenSource(path=str(tmp_path / "token"))
    assert source.current() == "first"
    _swap(tmp_path, "second-token", 2)
    assert source.current() == "second-token"
    (tmp_path / "..data").unlink()  # between the kubelet's swaps: the token held stays
    assert source.current() == "second-token"


def test_a_missing_or_empty_file_at_start_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the learner token file"):
        TokenSource(path=str(tmp_path / "absent"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        TokenSource(path=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="exactly one"):
        TokenSource()
    assert TokenSource("given").current() == "given"


def test_waiting_for_a_renewed_token(tmp_path: Path) -> None:
    _swap(tmp_path, "refused", 1)
    source = TokenSource(path=str(tmp_path / "token"))
    assert not source.wait_for_new("refused", timeout_s=0.0)
    _swap(tmp_path, "renewed", 2)
    assert source.wait_for_new("refused", timeout_s=5.0)
    assert not TokenSource("given").wait_for_new("given", timeout_s=5.0)  # a given token never changes
