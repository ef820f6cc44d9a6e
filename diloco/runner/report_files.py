"""Writing the report: report.json, report.md and the loss plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path

from diloco.runner.record import RunRecord
from diloco.runner.report import Report, build_report, render_markdown


def write_report(record: RunRecord, run_dir: Path) -> tuple[Report, str]:
    """Build the report, write its files into ``run_dir`` and return it with its markdown."""
    report = build_report(record)
    markdown = render_markdown(report)
    plots = write_loss_plots(record, run_dir)
    if plots:
        markdown += "\n## Plots\n\n" + "".join(f"![{p.stem}]({p.name})\n" for p in plots)
    (run_dir / "report.md").write_text(markdown)
    payload = {"summary": report.to_dict(), "record": record.to_dict()}
    (run_dir / "report.json").write_text(json.dumps(payload, indent=2, allow_nan=False, default=str))
    return report, markdown


def write_loss_plots(record: RunRecord, run_dir: Path) -> list[Path]:
    """``loss.png``: held-out loss of the global model over tokens and over wall time."""
    if not record.losses:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    tokens = [s.tokens for s in record.losses]
    times = [s.wall_s for s in record.losses]
    losses = [s.loss for s in record.losses]
    by_tokens.plot(tokens, losses, marker=".")
    by_tokens.set_xlabel("tokens (all learners)")
    by_time.plot(times, losses, marker=".")
    by_time.set_xlabel("wall time (s)")
    for kill in record.kills:
        by_time.axvline(kill.at_s, color="tab:red", alpha=0.3, linewidth=1)
    for ax in (by_tokens, by_time):
        ax.set_ylabel("held-out loss (global model)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{record.mode}: held-out loss (red lines: learner kills)")
    path = run_dir / "loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
