"""Fixtures of the synchronizer tests: real synchronizer processes, killed after each test (or, from
``module_sync_factory``, after the module), and ``store``, the storage they keep their state in: a
file:// folder, or a fresh bucket on the session's real S3 server (SeaweedFS)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from diloco_testbed.s3_server import S3Server

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


class SyncStarter:
    """``starter(storage_url=None, args=(), env=None, port=None)`` starts a synchronizer and returns
    it; without ``storage_url``, on a new file:// store in ``folder``. ``discard()`` kills them all."""

    def __init__(self, log_dir: Path, folder: Path) -> None:
        self.log_dir, self.folder = log_dir, folder
        self.started: list[SyncProcess] = []

    def __call__(
        self,
        storage_url: str | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        port: int | None = None,
    ) -> SyncProcess:
        url = storage_url or f"file://{self.folder / f'store-{len(self.started)}'}"
        proc = SyncProcess(self.log_dir / "sync", url, args, env, port)
        self.started.append(proc)
        proc.start()
        return proc

    def discard(self) -> None:
        for proc in reversed(self.started):
            proc.discard()


@pytest.fixture
def sync_factory(test_logs_dir: Path, tmp_path: Path) -> Iterator[SyncFactory]:
    """``sync_factory(storage_url=None, args=(), env=None, port=None)``: a synchronizer of this test."""
    starter = SyncStarter(test_logs_dir, tmp_path)
    try:
        yield starter
    finally:
        starter.discard()


@pytest.fixture(scope="module")
def module_sync_factory(
    test_logs_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SyncFactory]:
    """``sync_factory``'s, for a synchronizer that the tests of one module share: only for tests
    that neither stop, fill nor reconfigure it, and whose checks hold whatever the module's other
    tests did to it."""
    starter = SyncStarter(test_logs_dir, tmp_path_factory.mktemp("module-stores"))
    try:
        yield starter
    finally:
        starter.discard()
