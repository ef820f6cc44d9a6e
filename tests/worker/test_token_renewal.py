"""A learner whose token is revoked while it trains picks up the new one from its token file (as a
pod does from its mounted Secret) and goes on: no restart, no progress dropped on the way."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from diloco_core.auth import learner_token
from diloco_testbed.process import stop_all
from diloco_testbed.waiting import wait_for

from tests.worker.helpers import SECRET, Synchronizer, learner_process

pytestmark = pytest.mark.integration
H, P = 8, 2
PLAN = ["--inner-steps", str(H), "--fragments", str(P), "--overlap", "1"]


def _write(path: Path, text: str) -> None:
    """Replace the file at once, as the kubelet's swap of a Secret volume does."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_revoked_token_is_replaced_from_the_file_and_training_goes_on(tmp_path: Path) -> None:
    revocations = tmp_path / "revocations.json"
    revocations.write_text("{}")
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=P, extra=["--revocations-file", str(revocations)])
    sync.start()
    token = tmp_path / "token"
    expires = int(time.time()) + 3600
    _write(token, learner_token(SECRET, "a", expires_at=expires))
    learner = learner_process(
        tmp_path, "a", sync.url, [*PLAN, "--max-steps", "5000", "--token-file", str(token)]
    )
    try:
        learner.start()

        def rounds(at_least: int) -> dict[int, int] | None:
            assert learner.running(), learner.failure_report()
            versions = sync.versions()
            return versions if versions and min(versions.values()) >= at_least else None

        before = wait_for(lambda: rounds(3), timeout=240, what="3 rounds on every fragment")
        _write(revocations, json.dumps({"a": 1}))  # the learner's token is refused from now on
        time.sleep(4)
        _write(token, learner_token(SECRET, "a", expires_at=expires, generation=1))
        after = min(before.values()) + 3
        wait_for(lambda: rounds(after), timeout=240, what=f"{after} rounds after the revocation")
        assert learner.pid is not None
        os.kill(learner.pid, signal.SIGTERM)
        deadline = time.monotonic() + 120
        while learner.running() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert learner.returncode() == 0, learner.failure_report()
        log = learner.log_path.read_text()
        assert "the learner token was refused" in log or "registering again" in log, log[-3000:]
        assert "refused (HTTP 401" not in log  # no contribution was dropped for the refused token
        (state,) = sync.status()["learners"]
        assert (state["learner_id"], state["state"]) == ("a", "left")
    finally:
        stop_all([learner])
        sync.stop()
