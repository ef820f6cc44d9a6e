"""Objects written as their bytes arrive: a request body goes to a file, not into memory.

An ``Upload`` takes the bytes of one object piece by piece (``write``), lets them be read back
without a copy once all have arrived (``view``: a read-only memory map of the file), lets a part
already written be filled in (``patch``: a head known only once the rest is checked), then either
stores them under the object's key at once (``commit``) or throws them away (``discard``).

- ``FileUpload`` writes a temporary file. The filesystem store makes it in the object's own folder
  and commits it by ``fsync``, a rename and an ``fsync`` of the folder (``sync_folder``: the object
  appears whole or not at all, survives a power loss once committed, and its bytes are written
  once); the S3 store makes it in a local folder and commits it by uploading the file in
  parts (``s3_transfer.upload_file``), so a body larger than memory is never held in memory.
- ``FileUpload(direct=True)`` writes its file past the page cache (``direct_io``): for an object
  that is only stored, never viewed through its upload (a commit's large objects).
- ``MemoryUpload`` holds the bytes in memory and commits them with the store's ``put``: for a store
  that cannot make a file, and while storage is down.

Temporary files a crash leaves behind are named ``UPLOAD_PREFIX*``, wherever objects are written
(pending contributions, parameters, outer state); ``sweep`` removes them under a folder, and a
store's ``sweep_uploads`` under a prefix whose one writer is starting (the state store sweeps its
whole shard). A file's failures (a full disk) are ``OSError``; its ``discard`` never fails.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from diloco_core import direct_io

UPLOAD_PREFIX = ".tmp-"
LOCAL_SPOOL = Path(
    tempfile.gettempdir(), "diloco-uploads"
)  # uploads written locally before they go elsewhere
_WRITE_BUFFER = 1 << 20  # bytes gathered before a write to the file


class Upload(Protocol):
    size: int

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def view(self) -> memoryview: ...

    def patch(self, offset: int, data: bytes) -> None: ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...


class FileUpload:
    """An object's bytes in a temporary file in ``folder``; ``store`` makes it the object, by reading
    it or by moving it into place (``moved``); the file is removed afterwards unless moved."""

    def __init__(self, folder: Path, store: Callable[[FileUpload], None], *, direct: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=UPLOAD_PREFIX, dir=folder)
        self.path = Path(name)
        self.size = 0
        self._store = store
        self._map: mmap.mmap | None = None
        self.moved = False  # set by a store that made the file itself the object (renamed it)
        self._done = False
        self._direct_fd: int | None = None
        self._direct: direct_io.DirectWriter | None = None
        try:
            self.file = os.fdopen(fd, "w+b", buffering=_WRITE_BUFFER)  # owns ``fd``, closed with it
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        try:
            # ``direct``: written past the page cache where the filesystem takes it (never viewed)
            self._direct_fd = direct_io.open_direct(self.path, os.O_WRONLY) if direct else None
            if self._direct_fd is not None:
                self._direct = direct_io.DirectWriter(self._direct_fd, fd)
        except BaseException:  # out of descriptors or memory: neither a descriptor nor the file is kept
            self.discard()
            raise

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._direct is not None:
            self._direct.write(data)
            self.size = self._direct.size
            return
        self.file.write(data)
        self.size += len(data)

    def view(self) -> memoryview:
        if self._direct is not None:
            raise RuntimeError(f"{self.path} is written past the page cache: it is not read back")
        self.file.flush()
        if self.size == 0:
            return memoryview(b"")
        if self._map is None:
            self._map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(self._map)

    def patch(self, offset: int, data: bytes) -> None:
        if self._direct is not None:
            self._direct.patch(offset, data)
            return
        self.file.flush()
        written = os.pwrite(self.file.fileno(), data, offset)
        if written != len(data):
            raise OSError(f"{written} of {len(data)} bytes written at {offset} of {self.path}")

    def commit(self) -> None:
        """Store the object (a failure raises and leaves the file as it is, to read or discard)."""
        if self._direct is not None:
            self._direct.finish()
        self.file.flush()
        self._unmap()
        self._store(self)
        self.discard()

    def discard(self) -> None:
        """Close and remove the file (nothing once committed or discarded); never fails: bytes the
        file could not take are thrown away with it."""
        self._unmap()
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self._direct_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._direct_fd)
            self._direct_fd = None
        try:
            self.file.close()
        except OSError:
            pass
        finally:
            if not (self._done or self.moved):
                self._done = True
                with contextlib.suppress(OSError):
                    self.path.unlink(missing_ok=True)

    def _unmap(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held: closed when it is let go
                self._map.close()
            self._map = None


class MemoryUpload:
    """An object's bytes in memory; ``put`` stores them."""

    def __init__(self, put: Callable[[bytearray], None]) -> None:
        self.data = bytearray()
        self.size = 0
        self._put = put
        self._discarded = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.data += data
        self.size += len(data)

    def view(self) -> memoryview:
        return memoryview(self.data).toreadonly()

    def patch(self, offset: int, data: bytes) -> None:
        self.data[offset : offset + len(data)] = data

    def commit(self) -> None:
        """Store the bytes; ValueError once discarded (as a ``FileUpload``'s closed file)."""
        if self._discarded:
            raise ValueError("commit of a discarded upload")
        self._put(self.data)

    def discard(self) -> None:
        self.data = bytearray()
        self._discarded = True


@contextlib.contextmanager
def reading(upload: Upload, start: int = 0) -> Iterator[memoryview]:
    """The upload's bytes from ``start``, read in place. On leaving, the views are let go, and an
    exception raised while reading forgets the views its traceback holds, so the file is unmapped."""
    view = upload.view()
    part = view[start:]
    try:
        yield part
    except BaseException as exc:
        forget_frames(exc)
        raise
    finally:
        release(part, view)


def release(*views: memoryview) -> None:
    """Let go of views of an upload; one still read elsewhere is let go with its last reader."""
    for view in views:
        with contextlib.suppress(BufferError):
            view.release()


def forget_frames(exc: BaseException) -> None:
    """Clear the variables of the finished frames an exception (and those it was raised from) holds,
    so that views of an upload they read are let go with them."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def sync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` durable (a file renamed or made in it): ``fsync`` of the folder."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_folders(folder: Path) -> None:
    """``folder`` and its missing parents, each made durable in its parent (``sync_folder``)."""
    missing: list[Path] = []
    at = folder
    while not at.is_dir() and at != at.parent:
        missing.append(at)
        at = at.parent
    folder.mkdir(parents=True, exist_ok=True)
    for made in reversed(missing):
        sync_folder(made.parent)


def sweep(folder: Path, idle_s: float, now: float | None = None) -> int:
    """Remove the upload files under ``folder`` not written to for ``idle_s`` seconds (left by a
    process that died while receiving them); returns how many."""
    now = time.time() if now is None else now
    removed = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(dirpath, name)
            if not name.startswith(UPLOAD_PREFIX):
                continue
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > idle_s:
                    path.unlink()
                    removed += 1
    return removed
