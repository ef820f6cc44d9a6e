"""Large objects on S3: uploads in parts and downloads in concurrent byte ranges.

A single PUT is limited to 5 GB by S3 and sends an object over one connection; a fragment of a large
model in fp32 is larger than that. Objects above the part size are uploaded as a multipart upload
(boto3's transfer manager: parts sent concurrently, the upload aborted on failure); like a single PUT
it is atomic, as the object exists only once the upload is completed. Downloads ask for the first
part as a byte range, which also tells the object's size; the other parts follow concurrently, each
on the same version of the object (``If-Match`` its ETag), into one buffer.
"""

from __future__ import annotations

import io
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

MIN_PART = 5 * 1024**2  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # S3's most parts in one upload
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class TransferError(Exception):
    """A download came back other than asked (a short range): retrying may cure it."""


@dataclass(frozen=True)
class TransferSettings:
    """``part_bytes``: objects above this go in parts of (at least) this size; ``workers``: parts in
    flight at once, per object."""

    part_bytes: int = 64 * 1024**2
    workers: int = 8

    def __post_init__(self) -> None:
        if self.part_bytes < MIN_PART or self.workers < 1:
            raise ValueError(f"part_bytes must be at least {MIN_PART} and workers at least 1")


def part_size(total: int, part_bytes: int) -> int:
    """The part size for an object of ``total`` bytes: ``part_bytes``, or larger so that no upload
    needs more than S3's 10,000 parts."""
    return max(part_bytes, -(-total // MAX_PARTS))


def byte_ranges(total: int, start: int, part: int) -> list[tuple[int, int]]:
    """The inclusive byte ranges of ``part`` bytes that cover ``[start, total)``."""
    return [(lo, min(lo + part, total) - 1) for lo in range(start, total, part)]


def parse_content_range(header: str) -> tuple[int, int, int]:
    """``bytes FIRST-LAST/TOTAL`` as three ints; ValueError for anything else (a ``*`` total too)."""
    m = _CONTENT_RANGE.match(header.strip())
    if m is None:
        raise ValueError(f"unexpected Content-Range {header!r}")
    first, last, total = (int(g) for g in m.groups())
    if not first <= last < total:
        raise ValueError(f"inconsistent Content-Range {header!r}")
    return first, last, total


def upload(client: Any, bucket: str, key: str, data: bytes | bytearray, settings: TransferSettings) -> None:
    """``data`` under ``key``: one PUT up to the part size, else a multipart upload."""
    if len(data) <= settings.part_bytes:
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))  # a copy of at most one part
        return
    client.upload_fileobj(BufferReader(data), bucket, key, Config=_multipart(len(data), settings))


def upload_file(
    client: Any, bucket: str, key: str, file: BinaryIO, size: int, settings: TransferSettings
) -> None:
    """The ``size`` bytes of the seekable ``file`` under ``key``, as ``upload`` sends bytes: read
    from the file part by part, never all at once."""
    file.seek(0)
    if size <= settings.part_bytes:
        client.put_object(Bucket=bucket, Key=key, Body=file.read(size))
        return
    client.upload_fileobj(file, bucket, key, Config=_multipart(size, settings))


def _multipart(size: int, settings: TransferSettings) -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=settings.part_bytes,
        multipart_chunksize=part_size(size, settings.part_bytes),
        max_concurrency=settings.workers,
        use_threads=settings.workers > 1,
    )


class BufferReader(io.RawIOBase):
    """A seekable file reading ``data`` in place: ``io.BytesIO`` copies anything but ``bytes``, and
    a large object is held once, not twice, while its parts go up."""

    def __init__(self, data: bytes | bytearray) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}
        if whence not in bases or bases[whence] + offset < 0:
            raise ValueError(f"cannot seek to {offset} from {whence}")
        self._pos = bases[whence] + offset
        return self._pos

    def close(self) -> None:
        if not self.closed:
            self._view.release()  # the data may be resized or freed again
        super().close()

    def readinto(self, buffer: Any) -> int:
        self._checkClosed()
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def download(client: Any, bucket: str, key: str, settings: TransferSettings) -> bytes:
    """The object under ``key``: its first part with its size, then the rest in concurrent ranges."""
    from botocore.exceptions import ClientError

    try:
        first = client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{settings.part_bytes - 1}")
    except ClientError as exc:
        if (getattr(exc, "response", None) or {}).get("Error", {}).get("Code") != "InvalidRange":
            raise
        return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())  # an empty object
    head: bytes = first["Body"].read()
    content_range = first.get("ContentRange")
    if not content_range:  # the server sent the whole object
        return head
    _, last, total = parse_content_range(content_range)
    if last + 1 != len(head):
        raise TransferError(f"{key}: a range of {last + 1} bytes came with {len(head)}")
    ranges = byte_ranges(total, len(head), settings.part_bytes)
    if not ranges:
        return head
    etag = first.get("ETag")

    def fetch(span: tuple[int, int]) -> bytes:
        extra = {"IfMatch": etag} if etag else {}
        got = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={span[0]}-{span[1]}", **extra)
        body: bytes = got["Body"].read()
        if len(body) != span[1] - span[0] + 1:
            raise TransferError(f"{key}: bytes {span[0]}-{span[1]} came back as {len(body)} bytes")
        return body

    with ThreadPoolExecutor(
        max_workers=min(settings.workers, len(ranges)), thread_name_prefix="s3-get"
    ) as pool:
        parts = list(pool.map(fetch, ranges))
    return b"".join([head, *parts])
