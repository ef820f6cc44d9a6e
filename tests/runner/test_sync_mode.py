"""`diloco run --mode diloco-sync` end to end against `--mode decoupled` with the same chaos: real
synchronizer and learner processes; a learner is SIGKILLed mid-run and restarted in both runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diloco.failures import failure_model_for, failure_schedule
from diloco.runner.timeline import Interval, Rollback, compute_goodput

SEED, MTBF_S, REPAIR_S, TIME_LIMIT_S = 1, 40.0, 6.0, 45.0


def _run(tmp: Path, mode: str) -> dict[str, Any]:
    runs = tmp / mode
    argv = [
        sys.executable, "-m", "diloco", "run", "--mode", mode, "--learners", "2", "--max-steps", "100000",
        "--inner-steps", "8", "--fragments", "2", "--overlap", "1", "--n-embd", "32", "--n-head", "2",
        "--block-size", "32", "--mtbf", str(MTBF_S), "--repair", str(REPAIR_S), "--seed", str(SEED),
        "--time-limit", str(TIME_LIMIT_S), "--plain", "--runs-dir", str(runs),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    report: dict[str, Any] = json.loads((run_dir / "report.json").read_text())
    return report


def _recomputed_goodput(record: dict[str, Any]) -> float | None:
    timeline = record["timeline"]
    intervals = [Interval(i["learner"], i["phase"], i["start_s"], i["end_s"]) for i in timeline["intervals"]]
    blocked = {(b["learner"], b["incarnation"]): b["blocked_s"] for b in timeline["blocked_s"]}
    rollbacks = [
        Rollback(r["learner"], r["at_s"], r["from_step"], r["to_step"], r["step_time_s"])
        for r in timeline["rollbacks"]
    ]
    return compute_goodput(intervals, blocked, rollbacks).goodput


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_synchronous_diloco_loses_goodput_to_a_dead_learner_that_decoupled_keeps(tmp_path: Path) -> None:
    # the schedule is pure: with this seed, learner 0 dies once, after start-up and well before the end
    model = failure_model_for("diloco-sync", learners=2, mtbf_s=MTBF_S, repair_s=REPAIR_S, seed=SEED)
    kills = failure_schedule(model, TIME_LIMIT_S)
    assert [(e.learner, round(e.at_s)) for e in kills] == [(0, 19)]

    reports = {mode: _run(tmp_path, mode) for mode in ("decoupled", "diloco-sync")}
    goodput: dict[str, float] = {}
    blocked: dict[str, float] = {}
    for mode, report in reports.items():
        summary, record = report["summary"], report["record"]
        assert [k["learner"] for k in record["kills"]] == [0], mode
        assert record["kills"][0]["rejoined_at_s"] is not None, mode
        assert summary["total_learner_steps"] > 0
        # the report's figure is the timeline's
        assert summary["goodput"]["goodput"] == pytest.approx(_recomputed_goodput(record)), mode
        goodput[mode] = summary["goodput"]["goodput"]
        blocked[mode] = summary["goodput"]["blocked_s"]

    algo = reports["diloco-sync"]["record"]["settings"]["algorithm"]
    assert (algo["quorum"], algo["overlap"], algo["blocking_sync"]) == (2, 0, True)
    # while learner 0 was down (and starting again) learner 1 waited in the synchronous run
    assert blocked["diloco-sync"] >= REPAIR_S
    assert blocked["diloco-sync"] > 3 * blocked["decoupled"]
    assert goodput["diloco-sync"] < goodput["decoupled"]
    print(f"goodput: decoupled {goodput['decoupled']:.1%}, diloco-sync {goodput['diloco-sync']:.1%}")
