"""The synchronizer's stages timed on its own code: every stage takes time (a further part of a
learner's progress too), the arrival check costs more than the decompression it includes, and the
floors follow from the stages."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path


def test_every_stage_is_timed_and_the_floors_follow_from_them(tmp_path: Path) -> None:
    out = tmp_path / "stages.json"
    # a process of its own: the benchmark takes the synchronizer's allocator settings, the whole process's
    args = [
        "--params",
        "2e6",
        "--fragments",
        "2",
        "--contributions",
        "2",
        "--repeat",
        "2",
        "--json",
        str(out),
    ]
    subprocess.run([sys.executable, "-m", "diloco_bench.sync_stages", *args], check=True, timeout=600)
    (row,) = json.loads(out.read_text())
    ms = row["ms"]
    stages = (
        "write",
        "decompress",
        "check",
        "round",
        "fold",
        "serve",
        "learner decode",
        "state read",
    )
    assert all(ms[stage] > 0 for stage in stages), ms
    assert ms["check"] > ms["decompress"]
    assert ms["round"] > ms["serve"]  # the round encodes the version it serves
    assert 0.5 < row["served_over_fp32"] < 1  # random normal float32, in byte planes
    values = row["fragment_values"]
    floor = values / ((ms["write"] + ms["check"] + ms["round"] / 2) / 1000)
    assert math.isclose(row["floor_params_per_cpu_s"], floor, rel_tol=1e-9)
    assert row["floor_per_part_params_per_cpu_s"] > 0
