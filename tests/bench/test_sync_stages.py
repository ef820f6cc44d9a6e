"""The synchronizer's stages timed on its own code: every stage takes time (a further part of a
learner's progress too), the arrival check costs more than the decompression it includes, the
floors follow from the stages, and a round's cost is fitted against its number of contributions."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from diloco_bench.sync_stages import round_scaling


def test_every_stage_is_timed_and_the_floors_follow_from_them(tmp_path: Path) -> None:
    out = tmp_path / "stages.json"
    # a process of its own: the benchmark takes the synchronizer's allocator settings, the whole process's
    args = [
        "--params",
        "2e6",
        "--fragments",
        "2",
        "--contributions",
        "1",
        "2",
        "--repeat",
        "2",
        "--json",
        str(out),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "diloco_bench.sync_stages", *args],
        check=True,
        timeout=600,
        capture_output=True,
        text=True,
    )
    figures = json.loads(out.read_text())
    rows = figures["rows"]
    assert [row["contributions"] for row in rows] == [1, 2]
    stages = ("write", "decompress", "check", "round", "fold", "serve", "learner decode", "state read")
    for row in rows:
        ms = row["ms"]
        assert all(ms[stage] > 0 for stage in stages), ms
        assert ms["check"] > ms["decompress"]
        assert ms["round"] > ms["serve"]  # the round encodes the version it serves
        assert 0.5 < row["served_over_fp32"] < 1  # random normal float32, in byte planes
        floor = row["fragment_values"] / (
            (ms["write"] + ms["check"] + ms["round"] / row["contributions"]) / 1000
        )
        assert math.isclose(row["floor_params_per_cpu_s"], floor, rel_tol=1e-9)
        assert row["floor_per_part_params_per_cpu_s"] > 0
    assert figures["scaling"] == [round_scaling(rows)]
    assert "one more contribution (write, check, merge)" in done.stdout


def _row(contributions: int, round_ms: float, write: float = 1.0, check: float = 3.0) -> dict[str, object]:
    return {
        "fragment_values": 1_000_000,
        "contributions": contributions,
        "ms": {"round": round_ms, "write": write, "check": check},
    }


def test_a_round_is_a_fixed_part_and_a_part_per_contribution() -> None:
    line = round_scaling([_row(1, 110.0), _row(4, 140.0, write=2.0), _row(16, 260.0, check=5.0)])
    assert line["contributions"] == [1, 4, 16]
    assert math.isclose(line["fixed_ms"], 100.0, abs_tol=1e-9)
    assert math.isclose(line["per_contribution_ms"], 10.0, abs_tol=1e-9)
    # one more contribution: the least write and check measured, and its part of the merge
    assert math.isclose(line["per_contribution_params_per_cpu_s"], 1_000_000 / ((1.0 + 3.0 + 10.0) / 1000))
    with pytest.raises(ValueError, match="two or more sizes"):
        round_scaling([_row(4, 140.0), _row(4, 150.0)])
