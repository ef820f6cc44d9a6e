"""One plot per experiment: pure functions from figures to a matplotlib ``Figure``, and ``save``.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no global state) and written as PNG
through the Agg renderer, so nothing here needs a display. ``add_flags`` gives a command the shared
``--plot-dir`` / ``--no-plot`` flags; ``emit`` writes a figure where they say.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

DEFAULT_DIR = Path("bench-results")
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plot-dir",
        type=Path,
        default=DEFAULT_DIR,
        help="write the experiment's PNG plot into this folder (default %(default)s)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write a plot")


def emit(a: argparse.Namespace, name: str, build: Callable[[], Figure]) -> Path | None:
    """Build and write ``<plot-dir>/<name>.png`` unless ``--no-plot``; prints and returns its path."""
    if a.no_plot:
        return None
    path = save(build(), a.plot_dir, name)
    print(f"plot: {path}", flush=True)
    return path


def save(fig: Figure, directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.png"
    fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
    return path


def _figure(ncols: int = 1, width: float = 7.0) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(width, 4.0), layout="constrained")
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _spread(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _bars(ax: Axes, groups: Mapping[str, Sequence[float]], ylabel: str) -> None:
    """Mean ± std per group as a marker with error bars (no bar: loss axes do not start at 0), every
    single value as a small dot beside it."""
    for i, (name, values) in enumerate(groups.items()):
        mean, std = _spread(values)
        color = COLORS[i % len(COLORS)]
        ax.errorbar([i], [mean], yerr=[std], fmt="s", markersize=8, capsize=6, color=color, label=name)
        ax.plot([i + 0.12] * len(values), values, ".", color="black", markersize=4)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_xticks(range(len(groups)), list(groups), rotation=15, ha="right")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def quality(losses: Mapping[str, Sequence[float]]) -> Figure:
    """Held-out loss per method, mean ± std over seeds (dots: single seeds)."""
    fig, (ax,) = _figure()
    _bars(ax, losses, "held-out loss (global model)")
    ax.set_title("Quality: held-out loss per method (same tokens)")
    return fig


def loss_curves(
    curves: Mapping[str, Sequence[tuple[int, float]]], title: str = "Quality: held-out loss over tokens"
) -> Figure:
    """Held-out loss of the global model over training tokens, one line per method (mean over seeds)."""
    fig, (ax,) = _figure(width=8.0)
    for i, (name, points) in enumerate(curves.items()):
        ax.plot(
            [t for t, _ in points],
            [v for _, v in points],
            "o-",
            markersize=2,
            color=COLORS[i % len(COLORS)],
            label=name,
        )
    ax.set_xlabel("training tokens (all learners)")
    ax.set_ylabel("held-out loss (global model)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def bandwidth(per_token: Mapping[str, float], baseline: str) -> Figure:
    """Bytes uploaded per token per method/codec on a log axis, annotated with the ratio to ``baseline``."""
    fig, (ax,) = _figure(width=8.0)
    names = list(per_token)[::-1]
    ax.barh(names, [per_token[n] for n in names], color=[_kind_color(n) for n in names])
    for i, n in enumerate(names):
        ax.text(per_token[n], i, f" {per_token[baseline] / per_token[n]:.0f}x", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"bytes up per token (log); label: ratio to {baseline}")
    ax.set_title("Bandwidth: bytes on the wire per token")
    return fig


def _kind_color(name: str) -> str:
    return (
        COLORS[0]
        if name.startswith("data-parallel")
        else COLORS[1]
        if name.startswith("DiLoCo")
        else COLORS[2]
    )


def codecs(
    points: Mapping[str, tuple[float, Sequence[float]]],
    title: str = "Codecs: loss vs bytes on the wire " "(decoupled DiLoCo)",
    xlabel: str = "bytes up per token (log)",
) -> Figure:
    """Held-out loss (mean ± std over seeds) vs bytes per token, one point per codec (or candidate)."""
    fig, (ax,) = _figure()
    for i, (codec, (bpt, losses)) in enumerate(points.items()):
        mean, std = _spread(losses)
        ax.errorbar([bpt], [mean], yerr=[std], fmt="o", capsize=4, color=COLORS[i % len(COLORS)], label=codec)
        ax.annotate(codec, (bpt, mean), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out loss")
    ax.set_title(title)
    return fig


def hetero(goodput: Mapping[str, Sequence[float]], loss: Mapping[str, Sequence[float]]) -> Figure:
    """Goodput (%) and held-out loss per round policy, mean ± std over seeds."""
    fig, (left, right) = _figure(ncols=2, width=9.0)
    stats = [_spread([100 * g for g in v]) for v in goodput.values()]  # goodput starts at 0: bars
    left.bar(
        range(len(stats)),
        [m for m, _ in stats],
        yerr=[e for _, e in stats],
        capsize=6,
        color=COLORS[: len(stats)],
        alpha=0.8,
    )
    for i, (m, _) in enumerate(stats):
        left.text(i, m, f"{m:.1f}%", ha="center", va="bottom")
    left.set_xticks(range(len(stats)), list(goodput), rotation=15, ha="right")
    left.set_ylabel("goodput (%)")
    left.set_ylim(0, 110)
    _bars(right, loss, "held-out loss")
    fig.suptitle("Mixed hardware: goodput and loss per round policy")
    return fig


def chaos(runs: Sequence[tuple[str, Sequence[tuple[float, float]], Sequence[float]]]) -> Figure:
    """Held-out loss over wall-clock time per (mode, [(seconds, loss)], kill times) on one axes; the
    kills of each mode are marked (x) in its colour on its own strip along the bottom."""
    fig, (ax,) = _figure(width=8.0)
    for i, (mode, samples, kills) in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        ax.plot(
            [t for t, _ in samples],
            [v for _, v in samples],
            "o-",
            markersize=3,
            color=color,
            label=f"{mode} ({len(kills)} kills)",
        )
        strip = 0.04 + 0.05 * (len(runs) - 1 - i)  # axes fraction: one row of kill marks per mode
        ax.plot(
            kills, [strip] * len(kills), "x", color=color, markersize=7, transform=ax.get_xaxis_transform()
        )
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo - 0.06 * len(runs) * (hi - lo), hi)  # room for the kill strips under the curves
    ax.set_xlabel("wall-clock seconds since the run started")
    ax.set_ylabel("held-out loss (global model)")
    ax.set_title("Chaos: loss over wall time, same failure schedule (x along the bottom: kills)")
    ax.legend()
    return fig


def simulate(
    chips: Sequence[int], rows: Sequence[tuple[str, Sequence[float], Sequence[float | None]]]
) -> Figure:
    """Goodput vs chips per method: ours as lines, the paper's Table 1 as markers of the same colour."""
    fig, (ax,) = _figure(width=8.0)
    for i, (label, ours, paper) in enumerate(rows):
        color = COLORS[i % len(COLORS)]
        ax.plot(chips, ours, "-", color=color, label=label)
        known = [(c, p) for c, p in zip(chips, paper, strict=True) if p is not None]
        ax.plot([c for c, _ in known], [p for _, p in known], "x", color=color, markersize=7)
    ax.set_xscale("log")
    ax.set_xlabel("chips (log)")
    ax.set_ylabel("goodput (%)")
    ax.set_title("Simulator: goodput vs chips (lines: ours, x: paper Table 1)")
    ax.legend(fontsize=8)
    return fig


