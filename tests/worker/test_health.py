"""The learner's /healthz and /readyz: the pure answer, the stdlib server, and a real learner process."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from diloco_testbed.ports import free_port
from diloco_testbed.process import ManagedProcess
from diloco_testbed.waiting import wait_for
from diloco_worker.health import Health, HealthServer, probe_answer

from tests.worker.helpers import TINY_FLAGS, clean_env, metric_step


def test_liveness_follows_the_age_of_the_newest_beat() -> None:
    fresh = probe_answer("/healthz", beat_age_s=3.0, stale_after_s=10.0, ready=False, phase="starting")
    stale = probe_answer("/healthz", beat_age_s=10.5, stale_after_s=10.0, ready=True, phase="training")
    assert (fresh.status, fresh.body["alive"]) == (200, True)
    assert (stale.status, stale.body["alive"]) == (503, False)
    assert stale.body["last_beat_age_s"] == 10.5


def test_readiness_needs_training_and_a_fresh_beat() -> None:
    assert (
        probe_answer("/readyz", beat_age_s=0.0, stale_after_s=5, ready=False, phase="starting").status == 503
    )
    assert (
        probe_answer("/readyz", beat_age_s=0.0, stale_after_s=5, ready=True, phase="training").status == 200
    )
    assert (
        probe_answer("/readyz/", beat_age_s=9.0, stale_after_s=5, ready=True, phase="training").status == 503
    )


def test_unknown_path_is_404_with_the_known_ones_named() -> None:
    answer = probe_answer("/metrics", beat_age_s=0.0, stale_after_s=5, ready=True, phase="training")
    assert answer.status == 404
    assert "/healthz" in answer.body["error"]


def test_health_rejects_a_non_positive_staleness_limit() -> None:
    with pytest.raises(ValueError, match="stale_after_s"):
        Health(0.0)


@pytest.mark.integration
def test_server_answers_from_the_beats_of_the_loop() -> None:
    now = [100.0]
    health = Health(30.0, clock=lambda: now[0])
    server = HealthServer(health, "127.0.0.1", 0).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=5) as http:
            assert http.get("/healthz").status_code == 200  # just started: alive, not ready
            assert http.get("/readyz").status_code == 503
            health.beat("training")
            assert http.get("/readyz").json()["ready"] is True
            now[0] += 31.0  # the loop went quiet for longer than the limit
            resp = http.get("/healthz")
            assert resp.status_code == 503
            assert resp.json() == {
                "phase": "training", "last_beat_age_s": 31.0, "stale_after_s": 30.0, "alive": False,
            }  # fmt: skip
            health.beat("blocked")  # a learner waiting for a synchronous round is alive and ready
            assert http.get("/healthz").status_code == 200
            assert http.get("/readyz").status_code == 200
    finally:
        server.close()


def _worker(tmp: Path, port: int, flags: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
    argv = [
        sys.executable,
        "-m",
        "diloco_worker",
        *TINY_FLAGS,
        "--metrics-file",
        str(tmp / "m.jsonl"),
        *flags,
    ]
    return ManagedProcess(
        "learner", argv, tmp / "learner.log", env=clean_env({"DILOCO_HEALTH_PORT": str(port)} | (env or {}))
    )


@pytest.mark.integration
@pytest.mark.slow
def test_a_training_learner_is_alive_and_ready(tmp_path: Path) -> None:
    port = free_port()
    proc = _worker(tmp_path, port, ["--standalone", "--max-steps", "100000", "--health-host", "127.0.0.1"])
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)
    try:
        proc.start()
        wait_for(
            lambda: metric_step(tmp_path / "m.jsonl") >= 3,
            timeout=120,
            what="training",
            describe=proc.failure_report,
        )
        ready = http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["phase"] == "training"
        assert http.get("/healthz").status_code == 200
        proc.stop(timeout=60)
        assert proc.returncode() == 0, proc.failure_report()
    finally:
        proc.stop()
        http.close()


@pytest.mark.integration
@pytest.mark.slow
def test_a_learner_waiting_for_its_synchronizer_is_alive_but_not_ready(tmp_path: Path) -> None:
    port, nowhere = free_port(), free_port()
    flags = ["--sync-url", f"http://127.0.0.1:{nowhere}", "--job-secret", "s", "--health-host", "127.0.0.1"]
    proc = _worker(tmp_path, port, [*flags, "--max-steps", "10"])
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)
    try:
        proc.start()
        wait_for(
            lambda: "retrying" in proc.log_path.read_text(), timeout=120, what="registration retries",
            describe=proc.failure_report,
        )  # fmt: skip
        alive, ready = http.get("/healthz"), http.get("/readyz")
        assert (alive.status_code, alive.json()["phase"]) == (200, "starting")
        assert ready.status_code == 503
        assert metric_step(tmp_path / "m.jsonl") == 0
    finally:
        proc.stop()
        http.close()


def test_health_port_already_taken_is_a_clear_error(tmp_path: Path) -> None:
    import socket
    import subprocess

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = [
            sys.executable,
            "-m",
            "diloco_worker",
            "--standalone",
            "--health-host",
            "127.0.0.1",
            "--health-port",
            str(port),
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, env=clean_env(), timeout=120)
    assert proc.returncode == 2
    assert "--health-port / DILOCO_HEALTH_PORT" in proc.stderr
