"""Objects as files under a folder (``diloco_core.storage``'s filesystem store)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from diloco_core import direct_io
from diloco_core.storage_errors import ObjectNotFound, StorageError, StorageUnavailable, check_key
from diloco_core.uploads import UPLOAD_PREFIX, FileUpload, Upload, make_folders, sweep, sync_folder


class FilesystemStore:
    """Objects as files under ``root``; writes go to a temporary file renamed into place (atomic),
    then the folder is synced (durable)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            make_folders(self.root)
        except OSError as exc:
            raise StorageError(f"cannot create storage folder {self.root}: {exc}") from exc

    def describe(self) -> str:
        return f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ObjectNotFound(key) from exc
        except OSError as exc:
            raise StorageUnavailable(f"reading {key}: {exc}") from exc

    def get_view(self, key: str) -> memoryview:
        """A large object read past the page cache (where the filesystem takes it), a small one as ``get``."""
        path = self._path(key)
        try:
            if path.stat().st_size >= direct_io.DIRECT_MIN_BYTES:
                got = direct_io.read_direct(path)
                if got is not None:
                    return got
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ObjectNotFound(key) from exc
        except OSError as exc:
            raise StorageUnavailable(f"reading {key}: {exc}") from exc
        return memoryview(self.get(key)).toreadonly()

    def read_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with self._path(key).open("rb") as fh:
                fh.seek(start)
                return fh.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ObjectNotFound(key) from exc
        except OSError as exc:
            raise StorageUnavailable(f"reading {key}: {exc}") from exc

    def put(self, key: str, data: bytes | bytearray) -> None:
        if len(data) >= direct_io.DIRECT_MIN_BYTES:  # written past the page cache
            upload = self.open_upload(key, read_back=False)
            try:
                upload.write(data)
                upload.commit()
            except OSError as exc:
                raise StorageUnavailable(f"writing {key}: {exc}") from exc
            finally:
                upload.discard()
            return
        path = self._path(key)
        try:
            make_folders(path.parent)
            fd, tmp = tempfile.mkstemp(prefix=UPLOAD_PREFIX, dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            sync_folder(path.parent)
        except OSError as exc:
            raise StorageUnavailable(f"writing {key}: {exc}") from exc

    def open_upload(self, key: str, *, read_back: bool = True) -> Upload:
        """A temporary file in the object's folder, renamed into place once written and synced;
        without ``read_back``, written past the page cache (``direct_io``)."""
        path = self._path(key)

        def store(upload: FileUpload) -> None:
            try:
                os.fsync(upload.file.fileno())
                os.replace(upload.path, path)
                upload.moved = True
                sync_folder(path.parent)
            except OSError as exc:
                raise StorageUnavailable(f"writing {key}: {exc}") from exc

        try:
            make_folders(path.parent)
            return FileUpload(path.parent, store, direct=not read_back)
        except OSError as exc:
            raise StorageUnavailable(f"writing {key}: {exc}") from exc

    def sweep_uploads(self, prefix: str) -> int:
        """Every upload file in the folder of ``prefix`` and below (``""``: the whole store; a file
        ``list`` never shows): its one writer is starting, so none is in progress."""
        folder = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        return sweep(folder, idle_s=0.0)

    def list(self, prefix: str = "") -> list[str]:
        keys: list[str] = []
        try:
            for dirpath, _dirs, files in os.walk(self.root):
                for name in files:
                    if name.startswith(UPLOAD_PREFIX):
                        continue
                    key = Path(dirpath, name).relative_to(self.root).as_posix()
                    if key.startswith(prefix):
                        keys.append(key)
        except OSError as exc:
            raise StorageUnavailable(f"listing {prefix!r}: {exc}") from exc
        return sorted(keys)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise StorageUnavailable(f"deleting {key}: {exc}") from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def remove_empty_folder(self, prefix: str) -> None:
        """Remove the folder of ``prefix`` (``"ckpt-0000000010/"``) if nothing is left in it: for
        an owner that deleted all of a prefix's objects and writes there no more (object stores
        have no folders to leave behind)."""
        folder = self._path(prefix.rstrip("/"))
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # not empty (or not a folder): leave it
            return