def merge_rule(
    ratios: Mapping[str, Mapping[int, float]], losses: Mapping[str, Mapping[int, Sequence[float]]]
) -> Figure:
    """Left: merged norm / mean norm vs M per rule next to 1/sqrt(M); right: held-out loss vs M."""
    fig, (left, right) = _figure(ncols=2, width=9.0)
    sizes = sorted({m for by_m in ratios.values() for m in by_m})
    for i, (rule, by_m) in enumerate(ratios.items()):
        ms = sorted(by_m)
        left.plot(ms, [by_m[m] for m in ms], "o-", color=COLORS[i], label=rule)
        stats = [_spread(losses[rule][m]) for m in ms]
        right.errorbar(
            ms,
            [s[0] for s in stats],
            yerr=[s[1] for s in stats],
            fmt="o-",
            capsize=4,
            color=COLORS[i],
            label=rule,
        )
    left.plot(sizes, [1 / math.sqrt(m) for m in sizes], "k--", label="1/sqrt(M)")
    for ax, ylabel in ((left, "merged norm / mean norm"), (right, "held-out loss")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(m) for m in sizes])
        ax.set_xlabel("M (learners per merge)")
        ax.set_ylabel(ylabel)
        ax.legend()
    left.set_ylim(0, 1.1)
    fig.suptitle("Merge rule: mean vs RDA")
    return fig


_SCALE_FIGURES = ("params_per_cpu_s", "rss_over_fp32_model", "merge_s_per_round", "commit_s_per_round")


def sync_scale(lines: Mapping[str, Sequence[Mapping[str, float]]]) -> Figure:
    """The synchronizer's costs against the model size, a line per storage (each point a run of
    ``diloco bench sync-ingest``, with ``params``, ``params_per_cpu_s``, ``rss_over_fp32_model``,
    ``merge_s_per_round``, ``commit_s_per_round``): parameters taken per CPU second, peak memory over
    the fp32 model, and the merge and commit time per round."""
    fig, (work, memory, rounds) = _figure(ncols=3, width=13.0)
    for i, (label, points) in enumerate(lines.items()):
        color = COLORS[i % len(COLORS)]
        rows = [  # a figure a run could not read, or that a row of an older run lacks, is NaN
            {**r, **{k: math.nan if r.get(k) is None else r[k] for k in _SCALE_FIGURES}}
            for r in sorted(points, key=lambda r: r["params"])
        ]
        sizes = [r["params"] for r in rows]
        work.plot(sizes, [r["params_per_cpu_s"] / 1e9 for r in rows], "o-", color=color, label=label)
        memory.plot(sizes, [r["rss_over_fp32_model"] for r in rows], "o-", color=color, label=label)
        timed = [r for r in rows if r["merge_s_per_round"] > 0]  # NaN and no round are left out
        at = [r["params"] for r in timed]
        rounds.plot(at, [r["merge_s_per_round"] for r in timed], "o-", color=color, label=f"{label}: merge")
        rounds.plot(
            at, [r["commit_s_per_round"] for r in timed], "s--", color=color, label=f"{label}: commit"
        )
    work.axhline(0.5, color="k", linestyle=":", label="target 0.5")
    memory.axhline(4.0, color="k", linestyle=":", label="target 4x")
    for ax, ylabel in (
        (work, "G params per synchronizer CPU-s"),
        (memory, "peak RSS / fp32 model (log)"),
        (rounds, "s per round (log)"),
    ):
        ax.set_xscale("log")
        ax.set_xlabel("model parameters (log)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    rounds.set_yscale("log")
    memory.set_yscale("log")
    fig.suptitle("Synchronizer costs against the model size (diloco bench sync-ingest)")
    return fig
