"""Large files past the page cache: the same bytes as a plain write and read, at every boundary of a
block and of the staging block, and the same file where the filesystem refuses ``O_DIRECT``."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from diloco_core import direct_io
from diloco_core.direct_io import ALIGN, STAGE_BYTES, DirectWriter, open_direct, read_direct

SIZES = [
    0,
    1,
    ALIGN - 1,
    ALIGN,
    ALIGN + 1,
    STAGE_BYTES - 1,
    STAGE_BYTES,
    STAGE_BYTES + 1,
    2 * STAGE_BYTES + 123,
]


def _pieces(data: bytes, seed: int) -> list[bytes | memoryview]:
    """``data`` cut at random places, some pieces as memoryviews of other formats (float32)."""
    rng = np.random.default_rng(seed)
    out: list[bytes | memoryview] = []
    at = 0
    while at < len(data):
        n = int(rng.integers(1, 3 * ALIGN)) if rng.random() < 0.7 else int(rng.integers(1, 2 * STAGE_BYTES))
        piece = data[at : at + n]
        if len(piece) % 4 == 0 and rng.random() < 0.3:
            out.append(memoryview(np.frombuffer(piece, np.float32)))
        else:
            out.append(piece)
        at += n
    return out


def _write(path: Path, pieces: list[bytes | memoryview]) -> DirectWriter:
    plain = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    direct = open_direct(path, os.O_WRONLY)
    writer = DirectWriter(direct, plain)
    try:
        for piece in pieces:
            writer.write(piece)
        writer.finish()
    finally:
        writer.close()
        os.close(plain)
        if direct is not None:
            os.close(direct)
    return writer


def _takes_direct(folder: Path) -> bool:
    fd = open_direct(folder / ".probe", os.O_WRONLY | os.O_CREAT)
    if fd is not None:
        os.close(fd)
    return fd is not None


@pytest.mark.parametrize("size", SIZES)
def test_a_direct_file_has_exactly_the_bytes_written_and_reads_back_the_same(
    tmp_path: Path, size: int
) -> None:
    data = os.urandom(size)
    writer = _write(tmp_path / "f", _pieces(data, size))
    assert writer.size == size
    assert writer.direct == _takes_direct(tmp_path)  # never fell back on a filesystem that takes it
    assert (tmp_path / "f").read_bytes() == data
    got = read_direct(tmp_path / "f")
    if _takes_direct(tmp_path):
        assert got is not None
        assert got.readonly
        assert bytes(got) == data
        assert got.nbytes == size


def test_a_filesystem_that_refuses_direct_writes_midway_gets_the_rest_plainly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that opens a file with ``O_DIRECT`` but refuses the writes cannot be had on the
    test machine's filesystems: ``os.pwrite`` refuses the direct descriptor's second block here."""
    if not _takes_direct(tmp_path):
        pytest.skip("this filesystem does not take O_DIRECT at all")
    real_pwrite, direct_fds, blocks = os.pwrite, set(), [0]
    real_open_direct = direct_io.open_direct

    def remembered(path: str | Path, flags: int) -> int | None:
        fd = real_open_direct(path, flags)
        direct_fds.add(fd)
        return fd

    def refusing(fd: int, data: bytes | memoryview, offset: int) -> int:
        if fd in direct_fds:
            blocks[0] += 1
            if blocks[0] >= 2:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_io, "open_direct", remembered)
    monkeypatch.setattr(os, "pwrite", refusing)
    data = os.urandom(3 * STAGE_BYTES + 5)
    plain = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    writer = DirectWriter(direct_io.open_direct(tmp_path / "f", os.O_WRONLY), plain)
    for piece in _pieces(data, 7):
        writer.write(piece)
    writer.finish()
    assert not writer.direct
    assert (tmp_path / "f").read_bytes() == data


def test_a_filesystem_that_refuses_direct_io_at_open_is_read_and_written_plainly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a filesystem without ``O_DIRECT`` answers ``open`` (EINVAL); not every test machine has one."""
    real_open = os.open

    def refusing(path: str | Path, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    assert open_direct(tmp_path / "f", os.O_WRONLY | os.O_CREAT) is None
    data = os.urandom(STAGE_BYTES + 99)
    writer = _write(tmp_path / "f", _pieces(data, 3))
    assert not writer.direct
    assert (tmp_path / "f").read_bytes() == data
    assert read_direct(tmp_path / "f") is None


def test_a_missing_file_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_direct(tmp_path / "missing")


def test_a_patch_outside_what_was_written_is_refused(tmp_path: Path) -> None:
    plain = os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT, 0o600)
    direct = open_direct(tmp_path / "g", os.O_WRONLY)
    writer = DirectWriter(direct, plain)
    writer.write(b"abc")
    with pytest.raises(ValueError, match="outside"):
        writer.patch(2, b"xy")
    writer.patch(1, b"B")
    writer.finish()
    writer.close()
    for fd in (plain, direct):
        if fd is not None:
            os.close(fd)
    assert (tmp_path / "g").read_bytes() == b"aBc"


def test_writers_at_once_in_one_thread_or_many_never_share_a_staging_block(tmp_path: Path) -> None:
    """Uploads written piece by piece from whichever worker thread is free (request bodies): each
    file gets its own bytes."""
    import concurrent.futures

    datas = [os.urandom(2 * STAGE_BYTES + 1000 * i + 1) for i in range(6)]
    plains = [os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600) for i in range(6)]
    directs = [open_direct(tmp_path / f"f{i}", os.O_WRONLY) for i in range(6)]
    writers = [DirectWriter(d, p) for d, p in zip(directs, plains, strict=True)]
    piece = 1_000_003
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for start in range(0, max(len(d) for d in datas), piece):  # interleaved, on any thread
            list(pool.map(lambda w, d: w.write(d[start : start + piece]), writers, datas))
    for writer in writers:
        writer.finish()
        writer.close()
    for fd in [*plains, *directs]:
        if fd is not None:
            os.close(fd)
    for i, data in enumerate(datas):
        assert (tmp_path / f"f{i}").read_bytes() == data
