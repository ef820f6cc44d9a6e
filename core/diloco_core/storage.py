"""Object storage: a small interface on string keys, with a filesystem and an S3 implementation.

Every failure of a backend is translated at this boundary into one of three exceptions:
``ObjectNotFound`` (the key does not exist), ``StorageUnavailable`` (the backend cannot be reached
or answered with a server error: retry later) and ``StorageError`` (anything else: a bug or a
misconfiguration that retrying will not fix). Callers never see boto3 or OS exceptions.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from diloco_core import direct_io, s3_errors
from diloco_core.endpoint_url import check_endpoint_url
from diloco_core.s3_transfer import TransferSettings, download, upload, upload_file
from diloco_core.uploads import (
    LOCAL_SPOOL,
    UPLOAD_PREFIX,
    FileUpload,
    Upload,
    make_folders,
    sweep,
    sync_folder,
)

_KEY_RE = re.compile(r"^[A-Za-z0-9._\-][A-Za-z0-9._\-/]*$")


class StorageError(Exception):
    """A storage failure that retrying will not fix."""


class StorageUnavailable(StorageError):
    """The backend cannot be reached right now; retry later."""


class ObjectNotFound(StorageError, KeyError):
    """The key does not exist."""


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, without '..' segments, empty segments or odd characters."""
    if not _KEY_RE.match(key) or any(part in ("", ".", "..") for part in key.split("/")):
        raise StorageError(f"invalid object key {key!r}")
    return key


@runtime_checkable
class ObjectStore(Protocol):
    """A flat key → bytes store. ``put`` is atomic: a reader sees the old object or the new one."""

    def get(self, key: str) -> bytes: ...

    def get_view(self, key: str) -> memoryview:
        """The object's bytes, read-only, for a reader that decodes them whole: a store may read a
        large object into memory of its own past any cache (the folder store, ``direct_io``)."""
        ...

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes of the object from offset ``start`` (fewer at its end)."""
        ...

    def put(self, key: str, data: bytes | bytearray) -> None: ...

    def open_upload(self, key: str, *, read_back: bool = True) -> Upload:
        """An object under ``key`` written as its bytes arrive (``diloco_core.uploads``); its
        ``commit`` stores it at once, as ``put`` does. ``read_back`` False: the upload is never
        viewed, so a store may write it past its cache."""
        ...

    def sweep_uploads(self, prefix: str) -> int:
        """Remove what uploads under ``prefix`` (``""``: the whole store) that no process will finish
        left behind (called at start-up by the prefix's one writer); how many."""
        ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, key: str) -> None: ...

    def exists(self, key: str) -> bool: ...

    def describe(self) -> str: ...


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


