"""`diloco simulate run`: the flags of `diloco run` plus measured timings, end to end through main()."""

from __future__ import annotations

import json

import pytest

from diloco.runner.cli import parse_settings
from diloco.simulate.cli import main
from diloco.simulate.job_cli import mean_goodput, simulate_run

RUN_FLAGS = ["--mode", "ddp", "--learners", "4", "--mtbf", "40", "--repair", "3", "--seed", "2", "--time-limit", "200",
             "--max-steps", "1000000"]  # fmt: skip
MEASURED = ["--restart", "5", "--startup", "7", "--step-time", "0.1"]


def test_the_failure_model_is_the_one_diloco_run_builds_from_the_same_flags() -> None:
    _, doc = simulate_run([*RUN_FLAGS, *MEASURED])
    assert doc["failures"] == vars(parse_settings(RUN_FLAGS).failures)
    assert doc["failures"]["elastic"] is False
    assert doc["failures"]["quorum"] == 4
    assert doc["timing"]["startup_s"] == 7.0
    assert [run["seed"] for run in doc["runs"]] == [2]


def test_it_prints_goodput_overall_and_in_the_steady_state(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", *RUN_FLAGS, *MEASURED, "--seeds", "0,1"]) == 0
    out = capsys.readouterr().out
    assert "ddp, 4 learners, 200 s; failures: MTBF 40 s per learner, repair 3 s, not elastic, quorum 4" in out
    assert "start-up 7 s, restart 5 s, step 0.1 s, checkpoint every 10 steps" in out
    assert "mean" in out
    assert main(["run", *RUN_FLAGS, *MEASURED, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    g = mean_goodput(doc)
    assert g.goodput == pytest.approx(doc["runs"][0]["goodput"]["goodput"])
    assert 0 < g.goodput < g.steady_goodput < 1  # type: ignore[operator]


def test_measured_timings_are_required_and_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", *RUN_FLAGS])
    assert "--restart" in capsys.readouterr().err
    assert main(["run", *RUN_FLAGS, *MEASURED, "--seeds", "x"]) == 2
    assert main(["run", "--learners", "0", *MEASURED]) == 2
    assert main(["run", *RUN_FLAGS, "--restart", "5", "--step-time", "0"]) == 2
