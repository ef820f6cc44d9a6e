"""`diloco synchronizer` / `python -m diloco_sync` as a process: clear errors, TLS, the load script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from diloco_bench import sync_ingest

from tests.support.pki import make_pki
from tests.synchronizer.helpers import Learner, SyncProcess, tiny_plan

pytestmark = pytest.mark.integration


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diloco_sync", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_missing_secret_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_JOB_SECRET"}
    result = run_cli(["--data-dir", str(tmp_path)], env)
    assert result.returncode == 2
    assert "missing job secret: set DILOCO_JOB_SECRET" in result.stderr


def test_bad_setting_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "DILOCO_JOB_SECRET": "x"}
    result = run_cli(["--data-dir", str(tmp_path), "--merge-rule", "median"], env)
    assert result.returncode == 2
    assert "merge_rule" in result.stderr
    assert "'rda' or 'mean'" in result.stderr


def test_tls(tmp_path: Path, test_logs_dir: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    args = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--fragments", "2",
            "--inner-steps", "4", "--overlap", "1"]  # fmt: skip
    sync = SyncProcess(test_logs_dir / "sync", f"file://{tmp_path / 'store'}", args, tls_ca=pki.ca_cert)
    sync.start()
    try:
        assert sync.url.startswith("https://")
        learner = Learner(sync.url, "a", tiny_plan())
        learner.client = httpx.Client(base_url=sync.url, headers=learner.client.headers, verify=sync.verify)
        assert learner.register().status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{sync.url}/healthz")  # not trusted without the CA
    finally:
        sync.stop()


@pytest.mark.slow
def test_load_script_reports_throughput_and_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        sync_ingest.main(["--clients", "1", "4", "--seconds", "1.5", "--params", "20000", "--fragments", "2"])
        == 0
    )
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("1", "4")]
    assert [r[0] for r in rows] == ["1", "4"]
    for row in rows:
        mb_s, raw_mb_s, ratio = float(row[1]), float(row[3]), float(row[4])
        assert mb_s > 0
        assert raw_mb_s > 0
        assert ratio == pytest.approx(mb_s / raw_mb_s, rel=0.05, abs=0.002)


def test_refuses_storage_of_another_job(tmp_path: Path, test_logs_dir: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1"]
    first = SyncProcess(test_logs_dir / "sync", store, [*args, "--job-id", "job-a"])
    first.start()
    try:
        assert Learner(first.url, "a", tiny_plan()).register().status_code == 200
    finally:
        first.stop()
    env = {**os.environ, "DILOCO_JOB_SECRET": "x"}
    result = run_cli(["--storage", store, "--port", "0", *args, "--job-id", "job-b"], env)
    assert result.returncode != 0
    assert "storage holds job 'job-a', this synchronizer serves 'job-b'" in result.stderr
