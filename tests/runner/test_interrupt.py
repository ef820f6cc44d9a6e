"""Ctrl-C (SIGINT) on a real `diloco run`: during start-up and mid-training it stops every child,
writes the report and exits 130 (docs/run.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SMALL = [
    "--learners", "2", "--max-steps", "100000", "--inner-steps", "8", "--fragments", "2", "--overlap", "1",
    "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--mtbf", "0", "--time-limit", "400", "--plain",
]  # fmt: skip


def _start(runs: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "diloco", "run", *SMALL, "--runs-dir", str(runs)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _processes_naming(path: Path) -> list[str]:
    """Command lines of live processes that mention ``path`` (every child of a run names its folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(path) in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline}")
    return found


def _finish(proc: subprocess.Popen[str], runs: Path) -> tuple[str, Path, dict[str, Any]]:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out[-3000:]
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    assert _processes_naming(run_dir) == []
    assert (run_dir / "report.md").read_text() in out
    return out, run_dir, json.loads((run_dir / "report.json").read_text())


@pytest.mark.timeout(300)
def test_ctrl_c_right_after_the_first_line_stops_the_start_up_and_still_reports(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith("diloco run: decoupled, 2 learners; run folder"), first
    os.kill(proc.pid, signal.SIGINT)
    out, _, report = _finish(proc, tmp_path)
    record = report["record"]
    assert record["stop_reason"].startswith("interrupted (Ctrl-C) during start-up"), record["stop_reason"]
    assert "stopped: interrupted (Ctrl-C) during start-up" in out
    assert report["summary"]["total_learner_steps"] == 0


@pytest.mark.timeout(600)
def test_ctrl_c_mid_training_reports_the_steps_done(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        steps = [int(s) for s in re.findall(r"=training@(\d+)", line)]
        if len(steps) == 2 and min(steps) >= 10:
            break
    else:
        pytest.fail("the run ended before both learners trained:\n" + "".join(seen[-20:]))
    os.kill(proc.pid, signal.SIGINT)
    _, _, report = _finish(proc, tmp_path)
    record, summary = report["record"], report["summary"]
    assert record["stop_reason"] == "interrupted (Ctrl-C)"
    assert all(learner["steps"] >= 10 for learner in record["learners"]), record["learners"]
    assert summary["total_learner_steps"] == sum(learner["steps"] for learner in record["learners"])
    assert summary["goodput"]["goodput"] is not None
