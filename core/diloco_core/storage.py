"""Object storage: a small interface on string keys, with a filesystem and an S3 implementation.

Every failure of a backend is translated at this boundary into one of three exceptions:
``ObjectNotFound`` (the key does not exist), ``StorageUnavailable`` (the backend cannot be reached
or answered with a server error: retry later) and ``StorageError`` (anything else: a bug or a
misconfiguration that retrying will not fix). Callers never see boto3 or OS exceptions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from diloco_core import s3_errors
from diloco_core.endpoint_url import check_endpoint_url
from diloco_core.file_store import FilesystemStore
from diloco_core.s3_transfer import TransferSettings, download, upload, upload_file
from diloco_core.storage_errors import ObjectNotFound, StorageError, StorageUnavailable, check_key
from diloco_core.uploads import LOCAL_SPOOL, FileUpload, Upload, sweep


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
