"""Objects written as their bytes arrive: a file read back in place, filled in, stored or thrown away."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from diloco_core import direct_io
from diloco_core.uploads import (
    UPLOAD_PREFIX,
    FileUpload,
    MemoryUpload,
    make_folders,
    reading,
    release,
    sweep,
)


def _moved_to(target: Path) -> tuple[list[bytes], Callable[[FileUpload], None]]:
    stored: list[bytes] = []

    def store(upload: FileUpload) -> None:
        os.replace(upload.path, target)
        stored.append(target.read_bytes())

    return stored, store


def test_a_file_upload_is_read_in_place_filled_in_and_stored_by_its_commit(tmp_path: Path) -> None:
    stored, store = _moved_to(tmp_path / "object.bin")
    upload = FileUpload(tmp_path / "folder", store)
    assert upload.path.parent == tmp_path / "folder"
    assert upload.path.name.startswith(UPLOAD_PREFIX)
    for piece in (b"HEAD", b"-" * 3_000_000, b"tail"):  # more than the write buffer
        upload.write(piece)
    assert upload.size == 3_000_008
    view = upload.view()
    assert bytes(view[:4]) == b"HEAD"
    assert bytes(view[-4:]) == b"tail"
    upload.patch(0, b"head")
    assert bytes(view[:4]) == b"head"  # the map sees the file
    release(view)
    upload.commit()
    assert stored == [b"head" + b"-" * 3_000_000 + b"tail"]
    assert os.listdir(tmp_path / "folder") == []


def test_a_discarded_upload_leaves_nothing_even_while_a_view_of_it_is_held(tmp_path: Path) -> None:
    upload = FileUpload(tmp_path, lambda u: None)
    upload.write(b"abc")
    view = upload.view()
    held = view[1:]
    upload.discard()
    assert list(tmp_path.iterdir()) == []
    assert bytes(held) == b"bc"  # still readable until let go
    upload.discard()  # again: nothing


def test_a_commit_that_fails_keeps_the_file_to_read_again(tmp_path: Path) -> None:
    def failing(upload: FileUpload) -> None:
        raise OSError("storage down")

    upload = FileUpload(tmp_path, failing)
    upload.write(b"payload")
    with pytest.raises(OSError, match="storage down"):
        upload.commit()
    assert bytes(upload.view()) == b"payload"
    upload.discard()
    assert list(tmp_path.iterdir()) == []


def test_an_empty_upload_has_an_empty_view(tmp_path: Path) -> None:
    upload = FileUpload(tmp_path, lambda u: None)
    assert bytes(upload.view()) == b""
    upload.discard()


def test_a_memory_upload_is_filled_in_and_put_whole() -> None:
    put: list[bytes] = []
    upload = MemoryUpload(lambda data: put.append(bytes(data)))
    upload.write(b"HEAD")
    upload.write(b"body")
    view = upload.view()
    assert bytes(view) == b"HEADbody"
    assert view.readonly
    upload.patch(0, b"head")
    release(view)
    upload.commit()
    assert put == [b"headbody"]
    assert upload.size == 8


def test_a_discarded_upload_cannot_be_committed(tmp_path: Path) -> None:
    put: list[bytes] = []
    memory = MemoryUpload(lambda data: put.append(bytes(data)))
    memory.write(b"body")
    memory.discard()
    with pytest.raises(ValueError):
        memory.commit()
    assert put == []
    stored, store = _moved_to(tmp_path / "object.bin")
    file = FileUpload(tmp_path, store)
    file.write(b"body")
    file.discard()
    with pytest.raises(ValueError):
        file.commit()
    assert stored == []


def test_a_sweep_removes_only_upload_files_idle_for_long_enough(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    old, fresh, other = (
        tmp_path / "a" / f"{UPLOAD_PREFIX}old",
        tmp_path / f"{UPLOAD_PREFIX}new",
        tmp_path / "x.bin",
    )
    for path in (old, fresh, other):
        path.write_bytes(b"1")
    now = time.time()
    os.utime(old, (now - 7200, now - 7200))
    assert sweep(tmp_path, idle_s=3600, now=now) == 1
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted([fresh.name, other.name])
    assert sweep(tmp_path, idle_s=0.0, now=now + 1) == 1
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [other.name]
    assert sweep(tmp_path / "missing", idle_s=0.0) == 0


_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from diloco_core.uploads import FileUpload

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
upload = FileUpload(Path(sys.argv[1]), lambda u: None)
try:
    upload.write(b"x" * (3 << 20))
    upload.view()
except OSError as exc:
    print("refused", exc.errno)
upload.write(b"y" * 1000)  # the rest of the body, which the file cannot take either
upload.discard()
print("discarded")
"""


