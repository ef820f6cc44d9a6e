"""`diloco simulate` end to end through its main()."""

from __future__ import annotations

import json

import pytest

from diloco.simulate.cli import main


def test_prints_table_with_paper_values_and_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--chips", "150000,1200000", "--seeds", "1", "--horizon-days", "1"]) == 0
    out = capsys.readouterr().out
    assert "DP, no elasticity" in out
    assert "Decoupled M=16" in out
    assert "/ 27" in out  # the paper's DP cell at 1.2M, printed next to ours
    assert "headline at 1.2M chips: decoupled M=8" in out
    assert "data-parallel" in out
    assert "decoupled (P=4)" in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--json",
                "--chips",
                "300000",
                "--learners",
                "2,8",
                "--seeds",
                "1,2",
                "--horizon-days",
                "1",
                "--params",
                "1e9",
                "--step-time",
                "0.1",
                "--bytes-per-value",
                "4",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    labels = [r["label"] for r in doc["goodput"]["rows"]]
    assert labels == ["DP, no elasticity", "DP, elastic", "Decoupled M=2", "Decoupled M=8"]
    cell = doc["goodput"]["rows"][0]["cells"][0]
    assert cell["chips"] == 300000
    assert cell["paper_percent"] == 57
    assert len(cell["per_seed_percent"]) == 2
    assert 0 < cell["goodput_percent"] < 100
    assert doc["bandwidth"][0]["mean_gbps"] == pytest.approx(1e9 * 32 / 0.1 / 1e9)


def test_no_failures_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "--no-failures", "--chips", "2400000", "--seeds", "1", "--horizon-days", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(c["goodput_percent"] == 100.0 for r in doc["goodput"]["rows"] for c in r["cells"])


def test_more_learners_than_chips_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--chips", "8", "--learners", "16"]) == 2
    assert "every learner count must be <= every chip count" in capsys.readouterr().err


def test_fragments_above_inner_steps_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--chips", "1000", "--inner-steps", "4", "--fragments", "8"]) == 2
    assert "invalid fragments=8" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--chips", "many"], ["--seeds", "0,-1"], ["--mtbi-years", "0"]])
def test_bad_flags_exit_with_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "diloco simulate: error" in capsys.readouterr().err
