"""``diloco run -f``: a DiLoCoJob manifest as a local run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from diloco_core.auth import read_learner_token
from diloco_core.flags import SettingsError
from diloco_worker.metrics import read_metrics

from diloco.runner.cli import parse_settings
from diloco.runner.commands import RunPaths, build_synchronizer_argv, build_worker_argv, build_worker_env
from diloco.runner.job_file import job_file_settings
from tests.support.manifests import job_manifest, write_manifest
from tests.support.tensorboard_files import read_scalars

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "single-region.yaml"


def _manifest(**spec: Any) -> dict[str, Any]:
    units = [{"name": "a", "batchSize": 4}, {"name": "b", "replicas": 2, "batchSize": 2}]
    return job_manifest("j", **({"learnerUnits": units} | spec))


def _write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    return write_manifest(tmp_path, doc)


def test_the_example_manifest_runs_as_one_learner_per_unit(tmp_path: Path) -> None:
    s = parse_settings(["-f", str(EXAMPLE)])
    assert s.learners == 3
    assert s.batch_sizes == (64, 64, 8)  # a100: 2 pods x 32; h100: 64; cpu: 8
    assert (s.model.n_layer, s.model.n_embd, s.model.block_size) == (6, 384, 256)
    algo = s.algorithm()
    assert (algo.inner_steps, algo.fragments, algo.overlap, algo.quorum, algo.delayed_nesterov) == (
        64,
        4,
        2,
        2,
        2,
    )
    assert (algo.codec, algo.down_codec, algo.merge_rule, algo.outer_lr) == ("int4", "int4", "rda", 0.7)
    assert s.token_budget == 2_000_000_000
    assert s.mtbf_s == 0.0  # chaos only when the spec enables it
    paths = RunPaths(tmp_path)
    argv = [build_worker_argv(s, paths, i, sync_url="http://h:1") for i in range(3)]
    assert [a[a.index("--batch-size") + 1] for a in argv] == ["64", "64", "8"]
    # each learner's token declares its own unit's tokens per step
    secret = "x" * 32
    envs = [build_worker_env(s, i, {}, job_secret=secret, master_port=1) for i in range(3)]
    claims = [read_learner_token(secret, e["DILOCO_TOKEN"]) for e in envs]
    assert [c.tokens_per_step if c else None for c in claims] == [64 * 256, 64 * 256, 8 * 256]
    sync = build_synchronizer_argv(s, paths, port=1)
    assert sync[sync.index("--quorum") + 1] == "2"
    assert sync[sync.index("--job-id") + 1] == "gpt-small"  # the manifest's name: its storage and tracking


def test_what_a_local_run_does_not_use_is_named() -> None:
    job = job_file_settings(yaml.safe_load(EXAMPLE.read_text()), "example")
    notes = "\n".join(job.notes)
    for said in ("spec.images", "spec.storage", "unit a100: its 2 pods run as one process",
                 "nodeSelector", "resources", "tolerations", "spec.budget.steps is not set"):  # fmt: skip
        assert said in notes, (said, notes)
    assert job.units == ("a100", "h100", "cpu")
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["export"] = {"enabled": False}
    exported = "\n".join(job_file_settings(doc, "example").notes)
    assert "spec.export is not used by a local run: the export Job runs on a cluster" in exported
    doc["spec"]["learnerUnits"][0]["minStepTimeSeconds"] = 0.5  # the synchronizer's pace is the cluster's
    paced = "\n".join(job_file_settings(doc, "example").notes)
    assert "minStepTimeSeconds" in paced, paced


def test_the_synchronizers_memory_budgets_are_the_local_synchronizers(tmp_path: Path) -> None:
    set_ = _manifest(synchronizer={"memory": {"rounds": "2Gi", "servedInMemory": "16Mi"}, "shards": 2})
    s = parse_settings(["-f", str(_write(tmp_path, set_))])
    argv = build_synchronizer_argv(s, RunPaths(tmp_path), port=1)
    assert argv[argv.index("--round-memory-bytes") + 1] == str(2 * 1024**3)
    assert argv[argv.index("--served-in-memory-bytes") + 1] == str(16 * 1024**2)
    assert "--memory-budget-bytes" not in argv  # unset, and no limit to share: the synchronizer's default
    notes = "\n".join(job_file_settings(set_, "j").notes)
    assert "spec.synchronizer.{shards} are not used by a local run" in notes, notes
    # the shares of a memory limit, as the operator gives them to the synchronizer's pod
    limited = _manifest(synchronizer={"resources": {"limits": {"memory": "1280Mi"}}})
    s = parse_settings(["-f", str(_write(tmp_path, limited))])
    argv = build_synchronizer_argv(s, RunPaths(tmp_path), port=1)
    room = (1280 - 256) * 1024**2
    assert argv[argv.index("--round-memory-bytes") + 1] == str(room // 3)
    assert argv[argv.index("--memory-budget-bytes") + 1] == str(room // 3)
    assert argv[argv.index("--served-in-memory-bytes") + 1] == str(min(64 * 1024**2, room // 8))
    plain = build_synchronizer_argv(
        parse_settings(["-f", str(_write(tmp_path, _manifest()))]), RunPaths(tmp_path), port=1
    )
    assert not [a for a in plain if a.endswith("-bytes")]


def test_settings_come_from_the_spec_and_flags_beside_it_win(tmp_path: Path) -> None:
    doc = _manifest(
        model={"nLayer": 2, "nHead": 2, "nEmbd": 32, "blockSize": 32},
        train={"lr": 0.002, "warmupSteps": 7, "precision": "fp32", "compile": True},
        diloco={"innerSteps": 8, "fragments": 2},
        budget={"steps": 40},
        chaos={"enabled": True, "mtbfSeconds": 30, "repairSeconds": 2},
        tracking={"wandbProject": "p"},
    )
    s = parse_settings(["-f", str(_write(tmp_path, doc)), "--inner-steps", "4", "--time-limit", "60"])
    assert s.algorithm().inner_steps == 4  # the flag wins over the file
    assert s.algorithm().fragments == 2
    assert (s.train.lr, s.train.warmup_steps, s.train.max_steps) == (0.002, 7, 40)
    assert s.compile_model
    assert (s.mtbf_s, s.repair_s, s.time_limit_s) == (30.0, 2.0, 60.0)
    assert s.batch_sizes == (4, 4)
    assert s.tracking.wandb_project == "p"
    argv = build_worker_argv(s, RunPaths(tmp_path), 1, sync_url="http://h:1")
    assert "--compile" in argv
    assert argv[argv.index("--precision") + 1] == "fp32"


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"kind": "Deployment"}, "not a DiLoCoJob manifest"),
        (_manifest(diloco={"quorum": 5}), r"quorum \(5\) exceeds the number of learner units"),
        (_manifest(model={"nLayers": 3}), "spec.model.nLayers"),
        (
            _manifest(learnerUnits=[{"name": "a", "replicas": 0}]),
            r"exceeds the number of learner units \(0, not counting a: replicas 0, never ready\)",
        ),
    ],
)
def test_a_manifest_the_operator_would_refuse_is_refused_with_its_message(
    tmp_path: Path, doc: dict[str, Any], says: str
) -> None:
    with pytest.raises(SettingsError, match=says):
        parse_settings(["-f", str(_write(tmp_path, doc))])


def test_the_units_say_how_many_learners_and_their_batch_sizes(tmp_path: Path) -> None:
    path = _write(tmp_path, _manifest())
    for flag in (["--learners", "3"], ["--batch-size", "2"]):
        with pytest.raises(SettingsError, match="the job's learner units say"):
            parse_settings(["-f", str(path), *flag])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_file_on_token_data_trains_locally_and_tracks_to_the_run_folder(tmp_path: Path) -> None:
    ids = np.tile(np.arange(300, dtype=np.uint16), 1_000)  # a learnable sequence over a 512-token vocabulary
    (tmp_path / "data").mkdir()
    ids.tofile(tmp_path / "data" / "train.bin")
    doc = _manifest(
        model={"nLayer": 2, "nHead": 2, "nEmbd": 32, "blockSize": 32, "vocabSize": 512},
        data={"corpus": str(tmp_path / "data"), "format": "tokens"},
        train={"lr": 0.003, "warmupSteps": 4},
        diloco={"innerSteps": 8, "fragments": 2},
        budget={"steps": 48},
    )
    argv = [sys.executable, "-m", "diloco", "run", "-f", str(_write(tmp_path, doc)), "--time-limit", "400",
            "--plain", "--runs-dir", str(tmp_path / "runs")]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "learner-0 = unit a, learner-1 = unit b" in proc.stdout
    assert "note: spec.images is not used by a local run" in proc.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["record"]["stop_reason"] == "every learner reached --max-steps"
    assert report["summary"]["final_loss"] < report["summary"]["first_loss"]
    board = run_dir / "tensorboard"
    assert sorted(p.name for p in board.iterdir()) == ["learner-0", "learner-1", "synchronizer-0"]
    assert read_scalars(board / "learner-1")["loss"][-1][0] == 48
    # learner-1 is unit b: 2 pods of batch 2, one process of 4 sequences of 32 tokens per step
    tokens = [r["tokens"] for r in read_metrics(run_dir / "metrics" / "learner-1.jsonl")]
    assert tokens[-1] == 48 * 4 * 32
