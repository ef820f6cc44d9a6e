"""`diloco synchronizer` / `python -m diloco_sync`: its settings from flags, environment and job config;
as a process: clear errors, TLS, explicit S3 credentials, the load script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from diloco_bench import sync_ingest
from diloco_sync.cli import UsageError, parse_settings
from diloco_testbed.pki import make_pki
from diloco_testbed.s3_server import S3Server

from tests.synchronizer.helpers import Learner, SyncProcess, initial_params, learner_auth, tiny_plan


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diloco_sync", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.integration
def test_missing_secret_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_JOB_SECRET"}
    result = run_cli(["--data-dir", str(tmp_path)], env)
    assert result.returncode == 2
    assert "missing job secret: set DILOCO_JOB_SECRET" in result.stderr


@pytest.mark.integration
def test_bad_setting_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "DILOCO_JOB_SECRET": "x"}
    result = run_cli(["--data-dir", str(tmp_path), "--merge-rule", "median"], env)
    assert result.returncode == 2
    assert "merge_rule" in result.stderr
    assert "'rda' or 'mean'" in result.stderr


@pytest.mark.integration
def test_tls(tmp_path: Path, test_logs_dir: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    args = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--fragments", "2",
            "--inner-steps", "4", "--overlap", "1"]  # fmt: skip
    sync = SyncProcess(test_logs_dir / "sync", f"file://{tmp_path / 'store'}", args, tls_ca=pki.ca_cert)
    sync.start()
    try:
        assert sync.url.startswith("https://")
        learner = Learner(sync.url, "a", tiny_plan())
        learner.client = httpx.Client(base_url=sync.url, verify=sync.verify, **learner_auth("a"))
        assert learner.register().status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{sync.url}/healthz")  # not trusted without the CA
    finally:
        sync.stop()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stream", "lockstep"])
def test_load_script_reports_throughput_and_baseline(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    """One and two synchronizer shards (each learner sends a fragment to the shard that owns it:
    another would refuse it) beside the raw baseline; in lockstep each learner frames its
    contribution again on every new version it hears of."""
    argv = [
        "--no-plot",
        "--mode",
        mode,
        "--clients",
        "1",
        "4",
        "--shards",
        "1",
        "2",
        "--seconds",
        "1.5",
        "--params",
        "20000",
        "--fragments",
        "2",
    ]
    assert sync_ingest.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("1", "4")]
    assert [(r[0], r[1]) for r in rows] == [("1", "1"), ("1", "2"), ("4", "1"), ("4", "2")]
    for row in rows:
        mb_s, raw_mb_s, ratio = float(row[2]), float(row[4]), float(row[5])
        assert mb_s > 0
        assert raw_mb_s > 0
        assert ratio == pytest.approx(mb_s / raw_mb_s, rel=0.05, abs=0.002)
        if mode == "lockstep":
            assert int(row[11]) >= 2  # rounds: contributions framed on a new version were merged too


@pytest.mark.integration
def test_refuses_storage_of_another_job(tmp_path: Path, test_logs_dir: Path) -> None:
    """The manifest's job id is checked too, where the prefix's marker lets the owner in."""
    store = f"file://{tmp_path / 'store'}"
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--job-owner", "same-owner"]
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


def _not_aws(name: str) -> bool:
    return not name.startswith("AWS_")


@pytest.mark.integration
def test_explicit_s3_credentials(s3: S3Server, tmp_path: Path, test_logs_dir: Path) -> None:
    """The S3 endpoint and keys come from flags and DILOCO_* alone: no AWS_* variable is passed on."""
    bucket = s3.new_bucket()
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--storage-endpoint-url",
            s3.endpoint_url, "--storage-region", s3.region, "--storage-access-key", s3.access_key]  # fmt: skip
    env = {"DILOCO_STORAGE_SECRET_KEY": s3.secret_key, "HOME": str(tmp_path)}  # no ~/.aws either
    sync = SyncProcess(test_logs_dir / "sync", f"s3://{bucket}/explicit", args, env, inherit=_not_aws)
    sync.start()
    try:
        assert httpx.get(f"{sync.url}/readyz").json()["ready"] is True
        learner = Learner(sync.url, "a", tiny_plan())
        assert learner.register().status_code == 200
        assert learner.init(0, initial_params(learner.plan, 0)).status_code == 200
        learner.close()
    finally:
        sync.stop()
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert "explicit/shard-000/plan.json" in keys
    assert "explicit/shard-000/manifest.json" in keys
    log = sync.log_path.read_text(encoding="utf-8", errors="replace")
    assert s3.access_key in log  # the settings are logged...
    assert s3.secret_key not in log  # ...but never the secret key


@pytest.mark.integration
def test_wrong_s3_credentials_fail_the_start_clearly(s3: S3Server, tmp_path: Path) -> None:
    """Wrong keys are refused by S3 (403): waiting cannot cure that, unlike an outage, so the
    synchronizer does not start, and says what to check (without printing the secret)."""
    bucket = s3.new_bucket()
    wrong = "not-the-secret-" + s3.secret_key[:6]
    env = {k: v for k, v in os.environ.items() if _not_aws(k)}
    env.update(DILOCO_JOB_SECRET="x", DILOCO_STORAGE_SECRET_KEY=wrong, HOME=str(tmp_path))
    args = ["--storage", f"s3://{bucket}/wrong", "--port", "0", "--storage-endpoint-url", s3.endpoint_url,
            "--storage-access-key", s3.access_key, "--fragments", "2", "--inner-steps", "4", "--overlap", "1"]  # fmt: skip
    result = run_cli(args, env)
    assert result.returncode != 0
    assert f"cannot read the job's state from s3://{bucket}/wrong/" in result.stderr
    assert "SignatureDoesNotMatch (HTTP 403)" in result.stderr
    assert "check the storage URL and its credentials" in result.stderr
    assert wrong not in result.stderr + result.stdout
    assert s3.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


@pytest.mark.integration
def test_s3_keys_come_in_pairs() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_STORAGE_")}
    env["DILOCO_JOB_SECRET"] = "x"
    result = run_cli(["--storage", "s3://b/p", "--storage-access-key", "AK"], env)
    assert result.returncode == 2
    assert "S3 credentials need both the access key and the secret key" in result.stderr


def test_cli_needs_a_job_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DILOCO_JOB_SECRET", raising=False)
    with pytest.raises(UsageError, match="DILOCO_JOB_SECRET"):
        parse_settings([])


def test_cli_reads_flags_environment_and_job_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("job_id: demo\ndiloco:\n  inner_steps: 16\n  fragments: 8\n  quorum: 2\n")
    monkeypatch.setenv("DILOCO_JOB_SECRET", "from-env")
    monkeypatch.setenv("DILOCO_PORT", "9999")
    s = parse_settings(["--job-config", str(config), "--quorum", "3", "--data-dir", str(tmp_path / "d")])
    assert s.job_secret.get_secret_value() == "from-env"
    assert s.port == 9999
    assert s.storage_url == f"file://{tmp_path / 'd'}"
    assert (s.job.job_id, s.job.diloco.inner_steps, s.job.diloco.fragments, s.job.diloco.quorum) == (
        "demo",
        16,
        8,
        3,
    )


def test_cli_reports_invalid_settings_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_JOB_SECRET", "x")
    with pytest.raises(UsageError, match="overlap"):
        parse_settings(["--inner-steps", "4", "--overlap", "4"])
    monkeypatch.setenv("DILOCO_PORT", "not-a-port")
    with pytest.raises(UsageError, match="DILOCO_PORT"):
        parse_settings([])


def test_cli_reads_s3_keys_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_JOB_SECRET", "x")
    monkeypatch.setenv("DILOCO_STORAGE_SECRET_KEY", "s3-secret")
    s = parse_settings(["--storage", "s3://b/p", "--storage-access-key", "AKID"])
    assert s.storage_access_key == "AKID"
    assert s.storage_secret_key is not None
    assert s.storage_secret_key.get_secret_value() == "s3-secret"
    assert "s3-secret" not in repr(s)
    monkeypatch.delenv("DILOCO_STORAGE_SECRET_KEY")
    assert parse_settings(["--storage", "s3://b/p"]).storage_secret_key is None
