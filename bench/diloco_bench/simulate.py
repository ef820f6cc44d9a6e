"""Benchmark `simulate`: the paper's Table 1 (goodput vs chips) reproduced by the event simulator.

A thin wrapper around `diloco simulate` with the paper's grid (150k..2.4M chips, M = 2, 4, 8, 16,
MTBI 1 year per chip); any extra flags are passed through (e.g. ``--json``, ``--seeds 1,2,3,4,5``).
"""

from __future__ import annotations

import sys

from diloco.simulate.cli import main as simulate_main


def main(argv: list[str]) -> int:
    return simulate_main(["--chips", "150000,300000,600000,1200000,2400000", "--learners", "2,4,8,16", *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
