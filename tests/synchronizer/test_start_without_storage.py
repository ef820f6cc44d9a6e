"""A synchronizer started while its S3 server is down: it answers at once (alive, not ready, learner
routes 503 ``starting`` and retryable), loads its state once S3 is up, and stops cleanly on SIGTERM
while it still waits for S3."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from diloco_testbed.s3_server import S3Server
from diloco_testbed.waiting import wait_for

from tests.synchronizer.helpers import (
    Learner,
    SyncProcess,
    encode_grad,
    initial_params,
    learner_auth,
    outer_grad,
    tiny_plan,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PLAN = tiny_plan()
ARGS = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "1"]


def _stopped_s3(s3_server_factory: Callable[[], S3Server]) -> tuple[S3Server, str]:
    """A dedicated S3 server holding an empty bucket, stopped."""
    s3 = s3_server_factory()
    bucket = s3.new_bucket()
    s3.stop()
    return s3, bucket


def _waiting_for_storage(sync: SyncProcess) -> dict[str, object] | None:
    """/readyz's body once it says the state cannot be loaded because storage is unavailable (and,
    to a learner, why)."""
    ready = httpx.get(f"{sync.url}/readyz", **learner_auth("a"), timeout=5)
    body: dict[str, object] = ready.json()
    reason = str(body.get("reason"))
    if ready.status_code == 503 and reason.startswith("loading state: storage unavailable ("):
        return body
    return None


def test_starts_without_storage_then_serves_once_it_is_up(
    s3_server_factory: Callable[[], S3Server], test_logs_dir: Path
) -> None:
    s3, bucket = _stopped_s3(s3_server_factory)
    sync = SyncProcess(test_logs_dir / "sync", f"s3://{bucket}/jobs/late", ARGS, s3.env())
    sync.start(wait_loaded=False)
    try:
        assert httpx.get(f"{sync.url}/healthz", timeout=5).status_code == 200
        body = wait_for(lambda: _waiting_for_storage(sync), timeout=60, what="/readyz: storage unavailable")
        assert body["ready"] is False
        assert body["loaded"] is False
        assert body["storage_ok"] is False

        learner = Learner(sync.url, "a", PLAN)
        refused = learner.register()
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "starting"
        assert refused.json()["retryable"] is True
        assert "storage unavailable" in refused.json()["reason"]
        assert int(refused.headers["Retry-After"]) > 0
        status = httpx.get(f"{sync.url}/v1/status", timeout=5)
        assert status.status_code == 503
        assert status.json()["code"] == "starting"
        assert "storage unavailable" in status.json()["reason"]
        assert bucket not in status.text  # the public status names nothing of the storage
        assert bucket in refused.json()["reason"]  # an authenticated learner is told where it failed
        assert httpx.get(f"{sync.url}/healthz", timeout=5).status_code == 200  # still alive

        s3.start()
        wait_for(
            lambda: httpx.get(f"{sync.url}/readyz", timeout=5).status_code == 200,
            timeout=120,
            what="/readyz 200 once S3 is up",
        )
        ready = httpx.get(f"{sync.url}/readyz", timeout=5).json()
        assert ready == {
            "ready": True, "loaded": True, "storage_ok": True, "storage_error": None, "reason": None,
        }  # fmt: skip
        registered = learner.register()
        assert registered.status_code == 200, registered.text
        for p in (0, 1):
            assert learner.init(p, initial_params(PLAN, p)).status_code == 200
        taken = learner.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0))
        assert taken.status_code == 202, taken.text
        got = learner.fetch(0, newer_than=0, wait=30)  # quorum 1: the round commits to S3
        assert got is not None
        assert got[0] == 1
        learner.close()
    finally:
        sync.stop()
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert "jobs/late/shard-000/manifest.json" in keys


def test_sigterm_while_waiting_for_storage_stops_cleanly(
    s3_server_factory: Callable[[], S3Server], test_logs_dir: Path
) -> None:
    s3, bucket = _stopped_s3(s3_server_factory)
    sync = SyncProcess(test_logs_dir / "sync", f"s3://{bucket}/jobs/never", ARGS, s3.env())
    sync.start(wait_loaded=False)
    try:
        wait_for(lambda: _waiting_for_storage(sync), timeout=60, what="/readyz: storage unavailable")
        pid = sync.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not sync.process.running(), timeout=60, what="the synchronizer to exit on SIGTERM")
        assert sync.process.returncode() == 0, sync.process.failure_report()
    finally:
        sync.stop()
    log = sync.log_path.read_text(encoding="utf-8", errors="replace")
    assert "Traceback" not in log
    assert "cannot start" not in log
