"""``diloco export``: a finished local job's global model out of its storage, checked against the
model it trained and its held-out loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diloco_core import codec
from diloco_core.config import ModelSettings
from diloco_core.fragments import build_plan
from diloco_core.layout import FragmentRecord
from diloco_core.storage import FilesystemStore
from diloco_sync.persistence import StateStore
from diloco_worker.data import eval_batches, load_corpus, split_corpus
from diloco_worker.entry import TaskContext, TrainingTask
from diloco_worker.model import build_gpt, lm_loss
from safetensors.torch import load_file

from diloco.export import main

MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32"]
CORPUS_BYTES = 4 * 1024 * 1024  # what diloco run's learners read on a CPU


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    subprocess.run(
        [sys.executable, "-m", "diloco", "run", "--plain", "--mtbf", "0", "--learners", "2", "--max-steps", "48",
         "--inner-steps", "8", "--batch-size", "8", *MODEL, "--runs-dir", str(runs)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (run,) = runs.iterdir()
    return run


def _held_out_loss(tensors: dict[str, torch.Tensor]) -> float:
    settings = ModelSettings(n_layer=1, n_head=2, n_embd=32, block_size=32)
    model = build_gpt(settings).eval()
    model.load_state_dict(tensors, strict=False)
    _, held = split_corpus(load_corpus("stdlib", CORPUS_BYTES), 0.02)
    batches = eval_batches(held, batch_size=8, block_size=32)
    with torch.no_grad():
        return sum(float(lm_loss(model, b)) for b in batches) / len(batches)


@pytest.mark.integration
def test_the_global_model_comes_out_at_its_committed_versions_with_its_held_out_loss(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "export"
    argv = [
        "--storage",
        str(finished_run / "storage"),
        "--out",
        str(out),
        *MODEL,
        "--batch-size",
        "8",
        "--evaluate",
    ]
    assert main(argv) == 0
    info = json.loads((out / "export.json").read_text())
    manifest = json.loads((finished_run / "storage" / "shard-000" / "manifest.json").read_text())
    assert info["versions"] == {p: f["version"] for p, f in manifest["fragments"].items()}
    assert min(info["versions"].values()) > 0  # trained, not the initial model
    tensors = load_file(str(out / "model.safetensors"))
    gpt = build_gpt(ModelSettings(n_layer=1, n_head=2, n_embd=32, block_size=32))
    assert set(tensors) == {n for n, _ in gpt.named_parameters()}
    assert info["parameters"] == sum(p.numel() for p in gpt.parameters())
    assert info["held_out_loss"] == pytest.approx(_held_out_loss(tensors), abs=1e-6)
    initial = _held_out_loss(dict(gpt.named_parameters()))
    assert info["held_out_loss"] < initial - 0.1  # it trained
    assert f"held-out loss: {info['held_out_loss']:.4f}" in capsys.readouterr().out


@pytest.mark.integration
def test_settings_that_do_not_build_the_jobs_model_are_refused_and_nothing_is_written(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "export"
    wrong = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32"]
    assert main(["--storage", str(finished_run / "storage"), "--out", str(out), *wrong]) == 1
    assert "h.1." in capsys.readouterr().err
    assert not out.exists()
    assert main(["--storage", str(tmp_path / "nowhere"), "--out", str(out)]) == 1
    assert "no such folder" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()
    assert main(["--storage", str(finished_run / "storage"), "--out", str(out), "--job-id", "other"]) == 1
    assert "not 'other'" in capsys.readouterr().err


class _Pretrained(torch.nn.Module):
    """A model with the Hugging Face ``save_pretrained`` convention (a folder with its weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 2)

    def save_pretrained(self, folder: str) -> None:
        from safetensors.torch import save_file

        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(
            {n: p.detach().contiguous() for n, p in self.named_parameters()}, f"{folder}/model.safetensors"
        )


def pretrained_task(ctx: TaskContext) -> TrainingTask:
    return TrainingTask(_Pretrained(), lambda m, b: m(b).sum(), lambda start: iter(()))


def test_a_model_with_save_pretrained_is_also_written_as_its_folder(tmp_path: Path) -> None:
    model = _Pretrained()
    plan = build_plan([(n, tuple(p.shape)) for n, p in model.named_parameters()], 1, 4, 1)
    state = StateStore(FilesystemStore(tmp_path / "storage"), 0, "hf-job")
    state.save_plan(plan.to_dict(), plan.hash())
    values = {n: np.full(tuple(p.shape), 0.25, np.float32) for n, p in model.named_parameters()}
    blob = codec.encode(values, fragment=0, base_version=4, kind="params", quantizer="fp32")
    state.commit_version(0, FragmentRecord(version=4, params_key=state.layout.params(0, 4)), params_blob=blob,
                         outer=None, round_log=None, count_round=True)  # fmt: skip
    out = tmp_path / "export"
    argv = [
        "--storage",
        str(tmp_path / "storage"),
        "--out",
        str(out),
        "--entry-point",
        f"{__name__}:pretrained_task",
    ]
    assert main(argv) == 0
    info: dict[str, Any] = json.loads((out / "export.json").read_text())
    assert info["hf"] == "hf"
    assert info["versions"] == {"0": 4}
    saved = load_file(str(out / "hf" / "model.safetensors"))
    assert all(torch.all(t == 0.25) for t in saved.values())


@pytest.mark.integration
def test_the_export_jobs_command_reads_the_job_config_and_stores_the_model_and_its_summary(
    finished_run: Path, s3: Any, tmp_path: Path
) -> None:
    """What the operator's export Job runs: the pods' JobConfig for the settings, the model written
    under an s3:// URL (export.json last), and the summary in one line where the pod's termination
    message is read."""
    storage = finished_run / "storage"
    manifest = json.loads((storage / "shard-000" / "manifest.json").read_text())
    config = {"job_id": manifest["job_id"], "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
              "train": {"precision": "fp32", "batch_size": 99}}  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(config))
    bucket = s3.new_bucket("export")
    summary = tmp_path / "termination-log"
    argv = ["--job-config", str(tmp_path / "job.json"), "--storage", str(storage), "--out", f"s3://{bucket}/j/export",
            "--batch-size", "8", "--evaluate", "--summary-file", str(summary)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "diloco", "export", *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **s3.env()})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"-> s3://{bucket}/j/export" in done.stdout
    line = summary.read_text()
    assert line.count("\n") == 1
    info = json.loads(line)
    assert info["location"] == f"s3://{bucket}/j/export"
    assert info["job_id"] == manifest["job_id"]
    assert info["versions"] == {p: f["version"] for p, f in manifest["fragments"].items()}
    client = s3.client()
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert keys == {"j/export/model.safetensors", "j/export/export.json"}
    stored = json.loads(client.get_object(Bucket=bucket, Key="j/export/export.json")["Body"].read())
    assert stored == info
    model = tmp_path / "model.safetensors"
    model.write_bytes(client.get_object(Bucket=bucket, Key="j/export/model.safetensors")["Body"].read())
    # the held-out loss of the batch size given, not the config's 99
    assert info["held_out_loss"] == pytest.approx(_held_out_loss(load_file(str(model))), abs=1e-6)


def test_a_job_config_and_a_job_file_are_not_taken_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "job.json").write_text("{}")
    argv = [
        "--job-config",
        str(tmp_path / "job.json"),
        "-f",
        str(tmp_path / "job.yaml"),
        "--storage",
        "x",
        "--out",
        "y",
    ]
    assert main(argv) == 2
    assert "give -f or --job-config, not both" in capsys.readouterr().err
