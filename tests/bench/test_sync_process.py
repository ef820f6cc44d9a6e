"""The benchmark's synchronizer processes: the settings passed on to them, and one that does not
get ready says why."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from diloco_bench.sync_ingest_payloads import make_plan
from diloco_bench.sync_process import Storage, start_shards, sync_flags


def test_the_synchronizers_settings_given_are_passed_on_as_their_flags() -> None:
    given = argparse.Namespace(pending_memory_bytes=None, served_in_memory_bytes=536870912)
    assert sync_flags(given) == ["--served-in-memory-bytes", "536870912"]
    both = argparse.Namespace(pending_memory_bytes=0, served_in_memory_bytes=1)
    assert sync_flags(both) == ["--pending-memory-bytes", "0", "--served-in-memory-bytes", "1"]


@pytest.mark.integration
def test_a_synchronizer_that_refuses_a_setting_is_reported_with_what_it_wrote(tmp_path: Path) -> None:
    storage = Storage(f"file://{tmp_path / 'store'}", {})
    with pytest.raises(RuntimeError) as caught:
        start_shards(storage, make_plan(1000, 1), 1, 1, ["--pending-memory-bytes", "not-a-size"])
    said = str(caught.value)
    assert "the synchronizer exited before it was ready" in said
    assert "it exited with status 2" in said
    assert "--pending-memory-bytes" in said  # the synchronizer's own refusal, from its standard error
