"""The state store's commits, garbage collection and claim of its storage prefix, on a real
filesystem store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from diloco_core.layout import FragmentRecord, LearnerRegistryRecord
from diloco_core.ownership import CONFLICT, MARKER_KEY, encode_marker, new_marker, parse_marker
from diloco_core.storage import FilesystemStore, S3Store
from diloco_core.uploads import UPLOAD_PREFIX
from diloco_sync.persistence import StateMismatch, StateStore, StorageOwnedByAnotherJob
from diloco_testbed.s3_server import S3Server


def _commit(state: StateStore, p: int, version: int) -> None:
    layout = state.layout
    record = FragmentRecord(
        version=version,
        params_key=layout.params(p, version),
        outer_key=layout.outer(p, version),
        rounds=version,
    )
    state.commit_version(
        p,
        record,
        params_blob=b"params-%d" % version,
        outer=lambda upload: upload.write(b"outer-%d" % version),
        round_log={"version": version},
        count_round=True,
    )


def test_commits_write_every_object_and_collection_keeps_the_newest_versions(tmp_path: Path) -> None:
    fs = FilesystemStore(tmp_path)
    earlier = StateStore(fs, 0, "job")
    _commit(earlier, 1, 0)
    fs.put(earlier.layout.params(1, 7), b"orphan of a crashed commit")  # newer than any committed version

    state = StateStore(fs, 0, "job")
    assert state.load_manifest() is not None
    for version in range(1, 6):
        _commit(state, 1, version)
        state.collect_garbage(1, keep_versions=2)
    _commit(state, 0, 0)
    assert state.collect_garbage(0, keep_versions=2) == 0

    assert fs.list(state.layout.fragment_prefix(1)) == [
        state.layout.outer(1, 4), state.layout.outer(1, 5), state.layout.params(1, 4), state.layout.params(1, 5),
    ]  # fmt: skip
    assert fs.get(state.layout.params(1, 5)) == b"params-5"
    assert len(fs.list(f"{state.layout.root}/rounds/1/")) == 6  # the round log is kept
    manifest = StateStore(fs, 0, "job").load_manifest()
    assert manifest is not None
    assert {p: r.version for p, r in manifest.fragments.items()} == {0: 0, 1: 5}
    assert manifest.rounds == 7  # one commit in the first process, six here


class RacingStore(FilesystemStore):
    """A filesystem store where another job writes its marker right after each of ours."""

    def __init__(self, root: Path, rival: str) -> None:
        super().__init__(root)
        self.rival = rival

    def put(self, key: str, data: bytes | bytearray) -> None:
        super().put(key, data)
        if key == MARKER_KEY:
            super().put(key, encode_marker(new_marker(self.rival, "llm", 2.0)))


def test_claims_an_empty_prefix_and_refuses_another_owner(tmp_path: Path) -> None:
    fs = FilesystemStore(tmp_path)
    mine = StateStore(fs, 0, "llm", owner="team-a/llm", clock=lambda: 1.0)
    assert mine.claim() == new_marker("team-a/llm", "llm", 1.0)
    assert parse_marker(fs.get(MARKER_KEY), "here").owner == "team-a/llm"
    assert StateStore(fs, 1, "llm", owner="team-a/llm").claim().claimed_at == 1.0  # another shard: as is

    with pytest.raises(StorageOwnedByAnotherJob, match=f"^{CONFLICT}: .*'team-a/llm'.*'team-b/llm'"):
        StateStore(fs, 0, "llm", owner="team-b/llm").claim()
    assert parse_marker(fs.get(MARKER_KEY), "here").owner == "team-a/llm"


def test_of_two_claiming_at_once_the_last_writer_wins(tmp_path: Path) -> None:
    with pytest.raises(StorageOwnedByAnotherJob, match="'team-b/llm'"):
        StateStore(RacingStore(tmp_path, "team-b/llm"), 0, "llm", owner="team-a/llm").claim()


def test_an_unreadable_marker_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    fs = FilesystemStore(tmp_path)
    fs.put(MARKER_KEY, b"not json")
    with pytest.raises(StateMismatch, match="cannot be read"):
        StateStore(fs, 0, "llm").claim()
    assert fs.get(MARKER_KEY) == b"not json"


def test_a_prefix_taken_while_running_stops_every_write(tmp_path: Path) -> None:
    fs = FilesystemStore(tmp_path)
    lost: list[str] = []
    state = StateStore(fs, 0, "llm", owner="team-a/llm")
    state.on_lost = lost.append
    state.claim()
    _commit(state, 0, 0)
    fs.put(MARKER_KEY, encode_marker(new_marker("team-b/llm", "llm", 5.0)))
    with pytest.raises(StorageOwnedByAnotherJob, match="'team-b/llm'"):
        _commit(state, 0, 1)
    assert not fs.exists(state.layout.params(0, 1))  # nothing of the round was written
    fs.delete(MARKER_KEY)  # lost for good: not claimed again
    for write in (
        lambda: _commit(state, 0, 1),
        lambda: state.save_learners(LearnerRegistryRecord()),
        lambda: state.collect_garbage(0, keep_versions=1),
        lambda: state.delete(state.layout.manifest),
    ):
        with pytest.raises(StorageOwnedByAnotherJob):
            write()
    assert len(lost) == 1
    assert lost[0].startswith(CONFLICT)
    assert not fs.exists(MARKER_KEY)
    manifest = StateStore(fs, 0, "llm", owner="team-a/llm").load_manifest()
    assert manifest is not None
    assert manifest.fragments[0].version == 0


def test_a_marker_deleted_while_running_is_claimed_again(tmp_path: Path) -> None:
    fs = FilesystemStore(tmp_path)
    state = StateStore(fs, 0, "llm", owner="team-a/llm")
    state.claim()
    fs.delete(MARKER_KEY)
    _commit(state, 0, 0)
    assert parse_marker(fs.get(MARKER_KEY), "here").owner == "team-a/llm"


def test_a_version_written_by_its_writer_is_committed_with_the_size_written(tmp_path: Path) -> None:
    fs = FilesystemStore(tmp_path)
    state = StateStore(fs, 0, "job")
    assert state.load_manifest() is None
    key = state.layout.params(0, 1)

    def write(upload: object) -> int:
        for piece in (b"abc", b"defg"):
            upload.write(piece)  # type: ignore[attr-defined]
        return 7

    record = FragmentRecord(version=1, params_key=key, outer_key=None)
    committed = state.commit_version(
        0, record, params_blob=write, outer=None, round_log=None, count_round=True
    )
    assert (committed.params_bytes, record.params_bytes) == (7, None)
    assert fs.get(key) == b"abcdefg"
    manifest = StateStore(fs, 0, "job").load_manifest()
    assert manifest is not None
    assert manifest.fragments[0].params_bytes == 7


_CRASH_MID_COMMIT = """
import os, sys
from diloco_core.storage import FilesystemStore

