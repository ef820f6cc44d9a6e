"""The synchronizer over TLS as a real process: its connection limits hold from the TCP accept
(a handshake that never comes is counted, bounded by the head timeout and closed to make room),
a head that stalls after the handshake is answered 408 over TLS, and a certificate that cannot be
used stops it at start-up with the reason."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from diloco_testbed.pki import issue_server_cert, make_ca
from diloco_testbed.waiting import wait_for

from tests.synchronizer.helpers import SyncProcess

pytestmark = pytest.mark.integration
PLAN = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1"]


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_connections_are_held_to_the_limits_from_the_tcp_accept(tmp_path: Path, test_logs_dir: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    cert, key = issue_server_cert(ca, tmp_path / "pki", "sync", ["127.0.0.1"])
    args = [*PLAN, "--tls-cert", str(cert), "--tls-key", str(key), "--max-connections", "8",
            "--header-timeout-s", "3"]  # fmt: skip
    sync = SyncProcess(test_logs_dir / "sync", f"file://{tmp_path / 'store'}", args, tls_ca=ca.cert)
    sync.start()
    silent: list[socket.socket] = []
    try:
        # as many connections as the cap allows, none of which starts its TLS handshake
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", sync.port), timeout=5)
            sock.setblocking(False)
            silent.append(sock)
        # a real client still gets in: a silent one is closed to make room
        wait_for(lambda: httpx.get(f"{sync.url}/healthz", timeout=10, verify=sync.verify).status_code == 200,
                 timeout=30, what="/healthz over TLS with the cap full of silent connections", interval=0.6)  # fmt: skip
        # and every silent one goes after the head timeout, not after asyncio's 60 s handshake timeout
        wait_for(lambda: all(_closed_by_server(s) for s in silent), timeout=30,
                 what="the server to close connections that never started their handshake", interval=0.5)  # fmt: skip

        # after the handshake, a head that stalls is answered 408 over TLS and closed
        client = ssl.create_default_context(cafile=str(ca.cert))
        with (
            socket.create_connection(("127.0.0.1", sync.port), timeout=30) as raw,
            client.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: synchronizer\r\n")  # and never the blank line
            answer = tls.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"code":"timeout"' in answer, answer
    finally:
        for sock in silent:
            sock.close()
        sync.stop()
    log = sync.log_path.read_text(errors="replace")
    assert "serving HTTPS with the certificate" in log
    assert "did not finish its TLS handshake" in log or "closed the connection waiting longest" in log, log[
        -3000:
    ]


@pytest.mark.parametrize("broken", ["missing key", "key of another certificate"])
def test_a_certificate_that_cannot_be_used_stops_the_start_with_the_reason(
    tmp_path: Path, broken: str
) -> None:
    ca = make_ca(tmp_path / "ca")
    cert, key = issue_server_cert(ca, tmp_path / "pki", "sync", ["127.0.0.1"])
    if broken == "missing key":
        key = tmp_path / "nowhere.key"
    else:
        _, key = issue_server_cert(ca, tmp_path / "pki", "other", ["127.0.0.1"])
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "diloco_sync", "--port", str(port), "--storage", f"file://{tmp_path / 'store'}",
         *PLAN, "--tls-cert", str(cert), "--tls-key", str(key)],
        env={"DILOCO_JOB_SECRET": "x", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"cannot use the TLS certificate {cert} with the key {key}" in done.stderr, done.stderr
