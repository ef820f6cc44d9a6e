"""`diloco bench goodput`: what it measures of a run to calibrate the simulator, and its tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from diloco_bench import goodput, plots

from diloco.runner.record import RunRecord
from diloco.runner.timeline import Interval, Timeline
from tests.bench.test_experiments import assert_png


def test_windows_are_the_spans_in_which_every_learner_trains() -> None:
    intervals = [
        Interval(0, "starting", 0, 2), Interval(0, "training", 2, 10), Interval(0, "down", 10, 12),
        Interval(0, "starting", 12, 14), Interval(0, "training", 14, 20),
        Interval(1, "starting", 0, 3), Interval(1, "training", 3, 20),
    ]  # fmt: skip
    assert goodput.all_training_windows(intervals, 2) == [(3, 10), (14, 20)]
    assert goodput.all_training_windows(intervals, 3) == []


def test_the_blocked_fraction_counts_only_record_pairs_inside_a_window() -> None:
    t0 = 1000.0
    records = [
        {"pid": 1, "time": t0 + 3, "blocked_s": 0.0}, {"pid": 1, "time": t0 + 5, "blocked_s": 0.5},
        {"pid": 1, "time": t0 + 9, "blocked_s": 1.0},  # 3..9: 1 s blocked in 6 s
        {"pid": 1, "time": t0 + 12, "blocked_s": 5.0},  # across the gap: ignored
        {"pid": 2, "time": t0 + 14, "blocked_s": 7.0}, {"pid": 2, "time": t0 + 20, "blocked_s": 9.0},  # 2 s in 6 s
    ]  # fmt: skip
    assert goodput.blocked_fraction(records, [(3, 10), (14, 20)], t0) == pytest.approx(3 / 12)
    assert goodput.blocked_fraction(records, [], t0) == 0.0


def run_record(tmp_path: Path) -> RunRecord:
    timeline = Timeline()
    for learner in (0, 1):
        timeline.enter(learner, "starting", 0.0)
        timeline.enter(learner, "training", 4.0 + learner)
    timeline.enter(0, "down", 20.0)
    timeline.enter(0, "starting", 22.0)
    timeline.enter(0, "training", 25.0)
    timeline.close(40.0)
    record = RunRecord(run_dir=str(tmp_path), mode="decoupled", settings={}, started_at=500.0)
    record.timeline = timeline
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    lines = [{"pid": 9, "step": s, "time": 500.0 + 5 + s, "blocked_s": 0.1 * s, "step_time_s": 0.2 + s / 100}
             for s in range(1, 11)]  # fmt: skip
    (metrics / "learner-1.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return record


def test_the_measured_timing_comes_from_the_runs_own_launches_and_records(tmp_path: Path) -> None:
    timing = goodput.measured_timing(run_record(tmp_path), tmp_path / "metrics", 2)
    assert timing["startup_s"] == pytest.approx(4.5)
    assert timing["restart_s"] == pytest.approx(3.0)
    assert timing["step_time_s"] == pytest.approx(0.255)
    assert timing["blocked_fraction"] == pytest.approx(0.1)
    assert timing["restarts"] == 1


def test_a_run_in_which_nobody_trained_cannot_calibrate(tmp_path: Path) -> None:
    record = RunRecord(run_dir=str(tmp_path), mode="ddp", settings={}, started_at=0.0)
    with pytest.raises(ValueError, match="nothing to calibrate"):
        goodput.measured_timing(record, tmp_path, 2)


def result(mode: str, seed: int, measured: float, predicted: float) -> dict[str, Any]:
    figures = {"goodput": measured - 0.02, "steady_goodput": measured, "startup_s": 10.0, "total_s": 400.0}
    return {"mode": mode, "seed": seed, "wall_s": 1.0, "kills": 3, "predicted_kills": 3,
            "timing": {"startup_s": 4.0, "restart_s": 5.0, "step_time_s": 0.1, "blocked_fraction": 0.03},
            "measured": figures, "predicted": figures | {"goodput": predicted - 0.02, "steady_goodput": predicted}}  # fmt: skip


def test_the_summary_gives_each_modes_mean_spread_and_decoupleds_ratio_to_ddp(tmp_path: Path) -> None:
    results = [result("decoupled", 0, 0.88, 0.86), result("decoupled", 1, 0.86, 0.87), result("ddp", 0, 0.25, 0.28),
               {"mode": "ddp", "seed": 1, "error": "exit 1: boom", "wall_s": 1.0}]  # fmt: skip
    s = goodput.summary(results)
    assert s["decoupled"]["measured_steady"] == pytest.approx(0.87)
    assert s["decoupled"]["measured_spread"] == pytest.approx(0.02)
    assert s["decoupled"]["max_abs_points"] == pytest.approx(2.0)
    assert s["ddp"]["runs"] == 1
    text = goodput.render_summary(s)
    assert "decoupled / ddp (steady state, measured): 3.48x" in text
    table = goodput.report(results)
    assert (
        "| decoupled | 0 | 86.0% | 84.0% | +2.0 | 88.0% | 86.0% | +2.0 | 2.5% | 3 / 3 | 4.0 / 5.0 / 0.100 / 3.0% |"
        in table
    )
    assert "did not run" in table
    a = goodput.build_parser().parse_args(["--plot-dir", str(tmp_path)])
    assert plots.emit(a, "goodput", lambda: goodput.figure(results)) == tmp_path / "goodput.png"
    assert_png(tmp_path / "goodput.png")


def test_both_commands_get_the_same_flags_and_bad_choices_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = goodput.build_parser().parse_args(["--learners", "3", "--mtbf", "50", "--", "--inner-steps", "8"])
    flags = goodput.run_flags("ddp", 4, a)
    assert flags[:2] == ["--mode", "ddp"]
    assert flags[flags.index("--seed") + 1] == "4"
    assert flags[-2:] == ["--inner-steps", "8"]
    assert goodput.main(["--modes", "allreduce"]) == 2
    assert goodput.main(["--seeds", "x"]) == 2


@pytest.mark.integration
@pytest.mark.slow
def test_it_runs_the_local_runner_and_the_simulator_on_the_same_flags(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    argv = ["--modes", "decoupled", "--learners", "2", "--mtbf", "15", "--repair", "1", "--seeds", "3",
            "--time-limit", "40", "--runs-dir", str(tmp_path / "runs"), "--json", str(out), "--plot-dir", str(tmp_path),
            "--", "--inner-steps", "4", "--n-embd", "32", "--n-head", "2", "--block-size", "32"]  # fmt: skip
    assert goodput.main(argv) == 0
    assert_png(tmp_path / "goodput.png")
    (r,) = json.loads(out.read_text())["results"]
    assert r["kills"] > 0
    # the same failure instants hit in both (one may land in the runner's polling gap around a restart)
    assert abs(r["kills"] - r["predicted_kills"]) <= 1
    assert 0 < r["measured"]["steady_goodput"] < 1
    assert 0 < r["predicted"]["steady_goodput"] < 1
    assert r["timing"]["startup_s"] > 0
