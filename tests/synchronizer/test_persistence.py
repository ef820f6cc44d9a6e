"""The state store's commits and garbage collection on a real filesystem store."""

from __future__ import annotations

from pathlib import Path

from diloco_core.layout import FragmentRecord
from diloco_core.storage import FilesystemStore
from diloco_sync.persistence import StateStore


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
        outer_blob=b"outer-%d" % version,
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