class S3Store:
    """Objects in an S3 bucket under ``prefix`` (boto3). Writes are atomic (a single PUT, or a multipart
    upload, which S3 completes at once); large objects go in parts both ways (``s3_transfer``)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 30.0,
        max_attempts: int = 2,
        transfer: TransferSettings | None = None,
        spool: Path | None = None,
    ) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.transfer = transfer or TransferSettings()
        self.spool = spool or LOCAL_SPOOL  # where uploads are written first
        config = Config(
            max_pool_connections=max(10, 2 * self.transfer.workers),
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": "path"},
        )
        self._client: Any = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1",
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=config,
        )

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _translate(self, exc: Exception, what: str) -> StorageError:
        kind, message = s3_errors.failure(exc, what, self.bucket)
        raised = {"not_found": ObjectNotFound, "unavailable": StorageUnavailable}.get(kind, StorageError)
        return raised(message)

    def get(self, key: str) -> bytes:
        try:
            return download(self._client, self.bucket, self._key(key), self.transfer)
        except StorageError:
            raise
        except Exception as exc:
            raise self._translate(exc, key) from exc

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:  # an HTTP range cannot be empty
            return b""
        try:
            got = self._client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )
            return bytes(got["Body"].read())
        except Exception as exc:
            if s3_errors.status(exc) == 416:  # the range starts at or past the end
                return b""
            raise self._translate(exc, key) from exc

    def put(self, key: str, data: bytes | bytearray) -> None:
        try:
            upload(self._client, self.bucket, self._key(key), data, self.transfer)
        except StorageError:
            raise
        except Exception as exc:
            raise self._translate(exc, key) from exc

    def get_view(self, key: str) -> memoryview:
        return memoryview(self.get(key)).toreadonly()

    def open_upload(self, key: str, *, read_back: bool = True) -> Upload:
        """A temporary file in the local ``spool`` folder, uploaded in parts by its commit (which
        reads the file: ``read_back`` changes nothing here)."""

        def store(upload: FileUpload) -> None:
            try:
                upload_file(
                    self._client, self.bucket, self._key(key), upload.file, upload.size, self.transfer
                )
            except Exception as exc:
                raise self._translate(exc, key) from exc

        try:
            return FileUpload(self.spool, store)
        except OSError as exc:
            raise StorageError(f"cannot write the upload of {key} under {self.spool}: {exc}") from exc

    def sweep_uploads(self, prefix: str) -> int:
        """Abort the multipart uploads under ``prefix`` (S3 keeps an unfinished one's parts, billed,
        until it is aborted), then remove the spool's upload files. The spool may be another
        process's too: a file it is writing or sending goes on through its open handle."""
        aborted = 0
        try:
            paginator = self._client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for item in page.get("Uploads", []):
                    aborted += self._abort_upload(str(item["Key"]), str(item["UploadId"]))
        except Exception as exc:
            raise self._translate(exc, f"unfinished uploads under {prefix!r}") from exc
        return aborted + sweep(self.spool, idle_s=0.0)

    def _abort_upload(self, key: str, upload_id: str) -> int:
        """1 once the multipart upload is aborted, 0 when it was gone already."""
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception as exc:
            if s3_errors.code(exc) == "NoSuchUpload":
                return 0
            raise
        return 1

    def list(self, prefix: str = "") -> list[str]:
        keys: list[str] = []
        try:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for item in page.get("Contents", []):
                    keys.append(str(item["Key"])[len(self.prefix) :])
        except Exception as exc:
            raise self._translate(exc, f"list {prefix!r}") from exc
        return sorted(keys)

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            err = self._translate(exc, key)
            if not isinstance(err, ObjectNotFound):
                raise err from exc

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as exc:
            err = self._translate(exc, key)
            if isinstance(err, ObjectNotFound):
                return False
            raise err from exc


def _endpoint_url(given: str | None) -> str | None:
    """The S3 endpoint: ``given``, else the one of the standard AWS variables; ValueError (as the S3
    client's own) naming where it came from when it is not an http:// or https:// URL."""
    for source, url in (
        ("endpoint", given),
        ("AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL_S3")),
        ("AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL")),
    ):
        if url:
            try:
                return check_endpoint_url(url)
            except ValueError as exc:
                raise ValueError(f"{source}: {exc}") from None
    return None


def open_store(
    url: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
) -> ObjectStore:
    """Open ``file:///path`` or ``s3://bucket/prefix``.

    For S3, the endpoint and credentials come from the arguments or else from the standard AWS
    variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``);
    an endpoint that is no http:// or https:// URL is a ValueError naming where it came from.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        path = unquote(parsed.path)
        if parsed.netloc not in ("", "localhost") or not path:
            raise StorageError(f"storage URL {url!r}: use file:///absolute/path")
        return FilesystemStore(path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StorageError(f"storage URL {url!r}: missing bucket (s3://bucket/prefix)")
        return S3Store(
            parsed.netloc,
            parsed.path.strip("/"),
            endpoint_url=_endpoint_url(endpoint_url),
            region=region,
            access_key=access_key,
            secret_key=secret_key,
        )
    raise StorageError(f"storage URL {url!r}: expected file:///path or s3://bucket/prefix")
