"""Large objects on S3 in parts: the range arithmetic, and uploads and downloads against SeaweedFS."""

from __future__ import annotations

import io
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
from diloco_core.s3_transfer import (
    MAX_PARTS,
    MIN_PART,
    BufferReader,
    TransferSettings,
    byte_ranges,
    parse_content_range,
    part_size,
)
from diloco_core.storage import S3Store, StorageUnavailable
from diloco_testbed.s3_server import S3Server


def test_parts_grow_so_that_no_upload_needs_more_than_s3_allows() -> None:
    assert part_size(100 * MIN_PART, MIN_PART) == MIN_PART
    assert part_size(50 * 1024**4, 64 * 1024**2) * MAX_PARTS >= 50 * 1024**4  # 50 TiB in 10,000 parts
    assert part_size(0, MIN_PART) == MIN_PART


def test_byte_ranges_cover_the_rest_of_the_object_exactly() -> None:
    assert byte_ranges(10, 4, 4) == [(4, 7), (8, 9)]
    assert byte_ranges(8, 4, 4) == [(4, 7)]
    assert byte_ranges(4, 4, 4) == []
    spans = byte_ranges(1_000_003, 1000, 4096)
    assert (spans[0][0], spans[-1][1]) == (1000, 1_000_002)
    assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize(
    ("header", "expected"),
    [("bytes 0-4/10", (0, 4, 10)), ("bytes 0-9/10", (0, 9, 10))],
)
def test_a_content_range_is_read(header: str, expected: tuple[int, int, int]) -> None:
    assert parse_content_range(header) == expected


@pytest.mark.parametrize("header", ["bytes 0-4/*", "bytes 5-4/10", "bytes 0-10/10", "items 0-1/2", ""])
def test_a_content_range_that_makes_no_sense_is_refused(header: str) -> None:
    with pytest.raises(ValueError, match="Content-Range"):
        parse_content_range(header)


def test_a_buffer_is_read_in_place_in_pieces_and_from_where_it_is_sought() -> None:
    data = bytearray(os.urandom(1000))
    reader = BufferReader(data)
    assert reader.read(300) == data[:300]
    assert reader.read(800) == data[300:]
    assert reader.read(10) == b""
    assert reader.seek(-100, io.SEEK_END) == 900
    assert reader.read() == data[900:]
    assert reader.seek(10) == 10
    assert reader.seek(5, io.SEEK_CUR) == 15
    assert reader.read(5) == data[15:20]
    with pytest.raises(ValueError, match="cannot seek"):
        reader.seek(-1)
    reader.close()
    with pytest.raises(ValueError):
        reader.read(1)
    data.extend(b"more")  # the closed reader no longer holds the buffer


def test_parts_smaller_than_s3_allows_are_refused() -> None:
    with pytest.raises(ValueError, match="part_bytes"):
        TransferSettings(part_bytes=1024)


def _store(s3: S3Server, bucket: str, workers: int = 4) -> S3Store:
    return S3Store(
        bucket,
        "big",
        endpoint_url=s3.endpoint_url,
        region=s3.region,
        access_key=s3.access_key,
        secret_key=s3.secret_key,
        transfer=TransferSettings(part_bytes=MIN_PART, workers=workers),
    )


def _ranges_asked(store: S3Store) -> list[str]:
    """The Range of every GetObject the store's client sends from now on ("" for none)."""
    asked: list[str] = []

    def note(params: dict[str, Any], **_: Any) -> None:
        asked.append(str(params.get("Range", "")))

    store._client.meta.events.register("provide-client-params.s3.GetObject", note)
    return asked


@pytest.mark.integration
@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_an_object_larger_than_a_part_goes_up_in_parts_and_comes_down_in_concurrent_ranges(
    s3: S3Server, kind: type[bytes | bytearray]
) -> None:
    store = _store(s3, s3.new_bucket())
    data = kind(os.urandom(2 * MIN_PART + 12345))
    store.put("params.bin", data)
    head = store._client.head_object(Bucket=store.bucket, Key="big/params.bin")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload of three parts
    asked = _ranges_asked(store)
    assert store.get("params.bin") == data
    assert sorted(asked) == sorted(
        [
            f"bytes=0-{MIN_PART - 1}",
            f"bytes={MIN_PART}-{2 * MIN_PART - 1}",
            f"bytes={2 * MIN_PART}-{len(data) - 1}",
        ]
    )


@pytest.mark.integration
@pytest.mark.parametrize("size", [MIN_PART - 1, 2 * MIN_PART + 12345])
def test_an_upload_goes_up_from_its_file_in_parts_and_leaves_its_spool_empty(
    s3: S3Server, size: int, tmp_path: Path
) -> None:
    store = _store(s3, s3.new_bucket())
    store.spool = tmp_path / "spool"
    data = os.urandom(size)
    upload = store.open_upload("pending.bin")
    for start in range(0, size, 1 << 20):
        upload.write(data[start : start + (1 << 20)])
    upload.commit()
    head = store._client.head_object(Bucket=store.bucket, Key="big/pending.bin")
    assert head["ETag"].strip('"').endswith("-3" if size > MIN_PART else "")
    assert ("-" in head["ETag"]) == (size > MIN_PART)
    assert store.get("pending.bin") == data
    assert list(store.spool.iterdir()) == []


@pytest.mark.integration
@pytest.mark.parametrize("size", [0, 1, MIN_PART - 1, MIN_PART])
def test_an_object_of_at_most_one_part_is_one_put_and_one_get(s3: S3Server, size: int) -> None:
    store = _store(s3, s3.new_bucket())
    data = os.urandom(size)
    store.put("small.bin", data)
    head = store._client.head_object(Bucket=store.bucket, Key="big/small.bin")
    assert "-" not in head["ETag"].strip('"')
    asked = _ranges_asked(store)
    assert store.get("small.bin") == data
    assert len(asked) == (2 if size == 0 else 1)  # an empty object has no byte 0: asked again whole


@pytest.mark.integration
def test_an_object_replaced_while_its_parts_come_down_is_a_retryable_error(s3: S3Server) -> None:
    """The later ranges ask for the version the first one came from (If-Match its ETag)."""
    store, other = _store(s3, bucket := s3.new_bucket(), workers=1), _store(s3, bucket)
    store.put("params.bin", os.urandom(2 * MIN_PART))
    replaced: list[bool] = []

    def replace_after_first(**_: Any) -> None:
        if not replaced:
            replaced.append(True)
            other.put("params.bin", os.urandom(2 * MIN_PART))

    store._client.meta.events.register("after-call.s3.GetObject", replace_after_first)
    with pytest.raises(StorageUnavailable, match="PreconditionFailed|412"):
        store.get("params.bin")
