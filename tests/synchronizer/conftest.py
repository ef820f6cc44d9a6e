"""Fixtures of the synchronizer tests: real synchronizer processes, stopped after each test, and
``store``, the storage they keep their state in: a file:// folder, or a fresh bucket on the session's
real S3 server (SeaweedFS)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.s3 import S3Server
from tests.synchronizer.helpers import SyncProcess

SyncFactory = Callable[..., SyncProcess]


@dataclass(frozen=True)
class StoreTarget:
    """Where a test's synchronizers keep their state; ``url(name)``: one separate store per name."""

    kind: str
    base: str
    env: dict[str, str] = field(default_factory=dict)

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """Both object stores: a folder of this test, or a new bucket on the session's S3 server."""
    if request.param == "file":
        return StoreTarget("file", f"file://{tmp_path / 'stores'}")
    s3: S3Server = request.getfixturevalue("s3")
    return StoreTarget("s3", f"s3://{s3.new_bucket()}/jobs", s3.env())


@pytest.fixture
def sync_factory(test_logs_dir: Path, tmp_path: Path) -> Iterator[SyncFactory]:
    """``sync_factory(storage_url=None, args=(), env=None)`` starts a synchronizer and returns it."""
    started: list[SyncProcess] = []

    def start(
        storage_url: str | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        port: int | None = None,
    ) -> SyncProcess:
        url = storage_url or f"file://{tmp_path / f'store-{len(started)}'}"
        proc = SyncProcess(test_logs_dir / "sync", url, args, env, port)
        started.append(proc)
        proc.start()
        return proc

    try:
        yield start
    finally:
        for proc in reversed(started):
            proc.stop()
