from __future__ import annotations

import subprocess
import sys

from tests.worker.helpers import clean_env


def test_worker_without_settings_exits_2_with_a_message() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "diloco_worker"], capture_output=True, text=True, env=clean_env(), timeout=120
    )
    assert proc.returncode == 2
    assert "DILOCO_SYNC_URL" in proc.stderr


def test_dispatch_through_the_diloco_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "worker", "--help"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert proc.returncode == 0
    assert "--sync-url" in proc.stdout
