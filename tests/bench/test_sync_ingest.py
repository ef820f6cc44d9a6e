"""The synchronizer ingest benchmark against a real synchronizer process: with a pending budget of
nothing, the streaming learners' further parts are answered ``pending_full`` over HTTP, sent again
after ``Retry-After``, and still taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from diloco_bench.sync_ingest import main

pytestmark = [pytest.mark.integration]


def test_streaming_learners_wait_for_room_and_their_parts_are_still_taken(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    argv = ["--clients", "2", "--seconds", "4", "--params", "2e5", "--fragments", "2"]
    assert main([*argv, "--pending-memory-bytes", "0", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["waits"] > 0
    assert row["contributions"] > 0
    assert row["rounds"] > 0
