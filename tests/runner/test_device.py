"""``diloco run --device cuda``: placement of learners on GPUs, the GPU-sized default model, the
learner commands and environments, and tokens/s and MFU per learner in the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diloco_worker.hardware import peak_tflops_of

from diloco.runner.cli import main, parse_settings
from diloco.runner.commands import CORPUS_BYTES, RunPaths, build_worker_argv, build_worker_env
from diloco.runner.learner_metrics import read_counts
from diloco.runner.record import LearnerTotals
from diloco.runner.report import build_report, render_markdown
from diloco.runner.settings import RunSettings, SettingsError
from tests.runner.test_report import synthetic_record


def _cuda(argv: list[str], gpus: int = 2) -> RunSettings:
    return parse_settings(["--device", "cuda", *argv], count_gpus=lambda: gpus)


def test_learners_go_round_robin_over_the_gpus_each_seeing_only_its_own(tmp_path: Path) -> None:
    s = _cuda(["--learners", "5"], gpus=2)
    assert s.gpus == (0, 1)
    assert [s.gpu_of(i) for i in range(5)] == [0, 1, 0, 1, 0]
    envs = [build_worker_env(s, i, {}, job_secret="x", master_port=1) for i in range(5)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0", "1", "0"]
    argv = build_worker_argv(s, RunPaths(tmp_path), 3, sync_url="http://h:1")
    assert argv[argv.index("--device") + 1] == "cuda:0"
    assert argv[argv.index("--corpus-max-bytes") + 1] == str(CORPUS_BYTES["cuda"])


def test_gpus_already_selected_for_the_runner_keep_their_names() -> None:
    s = _cuda(["--learners", "2", "--gpus", "1,2"], gpus=3)
    base = {"CUDA_VISIBLE_DEVICES": "4, 6,GPU-abc"}
    envs = [build_worker_env(s, i, base, job_secret="x", master_port=1) for i in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["6", "GPU-abc"]


def test_a_cpu_run_is_unchanged(tmp_path: Path) -> None:
    s = parse_settings([], count_gpus=lambda: 8)
    assert (s.device, s.gpus, s.model, s.train.batch_size) == ("cpu", (), RunSettings().model, 8)
    assert "CUDA_VISIBLE_DEVICES" not in build_worker_env(s, 0, {}, job_secret="x", master_port=1)
    argv = build_worker_argv(s, RunPaths(tmp_path), 0, sync_url="http://h:1")
    assert argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--corpus-max-bytes") + 1] == str(4 * 1024 * 1024)  # the worker's default


def test_the_default_model_on_a_gpu_is_gpt2_small_shaped_and_flags_still_win() -> None:
    s = _cuda([])
    m = s.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, s.train.batch_size) == (12, 12, 768, 1024, 16)
    small = _cuda(["--n-layer", "4", "--batch-size", "8"])
    assert (small.model.n_layer, small.model.n_embd, small.train.batch_size) == (4, 768, 8)


def test_gpu_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(SettingsError, match="sees no CUDA device"):
        _cuda([], gpus=0)
    with pytest.raises(SettingsError, match="among the 2 visible GPUs"):
        _cuda(["--gpus", "0,2"], gpus=2)
    with pytest.raises(SettingsError, match="each index once"):
        _cuda(["--gpus", "1,1"], gpus=2)
    with pytest.raises(SettingsError, match="one rank per GPU"):
        _cuda(["--mode", "ddp", "--learners", "3"], gpus=2)
    with pytest.raises(SettingsError, match="--gpus needs --device cuda"):
        parse_settings(["--gpus", "0"], count_gpus=lambda: 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_diloco_run_on_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_tokens_per_s_and_mfu_per_learner_come_from_its_metrics(tmp_path: Path) -> None:
    lines = [{"pid": 1, "step": 5 * i, "tokens": 100 * i, "tokens_per_s": 1000.0 + i, "mfu": 0.3 + 0.01 * i}
             for i in range(1, 6)]  # fmt: skip
    path = tmp_path / "learner-0.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    counts = read_counts(path)
    assert counts is not None
    assert counts.tokens_per_s == 1003.0
    assert counts.mfu == pytest.approx(0.33)
    record = synthetic_record(tmp_path)
    record.learners = [
        LearnerTotals(0, "learner-0", 1.0, None, steps=10, tokens=100, tokens_per_s=1003.0, mfu=0.33, gpu=0),
        LearnerTotals(1, "learner-1", 1.0, None, steps=10, tokens=100, tokens_per_s=998.0, mfu=None, gpu=1),
    ]
    md = render_markdown(build_report(record))
    assert "| learner | speed | steps | tokens | tokens/s | MFU |" in md
    assert "| learner-0 | 1 | 10 | 100 | 1,003 | 33.0 % |" in md
    assert "| learner-1 | 1 | 10 | 100 | 998 | n/a |" in md
    assert "- device: GPUs 0, 1 (learner → GPU: 0→0, 1→1)" in md


@pytest.mark.gpu
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_local_run_on_the_gpus_reports_tokens_per_s_and_mfu_per_learner(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "diloco", "run", "--device", "cuda", "--learners", "2", "--max-steps", "60",
        "--n-layer", "2", "--n-head", "4", "--n-embd", "128", "--block-size", "128", "--batch-size", "8",
        "--mtbf", "0", "--time-limit", "300", "--plain", "--runs-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    record = json.loads((run_dir / "report.json").read_text())["record"]
    gpus = torch.cuda.device_count()
    assert [x["gpu"] for x in record["learners"]] == [0 % gpus, 1 % gpus]
    assert all(x["finished"] and x["tokens_per_s"] > 0 for x in record["learners"])
    known = peak_tflops_of(torch.cuda.get_device_name(0)) is not None
    assert all((x["mfu"] is not None) == known for x in record["learners"])
    logs = (run_dir / "logs" / "learner-0.log").read_text()
    assert "outer gradients in torch on the device" in logs
