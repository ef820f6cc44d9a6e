"""Learner tokens against a real synchronizer process: an expired token, a revoked generation (from
the revocations file, re-read while running and in force again after a restart) and tokens beyond
what a learner's token declares per step are refused; the learner's next token is taken."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from diloco_testbed.waiting import wait_for

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import Learner, encode_grad, initial_params, outer_grad, tiny_plan

pytestmark = pytest.mark.integration
PLAN = tiny_plan(fragments=1)
ARGS = ["--fragments", "1", "--inner-steps", "4", "--overlap", "1"]


def test_expired_revoked_and_over_declared_tokens_are_refused(
    sync_factory: SyncFactory, tmp_path: Path
) -> None:
    revocations = tmp_path / "revocations.json"
    revocations.write_text("{}")
    storage = f"file://{tmp_path / 'store'}"
    sync = sync_factory(storage_url=storage, args=[*ARGS, "--revocations-file", str(revocations)])
    now = int(time.time())

    expired = Learner(sync.url, "a", PLAN, claims={"expires_at": now - 3600})
    refused = expired.register()
    assert refused.status_code == 401
    assert "expired" in refused.json()["reason"]

    a = Learner(sync.url, "a", PLAN, claims={"expires_at": now + 3600, "tokens_per_step": 8})
    assert a.register().status_code == 200
    assert a.init(0, initial_params(PLAN, 0)).status_code == 200
    blob = encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0)
    too_many = a.contribute(0, 0, blob, steps=4, tokens=33)
    assert too_many.status_code == 400
    assert "8 tokens per step" in too_many.json()["reason"]
    assert a.contribute(0, 0, blob, steps=4, tokens=32).status_code == 202

    revocations.write_text(json.dumps({"a": 1}))
    wait_for(lambda: a.heartbeat(8).status_code == 401, timeout=10, what="the revocation to apply")
    assert "revoked" in a.heartbeat(8).json()["reason"]
    renewed = Learner(sync.url, "a", PLAN, claims={"generation": 1})
    assert renewed.heartbeat(8).status_code == 200

    revocations.write_text("not json")  # a bad edit leaves the revocations in force
    time.sleep(1.5)
    assert a.heartbeat(8).status_code == 401

    revocations.write_text(json.dumps({"a": 1}))
    sync.stop()
    sync.start()
    assert a.heartbeat(8).status_code == 401
    assert renewed.heartbeat(8).status_code == 200
