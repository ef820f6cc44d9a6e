"""The S3 server stops during a run: contributions are held in memory (within the budget), the outage
shows in status, metrics and readiness, and once S3 is back the round is committed and nothing is lost."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np
import pytest
from diloco_testbed.s3_server import S3Server
from diloco_testbed.waiting import wait_for

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import Learner, encode_grad, initial_params, outer_grad, status, tiny_plan

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PLAN = tiny_plan()


def test_s3_outage_then_recovery(
    sync_factory: SyncFactory, s3_server_factory: Callable[[], S3Server]
) -> None:
    s3 = s3_server_factory()
    bucket = s3.new_bucket()
    grads = [encode_grad(outer_grad(PLAN, 0, seed=i), 0, 1) for i in range(2)]
    budget = sum(len(g) for g in grads)
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "2",
            "--memory-budget-bytes", str(budget)]  # fmt: skip
    sync = sync_factory(f"s3://{bucket}/jobs/outage", args, s3.env())
    a, b = Learner(sync.url, "a", PLAN), Learner(sync.url, "b", PLAN)
    assert a.register().status_code == 200
    assert b.register().status_code == 200
    for p in (0, 1):
        assert a.init(p, initial_params(PLAN, p)).status_code == 200
    for i, learner in enumerate((a, b)):
        assert (
            learner.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, seed=10 + i), 0, 0)).status_code == 202
        )
    assert a.fetch(0, newer_than=0, wait=30) is not None  # version 1 committed to S3

    s3.stop()
    for learner, grad in zip((a, b), grads, strict=True):
        r = learner.contribute(0, 1, grad)
        assert r.status_code == 202, r.text
        assert r.json()["status"] == "accepted"
    # the round is merged and its commit waits for storage: a resend is a duplicate, not a new contribution
    wait_for(lambda: status(sync.url)["fragments"][0]["pending"] == 0, timeout=30, what="the round merging")
    resent = a.contribute(0, 1, grads[0], seq=a.seq)  # the same contribution again
    assert resent.status_code == 202, resent.text
    assert resent.json()["status"] == "duplicate"
    # beyond the memory budget: refused, retryable, nothing lost silently
    over = a.contribute(1, 0, encode_grad(outer_grad(PLAN, 1, seed=3), 1, 0))
    assert over.status_code == 503
    assert over.json()["code"] == "storage_unavailable"
    assert over.json()["retryable"] is True

    assert status(sync.url)["storage_ok"] is False
    ready = httpx.get(f"{sync.url}/readyz")
    assert ready.status_code == 503
    assert ready.json()["storage_ok"] is False
    assert "diloco_sync_storage_ok 0.0" in httpx.get(f"{sync.url}/metrics").text
    # the round's result is not published while it cannot be made durable
    assert a.fetch(0, newer_than=1, wait=1.0) is None

    s3.start()
    got = a.fetch(0, newer_than=1, wait=60)
    assert got is not None
    assert got[0] == 2
    wait_for(lambda: status(sync.url)["storage_ok"] is True, timeout=60, what="storage_ok again")
    assert httpx.get(f"{sync.url}/readyz").status_code == 200
    assert b.contribute(1, 0, encode_grad(outer_grad(PLAN, 1, seed=3), 1, 0)).status_code == 202

    # everything is durable: a crash now loses nothing
    sync.kill9()
    sync.start()
    again = b.fetch(0)
    assert again is not None
    assert again[0] == 2
    for name, value in got[1].items():
        np.testing.assert_array_equal(again[1][name], value)
    assert status(sync.url)["fragments"][1]["pending"] == 1  # type: ignore[index]
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert "jobs/outage/shard-000/manifest.json" in keys
    assert any(k.startswith("jobs/outage/shard-000/rounds/0/") for k in keys)
