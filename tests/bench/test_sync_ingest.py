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
    plots = tmp_path / "plots"
    assert main([*argv, "--pending-memory-bytes", "0", "--json", str(out), "--plot-dir", str(plots)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["waits"] > 0
    assert row["contributions"] > 0
    assert row["rounds"] > 0
    assert (plots / "sync-scale.png").stat().st_size > 0
    # the plot again from the figures alone, with nothing run
    again = tmp_path / "again"
    assert main(["--plot-from", str(out), "--plot-dir", str(again)]) == 0
    assert (again / "sync-scale.png").stat().st_size > 0


def test_on_seaweedfs_rounds_are_committed_and_a_killed_synchronizer_takes_up_its_contributions(
    tmp_path: Path,
) -> None:
    """With ``--storage seaweedfs --restart``: the rounds commit to a real S3 server and the commit
    time per round is read from the service's metrics; the synchronizer killed with SIGKILL at the end
    is started again on the same bucket, becomes ready, and serves every version committed before."""
    out = tmp_path / "figures.json"
    argv = ["--clients", "2", "--seconds", "4", "--params", "2e5", "--fragments", "2"]
    assert main([*argv, "--storage", "seaweedfs", "--restart", "--json", str(out), "--no-plot"]) == 0
    (row,) = json.loads(out.read_text())
    assert row["storage"] == "seaweedfs"
    assert row["rounds"] > 0
    assert row["commit_s_per_round"] > 0
    assert row["restart_s"] > 0
    # committed versions survive the kill; each round after it publishes one more
    assert row["restart_versions"] >= row["versions"] + row["restart_rounds"] > 0
    assert row["restart_peak_rss"] > 0
