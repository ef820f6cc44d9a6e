"""The benchmark's synchronizer processes: one that does not get ready says why."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_bench.sync_ingest import make_plan
from diloco_bench.sync_process import Storage, start_shards


def test_a_synchronizer_that_refuses_a_setting_is_reported_with_what_it_wrote(tmp_path: Path) -> None:
    storage = Storage(f"file://{tmp_path / 'store'}", {})
    with pytest.raises(RuntimeError) as caught:
        start_shards(storage, make_plan(1000, 1), 1, 1, ["--pending-memory-bytes", "not-a-size"])
    said = str(caught.value)
    assert "the synchronizer exited before it was ready" in said
    assert "it exited with status 2" in said
    assert "--pending-memory-bytes" in said  # the synchronizer's own refusal, from its standard error
