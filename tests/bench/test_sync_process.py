"""The benchmark's synchronizer processes: the settings passed on to them, and one that does not
get ready says why; of what one writes to its standard error only its last words are kept."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from diloco_bench.sync_ingest_payloads import make_plan
from diloco_bench.sync_process import LastWords, Storage, start_shards, sync_flags


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


def test_only_the_last_words_of_a_process_are_kept_and_its_pipe_never_fills() -> None:
    # 1 MB, far more than a pipe holds: a writer nobody read from would block before its last line
    script = "import sys; sys.stderr.write('x' * 1_000_000 + 'the end'); sys.stderr.flush()"
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    assert proc.stderr is not None
    said = LastWords(proc.stderr, limit=100)
    assert proc.wait(timeout=60) == 0
    words = said.text(wait_s=10)
    assert words.endswith("the end")
    assert len(words) == 100
