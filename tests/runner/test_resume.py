"""``diloco run --resume RUN_DIR``: a stopped local run continues in its folder with its settings,
each learner from its newest checkpoint, and the report counts the continuation."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from diloco_core.storage import FilesystemStore
from diloco_testbed.waiting import wait_for
from diloco_worker.checkpoint import list_checkpoints

from diloco.runner.cli import main as run_main

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--learners", "2"]


def _diloco_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diloco", "run", "--plain", *args],
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.integration
def test_a_stopped_run_resumes_from_its_checkpoints_and_reaches_its_step_budget(tmp_path: Path) -> None:
    # stopped (Ctrl-C) once both learners have a checkpoint: however loaded the machine, well before the budget
    first = subprocess.Popen(
        [sys.executable, "-m", "diloco", "run", "--plain", *TINY, "--mtbf", "0", "--max-steps", "1200",
         "--runs-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def checkpointed() -> bool:
        folders = [next(iter(tmp_path.glob(f"*/checkpoints/learner-{i}")), None) for i in range(2)]
        return all(f is not None and list_checkpoints(FilesystemStore(f)) for f in folders)

    wait_for(checkpointed, timeout=300, what="a checkpoint of each learner")
    first.send_signal(signal.SIGINT)
    _out, err = first.communicate(timeout=120)
    assert first.returncode == 130, err  # interrupted, with a report
    (run,) = tmp_path.iterdir()
    newest = {
        i: list_checkpoints(FilesystemStore(run / "checkpoints" / f"learner-{i}"))[-1] for i in range(2)
    }
    assert all(step < 1200 for step in newest.values()), newest  # stopped before the budget
    # the continuation: its own time limit, the rest of the settings the run's
    second = _diloco_run("--resume", str(run), "--time-limit", "600")
    assert second.returncode == 0, second.stderr
    report = json.loads((run / "report.json").read_text())
    record = report["record"]
    assert record["resumed"] is True
    assert record["resumed_from"] == {f"learner-{i}": step for i, step in newest.items()}
    assert "every learner reached --max-steps" in record["stop_reason"]
    for learner in record["learners"]:
        assert learner["steps"] == 1200 - newest[learner["learner"]]  # counted from the resume
    logs = "".join((run / "logs" / f"learner-{i}.log").read_text() for i in range(2))
    for i, step in newest.items():
        assert f"learner=learner-{i} step={step} resumed from checkpoint" in logs
    assert record["settings"]["mtbf_s"] == 0.0
    assert "resumed (`--resume`)" in (run / "report.md").read_text()


def test_resume_takes_the_runs_settings_and_refuses_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "no settings.json there" in capsys.readouterr().err
    assert run_main(["--resume", str(tmp_path), "--learners", "3", "--slow", "0.5:1.2"]) == 2
    assert "--learners, --slow cannot be given" in capsys.readouterr().err
