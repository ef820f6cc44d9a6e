"""Each experiment runs end to end from its ``main`` at a tiny size and prints its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diloco_bench import (
    bandwidth,
    chaos,
    codec,
    codecs,
    gpu,
    hetero,
    merge_rule,
    plots,
    quality,
    quantize,
    simulate,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "2"]


def assert_png(path: Path) -> None:
    """A PNG file with its signature, an IHDR chunk of nonzero size, and more than a header."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 0
    assert height > 0
    assert len(data) > 1000


@pytest.mark.slow
def test_quality_prints_one_row_per_method(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    argv = [
        *TINY,
        "--steps",
        "8",
        "--inner-steps",
        "4",
        "--seeds",
        "0,1",
        "--json",
        str(out),
        "--plot-dir",
        str(tmp_path),
    ]
    assert quality.main(argv) == 0
    text = capsys.readouterr().out
    assert_png(tmp_path / "quality.png")
    assert f"plot: {tmp_path / 'quality.png'}" in text
    for name in ("data-parallel (fp32)", "DiLoCo sync (fp32)", "decoupled (int4)"):
        assert f"| {name} |" in text
    data = json.loads(out.read_text())
    assert [len(v) for v in data.values()] == [2, 2, 2]
    assert all(r["eval_loss"] > 0 for v in data.values() for r in v)


@pytest.mark.slow
def test_bandwidth_ranks_data_parallel_as_the_heaviest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "b.json"
    argv = [*TINY, "--steps", "8", "--inner-steps", "4", "--large-h", "8", "--learners", "2", "--json", str(out),
            "--plot-dir", str(tmp_path)]  # fmt: skip
    assert bandwidth.main(argv) == 0
    assert_png(tmp_path / "bandwidth.png")
    rows = json.loads(out.read_text())
    up = {r["method"]: sum(r["bytes_up"]) / r["tokens"] for r in rows}
    down = {r["method"]: r["bytes_down"] / r["tokens"] for r in rows}
    assert max(up, key=up.__getitem__) == max(down, key=down.__getitem__) == "data-parallel (fp32)"
    assert up["int1 + error feedback"] < up["int2 + error feedback"] < up["decoupled (int4), H = 4"]
    assert down["int4, down int1"] * 4 < down["decoupled (int4), H = 4"]
    combined = "H = 8: int1 + EF up, int1 down"
    assert up[combined] < up["int1 + error feedback"]
    assert down[combined] < down["int4, down int1"]
    assert "down vs DP bf16" in capsys.readouterr().out


def test_bandwidth_refuses_a_run_too_short_to_sync() -> None:
    with pytest.raises(SystemExit):
        bandwidth.main(["--steps", "4", "--inner-steps", "16"])


@pytest.mark.slow
def test_codecs_table_lists_the_unmeasured_low_bit_rows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [
        *TINY,
        "--steps",
        "4",
        "--learners",
        "2",
        "--codecs",
        "fp32,int4,int1",
        "--plot-dir",
        str(tmp_path),
    ]
    assert codecs.main(argv) == 0
    assert_png(tmp_path / "codecs.png")
    text = capsys.readouterr().out
    assert "| int4 |" in text
    assert "| int2 | not measured |" in text  # beside the paper's 2-bit figure
    assert "| int1 | not measured |" not in text
    assert "| int1 | 5." in text  # measured (a loss near 5.5 after 4 steps)


def test_experiments_refuse_fewer_inner_steps_than_fragments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        quality.main(["--inner-steps", "2"])
    assert "--inner-steps must be at least 4" in capsys.readouterr().err


def test_codecs_rejects_an_unknown_codec() -> None:
    with pytest.raises(SystemExit):
        codecs.main(["--codecs", "int3"])


@pytest.mark.slow
def test_hetero_lock_step_loses_goodput(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    argv = [*TINY, "--steps", "8", "--inner-steps", "4", "--learners", "4", "--seeds", "0", "--json", str(out),
            "--plot-dir", str(tmp_path)]  # fmt: skip
    assert hetero.main(argv) == 0
    assert_png(tmp_path / "hetero.png")
    data = json.loads(out.read_text())
    assert data["K=all"][0]["goodput"] < 0.99
    assert data["K=1 + grace"][0]["goodput"] == pytest.approx(1.0)


@pytest.mark.slow
def test_merge_rule_reports_norm_ratios(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        merge_rule.main(
            [*TINY, "--steps", "8", "--inner-steps", "4", "--learners", "2,4", "--plot-dir", str(tmp_path)]
        )
        == 0
    )
    assert_png(tmp_path / "merge-rule.png")
    text = capsys.readouterr().out
    assert "| rda | 4 | 1.000 |" in text
    assert "| mean | 4 |" in text


def test_chaos_loss_at_takes_the_last_sample_before_the_instant() -> None:
    losses = [(1.0, 5.0), (2.0, 4.0), (3.0, 3.5)]
    assert chaos.loss_at(losses, 2.5) == 4.0
    assert chaos.loss_at(losses, 0.5) is None


def test_chaos_compares_modes_at_the_shortest_run() -> None:
    fast = {"mode": "decoupled", "goodput": 0.97, "final_loss": 3.0, "kills": 2, "tokens": 1000,
            "duration_s": 10.0, "losses": [(5.0, 4.0), (10.0, 3.0)]}  # fmt: skip
    slow = {"mode": "ddp", "goodput": 0.6, "final_loss": 3.2, "kills": 2, "tokens": 1000,
            "duration_s": 20.0, "losses": [(9.0, 4.5), (20.0, 3.2)]}  # fmt: skip
    broken = {"mode": "diloco-sync", "error": "exit 2: not supported", "wall_s": 1.0}
    text = chaos.report([fast, slow, broken])
    assert "loss at 10 s" in text
    assert "| ddp | 60.0% | 3.2000 | 4.5000 |" in text
    assert "| diloco-sync | did not run |" in text


def test_chaos_rejects_an_unknown_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert chaos.main(["--modes", "allreduce"]) == 2
    assert "unknown mode" in capsys.readouterr().err


def test_chaos_passes_the_same_failure_schedule_to_every_mode(tmp_path: Path) -> None:
    a = chaos.build_parser().parse_args(["--seed", "7", "--mtbf", "12", "--repair", "3"])
    cmds = [chaos.run_command(mode, a, tmp_path) for mode in ("decoupled", "ddp")]
    for flag, value in (("--seed", "7"), ("--mtbf", "12.0"), ("--repair", "3.0")):
        assert all(c[c.index(flag) + 1] == value for c in cmds)
    assert [c[c.index("--mode") + 1] for c in cmds] == ["decoupled", "ddp"]


def test_chaos_compares_all_three_modes_by_default() -> None:
    assert chaos.build_parser().parse_args([]).modes == "decoupled,diloco-sync,ddp"


def test_chaos_plots_each_mode_that_ran_with_its_kills(tmp_path: Path) -> None:
    summaries = [
        {"mode": "decoupled", "losses": [(5.0, 4.0), (10.0, 3.0)], "kill_times": [3.0, 7.5]},
        {"mode": "ddp", "losses": [(9.0, 4.5), (20.0, 3.2)], "kill_times": [4.0]},
        {"mode": "diloco-sync", "error": "exit 2: not supported", "wall_s": 1.0},
    ]
    curves = chaos.curves(summaries)
    assert [mode for mode, _, _ in curves] == ["decoupled", "ddp"]
    assert curves[0][2] == [3.0, 7.5]
    a = chaos.build_parser().parse_args(["--plot-dir", str(tmp_path)])
    assert plots.emit(a, "chaos", lambda: plots.chaos(curves)) == tmp_path / "chaos.png"
    assert_png(tmp_path / "chaos.png")


def test_no_plot_writes_nothing(tmp_path: Path) -> None:
    a = chaos.build_parser().parse_args(["--plot-dir", str(tmp_path / "plots"), "--no-plot"])
    assert plots.emit(a, "chaos", lambda: plots.chaos([])) is None
    assert not (tmp_path / "plots").exists()


def test_simulate_writes_its_json_file_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    argv = ["--seeds", "1", "--horizon-days", "1", "--json", str(out), "--plot-dir", str(tmp_path)]
    assert simulate.main(argv) == 0
    assert "Decoupled M=8" in capsys.readouterr().out  # the tables are printed as well
    doc = json.loads(out.read_text())
    assert doc["goodput"]["chips"][0] == 150_000
    chips, rows = simulate.curves(doc)
    assert len(rows) == 6
    assert all(len(ours) == len(chips) for _, ours, _ in rows)
    assert_png(tmp_path / "simulate.png")


@pytest.mark.slow
def test_codec_writes_its_json_file_and_prints_the_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "codec.json"
    argv = [
        "--width",
        "16",
        "--warmup",
        "1",
        "--inner-steps",
        "1",
        "--batch",
        "2",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    assert codec.main(argv) == 0
    assert "int4" in capsys.readouterr().out
    assert {r["format"] for r in json.loads(out.read_text())["rows"]} >= {"fp32", "int4"}


@pytest.mark.integration
@pytest.mark.slow
def test_chaos_runs_the_local_runner_and_reads_its_report(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    argv = ["--modes", "decoupled", "--learners", "2", "--max-steps", "12", "--mtbf", "0", "--time-limit", "120",
            "--runs-dir", str(tmp_path / "runs"), "--json", str(out), "--plot-dir", str(tmp_path),
            "--", "--inner-steps", "4", "--eval-every", "4"]  # fmt: skip
    assert chaos.main(argv) == 0
    assert_png(tmp_path / "chaos.png")
    (summary,) = json.loads(out.read_text())
    assert summary["mode"] == "decoupled"
    assert summary["kills"] == 0
    assert 0.0 < summary["goodput"] <= 1.0
    assert summary["tokens"] > 0
    assert (tmp_path / "runs" / "decoupled").is_dir()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_gpu_skips_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_gpu_runs_every_part_on_the_cpu_at_a_tiny_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", *TINY, "--timed-steps", "2", "--warmup-steps", "1", "--no-compile",
            "--boundaries", "1", "--fragments", "2", "--train-steps", "2", "--threads", "1",
            "--peak-tflops", "1", "--json", str(out)]  # fmt: skip
    assert gpu.main(argv) == 0
    printed = capsys.readouterr().out
    assert "inner step, eager" in printed
    assert "held-out loss" in printed
    figures = json.loads(out.read_text())
    assert figures["eager"]["tokens_per_s"] > 0
    assert [r["fragment"] for r in figures["boundary"]] == [0, 1]
    assert all(r["device_gparams_per_s"] > 0 for r in figures["boundary"])


def test_quantize_compares_numpy_and_torch_and_checks_the_bytes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "quantize.json"
    assert quantize.main(["--params", "5000", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == ["fp32", "bf16", "fp16", "int8", "int4", "e3m0", "int2"]
    assert all(r["identical"] and r["torch_decode"] > 0 for r in rows)
    assert "| int4 |" in capsys.readouterr().out


def test_quality_runs_only_the_methods_asked_for(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = [*TINY, "--steps", "4", "--inner-steps", "4", "--seeds", "0", "--only", "decoupled", "--no-plot"]
    assert quality.main(argv) == 0
    text = capsys.readouterr().out
    assert "| decoupled (int4) |" in text
    assert "data-parallel" not in text
    assert "DiLoCo sync" not in text


def test_quality_rejects_an_unknown_method(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        quality.main(["--only", "decoupled,zero"])
    assert "unknown methods ['zero']" in capsys.readouterr().err


def test_bandwidth_larger_h_rows_take_their_own_outer_optimizer() -> None:
    a = bandwidth.parser().parse_args(["--outer-momentum", "0.8", "--large-h", "64", "--large-h-outer-lr", "1.0",
                                       "--large-h-outer-momentum", "0.7"])  # fmt: skip
    rows = {m.name: m for m in bandwidth.methods(a)}
    big = rows["H = 64, outer lr 1, momentum 0.7 (int4)"]
    combined = rows["H = 64: int1 + EF up, int1 down"]
    assert (big.settings.inner_steps, big.settings.outer_lr, big.settings.outer_momentum) == (64, 1.0, 0.7)
    assert (combined.settings.inner_steps, combined.settings.outer_lr, combined.settings.outer_momentum) == (
        64,
        1.0,
        0.7,
    )
    today = rows["decoupled (int4), H = 16"]
    assert (today.settings.inner_steps, today.settings.outer_momentum) == (16, 0.8)
    same = {m.name: m for m in bandwidth.methods(bandwidth.parser().parse_args(["--outer-momentum", "0.8"]))}
    assert same["H = 64, outer lr 0.7 (int4)"].settings.outer_momentum == 0.8


def test_bandwidth_takes_several_larger_h_values_one_row_each_in_order() -> None:
    a = bandwidth.parser().parse_args(["--large-h", "32,128", "--up-codec", "int2", "--down-codec", "int2"])
    names = [m.name for m in bandwidth.methods(a)]
    assert names[3:5] == ["H = 32, outer lr 0.7 (int4)", "H = 128, outer lr 0.7 (int4)"]
    assert names[-2:] == ["H = 32: int2 + EF up, int2 down", "H = 128: int2 + EF up, int2 down"]
    assert [m.settings.inner_steps for m in bandwidth.methods(a)][-2:] == [32, 128]
    for bad in (["--large-h", "32,x"], ["--large-h", "0"], ["--large-h", ","], ["--large-h", "2"]):
        with pytest.raises(SystemExit):
            bandwidth.main(bad)
