"""One job file for every command: ``diloco worker -f`` and ``diloco synchronizer -f`` read the manifest
``kubectl apply`` takes, and get the job configuration the operator would write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from diloco_core.config import JobConfig
from diloco_core.flags import SettingsError
from diloco_operator.builders.config import build_job_config
from diloco_operator.builders.names import JobRef
from diloco_operator.schema.spec import parse_spec
from diloco_sync.cli import parse_settings as parse_sync_settings
from diloco_testbed.ports import free_port
from diloco_testbed.waiting import wait_for
from diloco_worker.settings import parse_settings as parse_worker_settings

from diloco.job_file import component_argv
from tests.support.manifests import job_manifest, write_manifest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "single-region.yaml"


def _config(argv: list[str]) -> JobConfig:
    return JobConfig.model_validate_json(argv[argv.index("--job-config") + 1])


def test_the_job_config_is_the_one_the_operator_writes() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    argv = component_argv("worker", ["-f", str(EXAMPLE), "--unit", "h100"])
    assert _config(argv) == build_job_config(JobRef("gpt-small", "", ""), parse_spec(doc["spec"]))
    assert argv[argv.index("--batch-size") + 1] == "64"  # the h100 unit's


def test_a_learner_and_the_synchronizer_parse_the_same_settings_from_it() -> None:
    worker = parse_worker_settings(
        component_argv("worker", ["-f", str(EXAMPLE), "--unit", "cpu", "--standalone"]), env={}
    )
    assert (worker.job_id, worker.train.batch_size, worker.model.n_embd) == ("gpt-small", 8, 384)
    assert (worker.diloco.inner_steps, worker.diloco.fragments, worker.diloco.overlap) == (64, 4, 2)
    assert worker.tracking.tensorboard == "s3://diloco/jobs/gpt-small/tensorboard"
    sync = parse_sync_settings(
        component_argv("synchronizer", ["-f", str(EXAMPLE)]), {"DILOCO_JOB_SECRET": "s" * 32}
    )
    assert sync.job.diloco == worker.diloco.model_copy(update={})  # the whole algorithm, not only the plan
    assert (sync.job.job_id, sync.storage_url, sync.storage_endpoint_url) == (
        "gpt-small", "s3://diloco/jobs/gpt-small", "http://seaweedfs.storage.svc:8333",
    )  # fmt: skip
    # a flag given beside the file wins over it
    sync = parse_sync_settings(
        component_argv("synchronizer", ["-f", str(EXAMPLE), "--storage", "file:///tmp/x", "--quorum", "1"]),
        {"DILOCO_JOB_SECRET": "s" * 32},
    )
    assert (sync.storage_url, sync.job.diloco.quorum) == ("file:///tmp/x", 1)


def test_the_synchronizer_takes_the_jobs_memory_budgets_and_a_flag_beside_wins(tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["synchronizer"]["memory"] = {"rounds": "2Gi", "outageBuffer": "512Mi"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = {"DILOCO_JOB_SECRET": "s" * 32}
    sync = parse_sync_settings(component_argv("synchronizer", ["-f", str(path)]), env)
    assert (sync.round_memory_bytes, sync.memory_budget_bytes) == (2 * 1024**3, 512 * 1024**2)
    given = component_argv("synchronizer", ["-f", str(path), "--round-memory-bytes", "5000000"])
    assert parse_sync_settings(given, env).round_memory_bytes == 5_000_000
    assert given.count("--round-memory-bytes") == 1
    # and so does a DILOCO_* variable, as for every other setting of the file
    env_given = {**env, "DILOCO_ROUND_MEMORY_BYTES": "6000000"}
    argv = component_argv("synchronizer", ["-f", str(path)], env_given)
    assert "--round-memory-bytes" not in argv
    assert parse_sync_settings(argv, env_given).round_memory_bytes == 6_000_000


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["-f", str(EXAMPLE)], "the units' batch sizes differ .*: name this learner's unit with --unit"),
        (["-f", str(EXAMPLE), "--unit", "tpu"], "no learner unit 'tpu' \\(units: a100, h100, cpu\\)"),
        (["-f", str(EXAMPLE), "--job-config", "{}"], "-f .* and --job-config both given"),
        (["-f"], "-f needs a file"),
    ],
)
def test_what_cannot_be_meant_is_refused(argv: list[str], says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        component_argv("worker", argv)


def test_without_a_file_the_arguments_are_left_alone() -> None:
    assert component_argv("worker", ["--unit", "a", "--lr", "0.1"]) == ["--unit", "a", "--lr", "0.1"]


def _tiny_job(tmp_path: Path) -> Path:
    doc = job_manifest(
        "tiny",
        model={"nLayer": 1, "nHead": 2, "nEmbd": 16, "blockSize": 16},
        train={"warmupSteps": 2},
        diloco={"innerSteps": 4, "fragments": 2},
        learnerUnits=[{"name": "only", "batchSize": 2}],
        budget={"steps": 12},
    )
    return write_manifest(tmp_path, doc)


@pytest.mark.integration
@pytest.mark.slow
def test_a_synchronizer_and_a_learner_started_from_one_file_train_together(tmp_path: Path) -> None:
    job, port = _tiny_job(tmp_path), free_port()
    env = {"DILOCO_JOB_SECRET": "a-secret-of-the-test-0123456789", "PATH": "/usr/bin:/bin"}
    diloco = [sys.executable, "-m", "diloco"]
    sync = subprocess.Popen(
        [*diloco, "synchronizer", "-f", str(job), "--storage", f"file://{tmp_path / 'store'}", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "sync.log").open("w"),
    )  # fmt: skip
    try:
        import httpx

        wait_for(lambda: _ready(port), timeout=60, what="the synchronizer ready")
        learner = subprocess.run(
            [*diloco, "worker", "-f", str(job), "--sync-url", f"http://127.0.0.1:{port}",
             "--job-secret", env["DILOCO_JOB_SECRET"], "--learner-id", "only-0", "--threads", "1"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert learner.returncode == 0, learner.stderr[-3000:]
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=10).json()
        assert status["job_id"] == "tiny"
        (only,) = status["learners"]
        assert only["step"] == 12  # the file's step budget
        assert all(f["version"] >= 1 for f in status["fragments"])  # no plan mismatch: one file
    finally:
        sync.terminate()
        sync.wait(30)


def _ready(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
