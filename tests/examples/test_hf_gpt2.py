"""A Hugging Face GPT-2 on token data, from one job file: trained by ``diloco run -f``, the whole run killed
with SIGKILL and resumed with ``--resume``, taken out with ``diloco export -f``, and loaded by
``transformers`` with the held-out loss the run reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_testbed.waiting import wait_for
from diloco_worker.metrics import read_metrics

from tests.support.hf_gpt2 import MODEL, example_env, held_out_loss, write_tokens
from tests.support.manifests import job_manifest, write_manifest
from tests.support.tensorboard_files import read_scalars

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 300


def _job(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    write_tokens(data / "train.bin")
    doc = job_manifest(
        "hf-gpt2",
        model=MODEL,
        data={"corpus": str(data), "format": "tokens"},
        train={"lr": 0.003, "warmupSteps": 4},
        diloco={"innerSteps": 8, "fragments": 2},
        learnerUnits=[{"name": "a", "batchSize": 4}, {"name": "b", "batchSize": 4}],
        budget={"steps": STEPS},
    )
    return write_manifest(tmp_path, doc)


def _steps(run_dir: Path) -> list[int]:
    steps = []
    for i in (0, 1):
        try:
            steps.append(max(r["step"] for r in read_metrics(run_dir / "metrics" / f"learner-{i}.jsonl")))
        except (OSError, ValueError):
            steps.append(0)
    return steps


@pytest.mark.timeout(900)
def test_a_hugging_face_gpt2_trains_survives_sigkill_of_the_run_and_exports(tmp_path: Path) -> None:
    job, runs = _job(tmp_path), tmp_path / "runs"
    diloco = [sys.executable, "-m", "diloco"]
    first = subprocess.Popen(
        [*diloco, "run", "-f", str(job), "--plain", "--time-limit", "600", "--runs-dir", str(runs)],
        env=example_env(), stdout=(tmp_path / "first.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    run_dir = wait_for(
        lambda: next(iter(runs.glob("*/metrics")), None), timeout=120, what="the run folder"
    ).parent
    wait_for(lambda: min(_steps(run_dir)) >= 30 or None, timeout=400, what="both learners past step 30",
             describe=lambda: (tmp_path / "first.log").read_text()[-3000:])  # fmt: skip
    os.killpg(first.pid, signal.SIGKILL)  # the whole run at once: runner, synchronizer, learners
    first.wait(30)
    time.sleep(1)
    killed_at = _steps(run_dir)
    assert max(killed_at) < STEPS

    resumed = subprocess.run(
        [*diloco, "run", "--resume", str(run_dir), "--plain", "--time-limit", "600"],
        env=example_env(), capture_output=True, text=True, timeout=700,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["record"]["stop_reason"] == "every learner reached --max-steps"
    assert report["record"]["resumed"]
    losses = report["record"]["losses"]  # the resumed run's own evaluations
    first_loss = read_metrics(run_dir / "metrics" / "learner-0.jsonl")[0]["loss"]  # near ln 512 = 6.24
    assert losses[-1]["loss"] < first_loss - 2.0
    assert read_scalars(run_dir / "tensorboard" / "learner-0")["loss"][-1][0] == STEPS

    out = tmp_path / "export"
    exported = subprocess.run(
        [*diloco, "export", "-f", str(job), "--storage", str(run_dir / "storage"), "--out", str(out), "--evaluate"],
        env=example_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    info = json.loads((out / "export.json").read_text())
    assert info["hf"] == "hf"
    # the exported versions are the run's last: its final evaluation is the export's held-out loss
    assert info["held_out_loss"] == pytest.approx(losses[-1]["loss"], rel=1e-5)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert held_out_loss(model, tmp_path / "data") == pytest.approx(info["held_out_loss"], rel=1e-5)
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)  # tied, as built


@pytest.mark.timeout(300)
def test_continued_pre_training_starts_from_a_save_pretrained_folder_in_s3(s3: Any, tmp_path: Path) -> None:
    """``HF_INIT_FROM=s3://bucket/prefix``: the example loads those weights (its config wins over the
    job's model settings), not a fresh model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(11)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=300, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    ).save_pretrained(tmp_path / "hf")
    bucket = s3.new_bucket("init")
    for f in (tmp_path / "hf").iterdir():
        s3.client().put_object(Bucket=bucket, Key=f"base/{f.name}", Body=f.read_bytes())
    write_tokens(tmp_path / "train.bin", repeats=20)
    script = (
        "import sys, torch\n"
        "from diloco_core.config import DataSettings, ModelSettings, TrainSettings\n"
        "from diloco_worker.data import Shard\n"
        "from diloco_worker.entry import TaskContext\n"
        "from safetensors.torch import load_file\n"
        "import hf_gpt2\n"
        f"data = DataSettings(corpus={str(tmp_path / 'train.bin')!r}, format='tokens', cache_dir={str(tmp_path / 'cache')!r})\n"
        "m = ModelSettings(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=512)\n"
        "task = hf_gpt2.build(TaskContext(m, data, TrainSettings(batch_size=2), Shard(0, 1, 't'), torch.device('cpu')))\n"
        f"saved = load_file({str(tmp_path / 'hf' / 'model.safetensors')!r})\n"
        "own = dict(task.model.named_parameters())\n"
        "assert all(torch.equal(own[k], v) for k, v in saved.items() if k in own), 'not the saved weights'\n"
        "print('layers', task.model.config.n_layer, 'vocab', task.model.config.vocab_size)\n"
    )  # fmt: skip
    env = example_env(**s3.env(), HF_INIT_FROM=f"s3://{bucket}/base")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layers 1 vocab 300" in done.stdout
