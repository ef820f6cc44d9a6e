"""Benchmark `simulate`: the paper's Table 1 (goodput vs chips) reproduced by the event simulator.

A thin wrapper around `diloco simulate` with the paper's grid (150k..2.4M chips, M = 2, 4, 8, 16,
MTBI 1 year per chip); every other flag is passed through to one simulation run (e.g. ``--seeds 1,2,3,4,5``). It prints
the simulator's tables, writes ``--json PATH`` (the simulator's JSON document) and a plot of goodput
vs chips, ours as lines and the paper's as markers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from diloco.simulate.cli import simulate
from diloco_bench import experiment, plots

GRID = ["--chips", "150000,300000,600000,1200000,2400000", "--learners", "2,4,8,16"]


def curves(doc: dict[str, Any]) -> tuple[list[int], list[tuple[str, list[float], list[float | None]]]]:
    """From the simulator's JSON document: the chip counts and, per row, (label, ours %, paper %)."""
    table = doc["goodput"]
    rows = [
        (r["label"], [c["goodput_percent"] for c in r["cells"]], [c["paper_percent"] for c in r["cells"]])
        for r in table["rows"]
    ]
    return list(table["chips"]), rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="diloco bench simulate",
        description=__doc__,
        epilog="Any other flag goes to `diloco simulate` (see `diloco simulate --help`).",
    )
    experiment.output_flags(p)
    a, rest = p.parse_known_args(argv)
    try:
        text, doc = simulate([*GRID, *rest])
    except ValueError as exc:
        print(f"diloco bench simulate: {exc}", file=sys.stderr)
        return 2
    print(text)
    experiment.write_json(a.json, doc)
    plots.emit(a, "simulate", lambda: plots.simulate(*curves(doc)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
