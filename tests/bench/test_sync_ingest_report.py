"""The synchronizer ingest benchmark's figures per CPU second and per model size."""

from __future__ import annotations

from diloco_bench.sync_ingest_report import (
    Result,
    per_cpu_second,
    report,
    rss_over_model,
    scale_lines,
    summary_row,
)
from diloco_core.fragments import build_plan


def test_params_per_cpu_second_and_peak_memory_over_the_fp32_model() -> None:
    r = Result("stream", 4, 10.0, 40, 1000, 4_000_000, 5, model_params=1_000_000, sync_cpu_s=2.0)
    r.sync_peak_rss = 12_000_000
    r.sync_system_s = 0.5
    assert per_cpu_second(r) == 2_000_000
    assert rss_over_model(r) == 3.0  # 12 MB held for a 4 MB fp32 model
    row = summary_row(r)
    assert row["params_per_cpu_s"] == 2_000_000
    assert row["rss_over_fp32_model"] == 3.0
    assert "contribute_ms" not in row
    unknown = Result("stream", 1, 1.0, 0, 0, 0, 0)
    assert per_cpu_second(unknown) is None
    assert rss_over_model(unknown) is None
    table = report([r, unknown], build_plan([("w", (1000,))], 1, inner_steps=4), 123)
    assert "123 bytes per fragment contribution" in table
    assert "2.0" in table.splitlines()[2]
    assert "3.0x" in table.splitlines()[2]
    storage_row = table.splitlines()[6].split()
    assert storage_row[5:7] == ["2.0", "25%"]  # the synchronizer's CPU seconds, the kernel's share
    assert table.splitlines()[7].split()[5:7] == ["-", "-"]  # unread


def test_the_scale_plot_takes_rows_of_older_runs_and_figures_a_run_could_not_read() -> None:
    """A row written before the storage and the commit time were recorded ran on a folder; a figure
    that is None (unreadable) or missing is left out of the plot, not an error."""
    from diloco_bench import plots

    old = {"clients": 4, "mode": "stream", "model_params": 2_000_000, "params_per_cpu_s": 3e7,
           "rss_over_fp32_model": 30.0, "merge_s_per_round": 0.2}  # fmt: skip
    new = summary_row(
        Result("stream", 4, 10.0, 40, 1000, 4_000_000, 5, model_params=20_000_000, sync_cpu_s=2.0)
    )
    new |= {"storage": "seaweedfs", "merge_s_per_round": 1.0, "commit_s_per_round": 2.0}
    lines = scale_lines([old, new])
    assert sorted(lines) == [
        "file, 4 clients, 1 shard(s), stream",
        "seaweedfs, 4 clients, 1 shard(s), stream",
    ]
    assert lines["file, 4 clients, 1 shard(s), stream"][0]["params"] == 2_000_000
    assert new["rss_over_fp32_model"] is None
    figure = plots.sync_scale(lines)
    assert len(figure.axes) == 3
