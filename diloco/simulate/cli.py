"""`diloco simulate`: goodput of data-parallel vs decoupled training at scale, and WAN bandwidth.

Prints the Table-1-style comparison (ours vs the paper's, per cell) and the bandwidth estimates, or
the same as JSON with ``--json``. ``diloco simulate run [diloco run flags]`` instead predicts the
goodput of a local job (:mod:`diloco.simulate.job_cli`). The model and its assumptions:
docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace

from diloco.simulate.bandwidth import Bandwidth, LinkSettings, estimate_bandwidth
from diloco.simulate.goodput import Table, goodput_table
from diloco.simulate.model import PAPER_CHIPS, SECONDS_PER_YEAR, SimParams, default_rows


def _int_list(text: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.replace("_", "").split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco simulate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chips",
        type=_int_list,
        default=list(PAPER_CHIPS),
        help="comma-separated chip counts (default: the paper's 150k..2.4M)",
    )
    parser.add_argument(
        "--learners",
        type=_int_list,
        default=[2, 4, 8, 16],
        help="comma-separated numbers of decoupled learners M (default 2,4,8,16)",
    )
    parser.add_argument(
        "--mtbi-years",
        type=_positive,
        default=1.0,
        help="mean time between interruptions of one chip, in years (default 1)",
    )
    parser.add_argument("--no-failures", action="store_true", help="disable failures (goodput must be 100%%)")
    parser.add_argument(
        "--seeds", type=_int_list, default=[1, 2, 3], help="comma-separated seeds (default 1,2,3)"
    )
    parser.add_argument(
        "--horizon-days", type=_positive, default=7.0, help="simulated time per run, in days (default 7)"
    )
    parser.add_argument(
        "--slice-chips",
        type=int,
        default=SimParams().slice_chips,
        help="chips per elastic slice (default 256)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    link = parser.add_argument_group("bandwidth estimate")
    link.add_argument(
        "--params", type=_positive, default=LinkSettings.params, help="model parameters (default 12e9)"
    )
    link.add_argument(
        "--step-time",
        type=_positive,
        default=LinkSettings.step_time_s,
        help="seconds per inner step (default 1)",
    )
    link.add_argument(
        "--bytes-per-value",
        type=_positive,
        default=LinkSettings.bytes_per_value,
        help="bytes per gradient value for data-parallel (default 2, bf16)",
    )
    link.add_argument("--inner-steps", type=int, default=LinkSettings.inner_steps, help="H (default 100)")
    link.add_argument("--fragments", type=int, default=LinkSettings.fragments, help="P (default 4)")
    link.add_argument("--overlap", type=int, default=LinkSettings.overlap, help="tau, steps (default 1)")
    link.add_argument(
        "--quantizer-bits",
        type=_positive,
        default=LinkSettings.quantizer_bits,
        help="bits per outer-gradient value (default 4)",
    )
    return parser


def _cell_text(table: Table, key: str, chips: int) -> str:
    row = next(r for r in table.rows if r.key == key)
    cell = table.cell(row, chips)
    paper = "  -" if cell.paper_percent is None else f"{cell.paper_percent:3.0f}"
    return f"{cell.percent:5.1f} /{paper}"


def render_table(table: Table) -> str:
    header = f"{'goodput %, ours / paper':<24}" + "".join(f"{_chips_label(c):>13}" for c in table.chips)
    lines = [header, "-" * len(header)]
    for row in table.rows:
        lines.append(
            f"{row.label:<24}" + "".join(f"{_cell_text(table, row.key, c):>13}" for c in table.chips)
        )
    return "\n".join(lines)


def _chips_label(chips: int) -> str:
    if chips >= 1_000_000:
        return f"{chips / 1e6:g}M"
    return f"{chips / 1e3:g}k" if chips >= 1000 else str(chips)


def render_bandwidth(rows: Sequence[Bandwidth], link: LinkSettings) -> str:
    lines = [
        f"WAN bandwidth per learner: {link.params:.3g} params, {link.step_time_s:g} s/step, "
        f"DP {link.bytes_per_value:g} B/value, H={link.inner_steps}, tau={link.overlap}, "
        f"outer gradient {link.quantizer_bits:g} bits/value",
        f"{'method':<20}{'mean Gbit/s':>14}{'peak Gbit/s':>14}{'vs DP (mean)':>14}",
    ]
    dp = rows[0].mean_gbps
    for r in rows:
        lines.append(f"{r.method:<20}{r.mean_gbps:>14.3f}{r.peak_gbps:>14.3f}{dp / r.mean_gbps:>13.0f}x")
    return "\n".join(lines)


def _headline(table: Table) -> str | None:
    keys = {r.key: r for r in table.rows}
    if 1_200_000 not in table.chips or "decoupled-8" not in keys or "dp" not in keys:
        return None
    dec = table.cell(keys["decoupled-8"], 1_200_000).percent
    dp = table.cell(keys["dp"], 1_200_000).percent
    return f"headline at 1.2M chips: decoupled M=8 {dec:.0f}% vs data-parallel {dp:.0f}% (paper: 88% vs 27%)"


def simulate(argv: list[str]) -> tuple[str, dict[str, object]]:
    """Run the simulation the flags describe: its tables as text and the same as one JSON document.

    Raises ``ValueError`` for settings that cannot work."""
    args = build_parser().parse_args(argv)
    mtbi = float("inf") if args.no_failures else args.mtbi_years * SECONDS_PER_YEAR
    params = replace(SimParams(), mtbi_s=mtbi, slice_chips=args.slice_chips)
    link = LinkSettings(
        args.params,
        args.step_time,
        args.bytes_per_value,
        args.inner_steps,
        args.fragments,
        args.overlap,
        args.quantizer_bits,
    )
    if any(m > c for m in args.learners for c in args.chips):
        raise ValueError("every learner count must be <= every chip count")
    started = time.perf_counter()
    table = goodput_table(
        args.chips, default_rows(tuple(args.learners)), params, args.horizon_days * 86400, args.seeds
    )
    elapsed = time.perf_counter() - started
    bandwidth = estimate_bandwidth(link)
    doc = {
        "params": _params_dict(params),
        "horizon_days": args.horizon_days,
        "seeds": args.seeds,
        "goodput": table.to_dict(),
        "bandwidth": [asdict(b) for b in bandwidth],
        "link": asdict(link),
        "elapsed_s": round(elapsed, 3),
    }
    lines = [render_table(table)]
    headline = _headline(table)
    if headline:
        lines.append(headline)
    decoupled = [r.key for r in table.rows if r.mode == "decoupled"]
    lines.append(
        f"max |ours - paper|: data-parallel rows {table.max_error(['dp', 'elastic']):.1f} points "
        f"(calibrated), decoupled rows {table.max_error(decoupled):.1f} points (not fitted)"
    )
    lines.append(
        f"({len(args.seeds)} seed(s) x {args.horizon_days:g} simulated days per cell, {elapsed:.1f} s; "
        f"MTBI {'none' if args.no_failures else f'{args.mtbi_years:g} year(s)'} per chip)\n"
    )
    lines.append(render_bandwidth(bandwidth, link))
    return "\n".join(lines), doc


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"]:  # a local job, as `diloco run` would run it with the same flags
        from diloco.simulate import job_cli

        return job_cli.main(argv[1:])
    try:
        text, doc = simulate([a for a in argv if a != "--json"])
    except ValueError as exc:
        print(f"diloco simulate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2) if "--json" in argv else text)
    return 0


def _params_dict(params: SimParams) -> dict[str, object]:
    return {
        "mtbi_s": params.mtbi_s if params.mtbi_s != float("inf") else None,
        "restart": params.restart.describe(),
        "checkpoint_interval_s": params.checkpoint_interval_s,
        "slice_chips": params.slice_chips,
        "slice_repair": params.slice_repair.describe(),
        "t_down_s": params.t_down_s,
        "t_up_s": params.t_up_s,
        "admit_window_s": params.admit_window_s,
    }
