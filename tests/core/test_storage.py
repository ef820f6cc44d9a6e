"""One contract, every object store: the filesystem store and S3 (a real SeaweedFS server)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from diloco_core.direct_io import DIRECT_MIN_BYTES
from diloco_core.storage import (
    FilesystemStore,
    ObjectNotFound,
    ObjectStore,
    S3Store,
    StorageError,
    StorageUnavailable,
    open_store,
)
from diloco_core.uploads import UPLOAD_PREFIX
from diloco_testbed.s3_server import S3Server


@pytest.fixture(params=["filesystem", pytest.param("s3", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "filesystem":
        yield FilesystemStore(tmp_path / "objects")
        return
    server: S3Server = request.getfixturevalue("s3")
    bucket = server.new_bucket()
    yield S3Store(
        bucket,
        "job/a",
        endpoint_url=server.endpoint_url,
        region=server.region,
        access_key=server.access_key,
        secret_key=server.secret_key,
    )


def test_put_get_round_trip_and_overwrite(store: ObjectStore) -> None:
    store.put("a/b/c.bin", b"\x00\x01payload")
    assert store.get("a/b/c.bin") == b"\x00\x01payload"
    store.put("a/b/c.bin", b"second")
    assert store.get("a/b/c.bin") == b"second"
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_missing_key_raises_object_not_found(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound):
        store.get("nothing/here")
    assert store.exists("nothing/here") is False


def test_list_is_sorted_and_filtered_by_prefix(store: ObjectStore) -> None:
    for key in ["x/2", "x/1", "x/sub/3", "y/1", "xy"]:
        store.put(key, key.encode())
    assert store.list("x/") == ["x/1", "x/2", "x/sub/3"]
    assert store.list("x") == ["x/1", "x/2", "x/sub/3", "xy"]
    assert store.list() == ["x/1", "x/2", "x/sub/3", "xy", "y/1"]
    assert store.list("zzz/") == []


def test_delete_is_idempotent(store: ObjectStore) -> None:
    store.put("k", b"v")
    assert store.exists("k")
    store.delete("k")
    assert not store.exists("k")
    store.delete("k")  # deleting again is not an error
    with pytest.raises(ObjectNotFound):
        store.get("k")


def test_large_object(store: ObjectStore) -> None:
    data = bytes(range(256)) * (4 * 1024 * 8)  # 8 MiB
    store.put("big", data)
    assert store.get("big") == data


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", "", "a/../b", "sp ace"])
def test_invalid_keys_are_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(StorageError, match="invalid object key"):
        store.put(key, b"x")


def test_an_upload_is_stored_whole_by_its_commit_and_nothing_by_its_discard(store: ObjectStore) -> None:
    data = os.urandom(3 * 1024 * 1024 + 7)
    upload = store.open_upload("pending/0/a.bin")
    for start in range(0, len(data), 65536):
        upload.write(data[start : start + 65536])
    assert store.list("pending/") == []  # nothing to read before the commit
    upload.patch(0, b"HEAD")
    upload.commit()
    assert store.get("pending/0/a.bin") == b"HEAD" + data[4:]
    dropped = store.open_upload("pending/0/b.bin")
    dropped.write(b"never stored")
    dropped.discard()
    assert store.list("pending/") == ["pending/0/a.bin"]


def test_filesystem_uploads_are_written_in_the_object_s_folder_and_swept_at_start(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    left = store.open_upload("shard-000/pending/0/a/0-1.bin")  # a process dies while receiving it
    left.write(b"part of a body")
    assert left.path.parent == tmp_path / "shard-000/pending/0/a"  # type: ignore[attr-defined]
    store.put("shard-000/pending/0/a/0-0.bin", b"kept")
    assert store.list() == ["shard-000/pending/0/a/0-0.bin"]
    assert store.sweep_uploads("shard-000/pending/") == 1
    assert [p.name for p in (tmp_path / "shard-000/pending/0/a").iterdir()] == ["0-0.bin"]


def test_a_large_object_read_whole_as_a_view_is_the_object(store: ObjectStore) -> None:
    large = os.urandom(DIRECT_MIN_BYTES + 4097)  # past the folder store's page cache both ways
    store.put("big", large)
    upload = store.open_upload("outer", read_back=False)
    for start in range(0, len(large), 1 << 20):
        upload.write(large[start : start + (1 << 20)])
    upload.commit()
    for key in ("big", "outer"):
        view = store.get_view(key)
        assert view.readonly
        assert bytes(view) == large
        assert store.get(key) == large
        assert store.read_range(key, DIRECT_MIN_BYTES, 10) == large[DIRECT_MIN_BYTES : DIRECT_MIN_BYTES + 10]
    store.put("small", b"abc")
    assert bytes(store.get_view("small")) == b"abc"
    with pytest.raises(ObjectNotFound):
        store.get_view("missing")


def test_filesystem_put_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    for i in range(5):
        store.put("dir/obj", str(i).encode())
        store.put("dir/large", str(i).encode() * DIRECT_MIN_BYTES)
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["large", "obj"]
    assert store.get("dir/obj") == b"4"
    assert store.get("dir/large") == b"4" * DIRECT_MIN_BYTES


def test_open_store_parses_urls(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/state")
    assert isinstance(store, FilesystemStore)
    assert store.root == tmp_path / "state"
    s3 = open_store("s3://bucket-name/some/prefix", endpoint_url="http://127.0.0.1:1")
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix) == ("bucket-name", "some/prefix/")
    with pytest.raises(StorageError, match="expected file:///path or s3://bucket/prefix"):
        open_store("ftp://host/x")
    with pytest.raises(StorageError, match="missing bucket"):
        open_store("s3:///prefix")


def test_unreachable_s3_is_storage_unavailable() -> None:
    """Nothing listens on port 1, a real refused connection: reported as retryable."""
    store = S3Store(
        "bucket", endpoint_url="http://127.0.0.1:1", access_key="a", secret_key="b", max_attempts=1
    )
    with pytest.raises(StorageUnavailable):
        store.put("k", b"v")
    with pytest.raises(StorageUnavailable):
        store.get("k")


@pytest.mark.integration
def test_s3_wrong_secret_is_a_permanent_error(s3: S3Server) -> None:
    bucket = s3.new_bucket()
    store = S3Store(bucket, endpoint_url=s3.endpoint_url, access_key=s3.access_key, secret_key="wrong-secret")
    with pytest.raises(StorageError) as info:
        store.put("k", b"v")
    assert not isinstance(info.value, StorageUnavailable)
    assert "SignatureDoesNotMatch" in str(info.value)


@pytest.mark.integration
def test_s3_prefixes_isolate_jobs(s3: S3Server) -> None:
    bucket = s3.new_bucket()
    kw = {"endpoint_url": s3.endpoint_url, "access_key": s3.access_key, "secret_key": s3.secret_key}
    a, b = S3Store(bucket, "job-a", **kw), S3Store(bucket, "job-b", **kw)
    a.put("k", b"a")
    b.put("k", b"b")
    assert (a.get("k"), b.get("k")) == (b"a", b"b")
    assert a.list() == ["k"]


def test_read_range_reads_part_of_an_object(store: ObjectStore) -> None:
    data = bytes(range(100))
    store.put("v/params.bin", data)
    assert store.read_range("v/params.bin", 0, 10) == data[:10]
    assert store.read_range("v/params.bin", 40, 20) == data[40:60]
    assert store.read_range("v/params.bin", 95, 10) == data[95:]  # fewer at the end
    assert store.read_range("v/params.bin", 100, 5) == b""
    assert store.read_range("v/params.bin", 0, 0) == b""  # an empty range, not the whole object
    assert store.read_range("v/params.bin", 50, 0) == b""
    with pytest.raises(ObjectNotFound):
        store.read_range("v/missing.bin", 0, 10)


def test_a_filesystem_sweep_of_the_whole_store_removes_every_upload_file(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path)
    store.put("shard-000/fragments/0/params-0000000001.bin", b"committed")
    left = store.open_upload("shard-000/fragments/0/params-0000000002.bin")  # never committed
    left.write(b"part of the parameters")
    pending = store.open_upload("shard-000/pending/0/a/0-1.bin")
    pending.write(b"part of a body")
    assert store.sweep_uploads("") == 2
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()] == [
        "shard-000/fragments/0/params-0000000001.bin"
    ]


def _synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What ``os.fsync`` is called on from now on, by path."""
    synced: list[str] = []
    fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return synced