store = FilesystemStore(sys.argv[1])
for key in sys.argv[2:]:
    upload = store.open_upload(key, read_back=False)
    upload.write(b"part of an object")
os._exit(1)  # dies before any commit or discard
"""


def test_the_start_up_sweep_removes_what_a_crash_left_anywhere_in_the_shard(tmp_path: Path) -> None:
    fs = FilesystemStore(tmp_path)
    earlier = StateStore(fs, 0, "job")
    _commit(earlier, 1, 1)
    layout = earlier.layout
    left = [layout.params(1, 2), layout.outer(1, 2), layout.pending(1, "a", 1, 0), "shard-001/plan.json"]
    crashed = subprocess.run(
        [sys.executable, "-c", _CRASH_MID_COMMIT, str(tmp_path), *left], capture_output=True, timeout=60
    )
    assert crashed.returncode == 1, crashed.stderr
    assert len(list(tmp_path.rglob(f"{UPLOAD_PREFIX}*"))) == 4
    committed = sorted(p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(UPLOAD_PREFIX))

    StateStore(fs, 0, "job").sweep_uploads()
    assert [p.relative_to(tmp_path).parent.as_posix() for p in tmp_path.rglob(f"{UPLOAD_PREFIX}*")] == [
        "shard-001"
    ]  # another shard's, whose writer may be at work
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(UPLOAD_PREFIX)) == (
        committed
    )
    assert fs.get(layout.params(1, 1)) == b"params-1"


@pytest.mark.integration
def test_the_start_up_sweep_aborts_the_shard_s_unfinished_multipart_uploads(
    s3: S3Server, tmp_path: Path
) -> None:
    kw = {"endpoint_url": s3.endpoint_url, "access_key": s3.access_key, "secret_key": s3.secret_key}
    store = S3Store(s3.new_bucket(), "jobs/llm", spool=tmp_path / "spool", **kw)
    earlier = StateStore(store, 0, "job")
    _commit(earlier, 1, 1)
    client, bucket = store._client, store.bucket
    for key in (earlier.layout.outer(1, 2), "shard-001/fragments/0/outer-0000000002.bin"):
        started = client.create_multipart_upload(Bucket=bucket, Key=f"jobs/llm/{key}")
        client.upload_part(
            Bucket=bucket,
            Key=f"jobs/llm/{key}",
            UploadId=started["UploadId"],
            PartNumber=1,
            Body=b"o" * (5 << 20),
        )

    StateStore(store, 0, "job").sweep_uploads()
    unfinished = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in unfinished] == ["jobs/llm/shard-001/fragments/0/outer-0000000002.bin"]
    assert store.get(earlier.layout.outer(1, 1)) == b"outer-1"
