"""The run's child processes die with the runner: a SIGKILLed `diloco run` leaves no synchronizer or
learner behind to write into its run folder beside a resumed one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from diloco_testbed.waiting import wait_for

RUNNER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from diloco.runner.processes import launch
    child = launch("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], Path(sys.argv[1]))
    print(child.popen.pid, flush=True)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_dies_when_the_runner_is_killed(tmp_path: Path) -> None:
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(tmp_path / "child.log")], stdout=subprocess.PIPE, text=True
    )
    assert runner.stdout is not None
    child = int(runner.stdout.readline())
    assert _alive(child)
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(10)
    wait_for(lambda: not _alive(child), timeout=10, what="the child gone with its runner")