@pytest.mark.parametrize("size", [3, DIRECT_MIN_BYTES])  # a plain write, one past the page cache
def test_a_filesystem_put_syncs_the_object_s_folder_and_the_folders_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    store = FilesystemStore(tmp_path)
    synced = _synced(monkeypatch)
    store.put("a/b/obj", b"x" * size)
    folder = str(tmp_path / "a/b")
    assert synced[:2] == [str(tmp_path), str(tmp_path / "a")]  # where "a" and "a/b" were made
    assert synced[-2].startswith(f"{folder}/{UPLOAD_PREFIX}")  # the file, under its temporary name
    assert synced[-1] == folder  # then the rename, in its folder
    synced.clear()
    store.put("a/b/obj", b"y" * size)
    assert synced[-1] == folder
    assert store.get("a/b/obj") == b"y" * size


def test_a_filesystem_upload_s_commit_syncs_the_object_s_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FilesystemStore(tmp_path)
    store.put("pending/old", b"o")
    synced = _synced(monkeypatch)
    upload = store.open_upload("pending/0/a.bin")
    assert synced == [str(tmp_path / "pending")]  # the folder made for it, in its parent
    upload.write(b"body")
    upload.commit()
    assert synced[1:] == [str(upload.path), str(tmp_path / "pending/0")]