def test_a_file_that_cannot_take_its_bytes_fails_and_its_discard_still_removes_it(tmp_path: Path) -> None:
    """A real failure to write (the process's file size limit, as a full disk answers): the write
    raises, and the discard neither raises nor leaves the file."""
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused", str(errno.EFBIG), "discarded"]
    assert list(tmp_path.iterdir()) == []


def test_a_refusal_forgets_the_views_its_traceback_held_so_the_file_is_unmapped(tmp_path: Path) -> None:
    upload = FileUpload(tmp_path, lambda u: None)
    upload.write(b"not a payload")

    def check(blob: memoryview) -> None:
        frame = blob[4:]  # a reader's own view, kept by the traceback of what it raises
        raise ValueError(f"bad payload of {len(frame)} bytes")

    with pytest.raises(ValueError, match="bad payload of 5 bytes") as raised, reading(upload, 4) as payload:
        check(payload)
    assert raised.tb is not None  # held, as a worker thread holds what it raised until its next job
    assert upload._map is not None
    upload._map.close()  # no view of it is left
    upload._map = None
    upload.discard()


def test_a_direct_upload_is_only_stored_never_read_back_through_it(tmp_path: Path) -> None:
    stored, store = _moved_to(tmp_path / "object.bin")
    upload = FileUpload(tmp_path / "folder", store, direct=True)
    data = os.urandom(5 << 20)
    for start in range(0, len(data), 1_000_003):
        upload.write(data[start : start + 1_000_003])
    assert upload.size == len(data)
    with pytest.raises(RuntimeError, match="not read back"):
        upload.view()
    upload.patch(0, b"head")  # in the file already
    upload.patch(len(data) - 3, b"end")  # still staged
    upload.patch((4 << 20) - 2, b"edge")  # across the two
    upload.commit()
    assert stored == [b"head" + data[4 : (4 << 20) - 2] + b"edge" + data[(4 << 20) + 2 : -3] + b"end"]
    assert os.listdir(tmp_path / "folder") == []
    dropped = FileUpload(tmp_path / "folder", store, direct=True)
    dropped.write(data)
    dropped.discard()
    assert os.listdir(tmp_path / "folder") == []


def _descriptors_to(folder: Path) -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return [t for t in targets if t.startswith(str(folder))]


_OUT_OF_DESCRIPTORS = """
import os, resource, sys
from pathlib import Path
from diloco_core.uploads import FileUpload

folder = Path(sys.argv[1])
folder.mkdir()
lowest = os.dup(0)  # the lowest free descriptor, which the temporary file takes
os.close(lowest)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (lowest + 1, hard))
try:
    FileUpload(folder, lambda u: None, direct=True)  # its direct descriptor is one too many
except OSError as exc:
    print("refused", exc.errno)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
left = []
for fd in os.listdir("/proc/self/fd"):
    try:
        left.append(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
print("open", sum(t.startswith(str(folder)) for t in left))
"""


def test_an_upload_that_cannot_open_its_direct_descriptor_leaves_no_descriptor_nor_file(
    tmp_path: Path,
) -> None:
    """A real refusal (the process's descriptor limit, one descriptor short): the upload raises and
    keeps neither its temporary file's descriptor nor the file."""
    done = subprocess.run(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(tmp_path / "folder")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused", str(errno.EMFILE), "open", "0"]
    assert list((tmp_path / "folder").iterdir()) == []


def test_an_upload_without_memory_for_its_staging_block_leaves_no_descriptor_nor_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct writer's staging block refused (ENOMEM from its ``mmap``). An out-of-memory
    ``mmap`` cannot be had on demand without starving the whole process, so the writer is replaced
    by one that fails as it would."""

    def out_of_memory(direct_fd: int | None, plain_fd: int) -> direct_io.DirectWriter:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(direct_io, "DirectWriter", out_of_memory)
    folder = tmp_path / "folder"
    with pytest.raises(OSError) as refused:
        FileUpload(folder, lambda u: None, direct=True)
    assert refused.value.errno == errno.ENOMEM
    assert _descriptors_to(folder) == []
    assert list(folder.iterdir()) == []


def test_folders_are_made_with_their_missing_parents(tmp_path: Path) -> None:
    make_folders(tmp_path / "a" / "b" / "c")
    assert (tmp_path / "a" / "b" / "c").is_dir()
    make_folders(tmp_path / "a" / "b")  # already there
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b"]
