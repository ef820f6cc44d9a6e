"""`diloco bench startup`: medians per phase of a learner's start and restart, next to import torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from diloco_bench import startup
from diloco_worker.startup import PHASES


def record(total: float, cpu: float) -> dict[str, Any]:
    phases = dict.fromkeys(PHASES, 0.0) | {"imports": total - 1.0, "register": 1.0}
    return {"startup_s": total, "startup_cpu_s": cpu, "startup_phases": phases,
            "startup_cpu_phases": dict.fromkeys(PHASES, 0.0) | {"imports": cpu}}  # fmt: skip


def test_medians_per_phase_and_ratios_to_import_torch() -> None:
    raw = {
        "python": [{"wall_s": 0.1, "cpu_s": 0.03}] * 3,
        "import_torch": [{"wall_s": w, "cpu_s": 2.0} for w in (3.0, 4.0, 9.0)],
        "start": [record(t, 2.2) for t in (4.0, 6.0, 5.0)],
        "restart": [record(t, 2.1) for t in (4.4, 4.4, 8.0)],
    }
    s = startup.summarize(raw)
    assert s["import_torch"]["wall_s"] == 4.0
    assert s["start"]["wall_s"] == 5.0
    assert s["start"]["wall_vs_import_torch"] == pytest.approx(1.25)
    assert s["restart"]["cpu_vs_import_torch"] == pytest.approx(1.05)
    assert s["start"]["phases_wall_s"]["register"] == 1.0
    assert s["start"]["phases_wall_s"]["imports"] == 4.0
    text = startup.report(s, 3)
    assert "| `python -c 'import torch'` | 4.00 |  | 2.00 |  |" in text
    assert "| learner / `import torch` | 1.25x | 1.10x | 1.10x | 1.05x |" in text


def test_start_up_records_are_read_per_process(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join([json.dumps({"pid": 3, "step": 1, "startup_s": 2.0}), "{broken",
                               json.dumps({"pid": 3, "step": 2}), json.dumps({"pid": 4, "step": 3, "startup_s": 1.5})]))  # fmt: skip
    assert {pid: r["startup_s"] for pid, r in startup.startup_records(path).items()} == {3: 2.0, 4: 1.5}
    assert startup.startup_records(tmp_path / "none.jsonl") == {}


def test_bad_repeats_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert startup.main(["--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_it_starts_and_restarts_a_real_learner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    assert startup.main(["--repeats", "1", "--n-embd", "32", "--block-size", "32", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (start,), (restart,) = data["raw"]["start"], data["raw"]["restart"]
    assert start["startup_s"] > 0
    assert restart["startup_phases"]["checkpoint"] >= 0
    assert set(start["startup_phases"]) == set(PHASES)
    assert "learner / `import torch`" in capsys.readouterr().out
