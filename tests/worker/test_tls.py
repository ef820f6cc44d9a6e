"""A learner and a synchronizer over HTTPS, as real processes: the learner trusts the CA bundle it
is given (``--sync-ca-file``) and trains; given another CA, or none, it stops at once with what to
set instead of retrying forever."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_testbed.pki import Ca, issue_server_cert, make_ca
from diloco_testbed.process import ManagedProcess
from diloco_testbed.waiting import wait_for

from tests.worker.helpers import Synchronizer, iter_logs, learner_process, metric_step

pytestmark = pytest.mark.integration
PLAN = ["--inner-steps", "4", "--fragments", "2", "--overlap", "1", "--warmup-steps", "2"]


def _https_synchronizer(tmp: Path, ca: Ca) -> Synchronizer:
    cert, key = issue_server_cert(ca, tmp / "pki", "sync", ["127.0.0.1", "localhost"])
    sync = Synchronizer(tmp, inner_steps=4, fragments=2, tls=(cert, key, ca.cert))
    sync.start()
    return sync


def _exit_code(proc: ManagedProcess, timeout: float = 120) -> int | None:
    wait_for(lambda: not proc.running(), timeout=timeout, what=f"{proc.name} to stop", interval=0.5)
    return proc.returncode()


def test_a_learner_trusting_the_ca_trains_over_https(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    sync = _https_synchronizer(tmp_path, ca)
    learner = learner_process(tmp_path, "tls-a", sync.url, [*PLAN, "--sync-ca-file", str(ca.cert)])
    learner.start()
    try:
        wait_for(lambda: any(v >= 1 for v in sync.versions().values()), timeout=240,
                 what="a merged round over HTTPS", describe=learner.failure_report)  # fmt: skip
        assert metric_step(tmp_path / "tls-a.jsonl") > 0
        wait_for(lambda: sync.learner_steps().get("tls-a", 0) > 0, timeout=30, what="a heartbeat over HTTPS")
    finally:
        learner.stop()
        sync.stop()


@pytest.mark.parametrize(("trust", "reason"), [
    ("another CA", "unable to get local issuer certificate"),
    ("the public CAs", "unable to get local issuer certificate"),
    # strict on every Python (as Python 3.13 is by default): a CA certificate without keyUsage is refused
    ("its CA, which lacks keyUsage", "CA cert does not include key usage extension"),
])  # fmt: skip
def test_a_learner_that_does_not_trust_the_certificate_stops_with_what_to_set(
    tmp_path: Path, trust: str, reason: str
) -> None:
    ca = make_ca(tmp_path / "ca", key_usage=trust != "its CA, which lacks keyUsage")
    sync = _https_synchronizer(tmp_path, ca)
    flags = list(PLAN)
    if trust == "another CA":
        flags += ["--sync-ca-file", str(make_ca(tmp_path / "other-ca", "another-ca").cert)]
    elif trust != "the public CAs":
        flags += ["--sync-ca-file", str(ca.cert)]
    learner = learner_process(tmp_path, "tls-b", sync.url, flags)
    learner.start()
    try:
        assert _exit_code(learner) == 3
        log = "\n".join(iter_logs(learner))
        assert f"the TLS certificate of the synchronizer at {sync.url} is not trusted: {reason}" in log, log[
            -3000:
        ]
        assert "--sync-ca-file / DILOCO_SYNC_CA_FILE" in log, log[-3000:]
        assert "retrying" not in log, log[-3000:]  # refused for good at once, not retried
        assert sync.status()["learners"] == []
    finally:
        learner.stop()
        sync.stop()


def test_an_unreadable_ca_bundle_is_a_start_up_error(tmp_path: Path) -> None:
    (tmp_path / "not-a-ca.pem").write_text("not a certificate\n")
    learner = learner_process(tmp_path, "tls-c", "https://127.0.0.1:9", [*PLAN, "--sync-ca-file",
                                                                          str(tmp_path / "not-a-ca.pem")])  # fmt: skip
    learner.start()
    try:
        assert _exit_code(learner) == 2
        log = "\n".join(iter_logs(learner))
        assert f"cannot read the CA bundle {tmp_path / 'not-a-ca.pem'}" in log, log[-3000:]
    finally:
        learner.stop()