def _unfinished(store: S3Store, prefix: str = "") -> list[str]:
    """The keys of the store's unfinished multipart uploads under ``prefix`` (of the bucket)."""
    got = store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=prefix)
    return sorted(str(item["Key"]) for item in got.get("Uploads", []))


def _start_multipart(store: S3Store, key: str) -> None:
    """A multipart upload of one part, never completed (as a process that died while sending)."""
    client = store._client
    started = client.create_multipart_upload(Bucket=store.bucket, Key=key)
    client.upload_part(
        Bucket=store.bucket, Key=key, UploadId=started["UploadId"], PartNumber=1, Body=b"p" * (5 << 20)
    )


@pytest.mark.integration
def test_an_s3_sweep_aborts_the_unfinished_multipart_uploads_under_its_prefix(
    s3: S3Server, tmp_path: Path
) -> None:
    kw = {"endpoint_url": s3.endpoint_url, "access_key": s3.access_key, "secret_key": s3.secret_key}
    bucket = s3.new_bucket()
    store = S3Store(bucket, "job/a", spool=tmp_path / "spool", **kw)
    store.put("shard-000/fragments/0/params-0000000001.bin", b"committed")
    _start_multipart(store, "job/a/shard-000/fragments/0/outer-0000000002.bin")
    _start_multipart(store, "job/a/shard-000/pending/0/a/0-1.bin")
    _start_multipart(store, "job/a/shard-001/fragments/0/params-0000000002.bin")  # another shard's
    _start_multipart(store, "job/b/shard-000/fragments/0/params-0000000002.bin")  # another job's

    assert store.sweep_uploads("shard-000/") == 2
    assert _unfinished(store, "job/a/shard-000/") == []
    assert _unfinished(store) == [
        "job/a/shard-001/fragments/0/params-0000000002.bin",
        "job/b/shard-000/fragments/0/params-0000000002.bin",
    ]
    assert store.get("shard-000/fragments/0/params-0000000001.bin") == b"committed"
    assert store.sweep_uploads("") == 1  # the whole job
    assert _unfinished(store) == ["job/b/shard-000/fragments/0/params-0000000002.bin"]
