"""`diloco bench round-memory`: the synchronizer's round over taken contributions, measured."""

from __future__ import annotations

import json
from pathlib import Path

from diloco_bench import round_memory


def test_the_rounds_peak_does_not_grow_with_the_contributions_it_merges(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["--params", "4e5", "--fragments", "2", "--contributions", "2", "12", "--json", str(out)]
    assert round_memory.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["contributions"], r["merged"]) for r in rows] == [(2, 2), (12, 12)]
    assert rows[0]["fragment_values"] == rows[1]["fragment_values"] > 150_000
    few, many = rows[0]["peak_x"], rows[1]["peak_x"]
    assert 1.0 < few < 8.0  # the round's new state and its encoded objects, a few times the fragment
    assert many < few + 0.5, (few, many)
