"""Fixtures of the synchronizer tests: real synchronizer processes, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.synchronizer.helpers import SyncProcess

SyncFactory = Callable[..., SyncProcess]


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
