"""The connection cap's arithmetic (the limits themselves are tested against a real process in
``test_bad_input``: slow request heads with a low limit of open files; under TLS in ``test_tls``), and
a renewed TLS certificate taken without a restart."""

from __future__ import annotations

import os
import resource
import shutil
import ssl
from pathlib import Path

import pytest
from diloco_sync.connections import (
    FD_RESERVE,
    MIN_CONNECTIONS,
    ConnectionLimits,
    ServerCertificate,
    body_too_slow,
    effective_max_connections,
)
from diloco_testbed.pki import issue_server_cert, make_ca


def test_the_cap_leaves_descriptors_for_everything_else() -> None:
    assert effective_max_connections(4096, 1_048_576) == 4096
    assert effective_max_connections(4096, 1024) == 1024 - FD_RESERVE
    assert effective_max_connections(4096, 256) == 256 - FD_RESERVE
    assert effective_max_connections(100, 256) == 100
    assert effective_max_connections(4096, 16) == MIN_CONNECTIONS
    assert effective_max_connections(4096, resource.RLIM_INFINITY) == 4096


def test_a_body_is_judged_slow_only_after_its_grace_and_below_the_minimum_rate() -> None:
    limits = ConnectionLimits(
        header_timeout_s=10.0, body_timeout_s=60.0, max_connections=8, min_body_rate=1024.0
    )
    assert not body_too_slow(0, 9.9, limits)  # within the grace: a body may start late
    assert body_too_slow(10, 10.0, limits)  # a byte now and then: 1 byte/s
    assert not body_too_slow(10_240, 10.0, limits)  # exactly the minimum
    assert body_too_slow(10_239, 10.0, limits)
    off = ConnectionLimits(header_timeout_s=10.0, body_timeout_s=60.0, max_connections=8)
    assert not body_too_slow(0, 1000.0, off)


def _handshake(server: ssl.SSLContext, ca: Path) -> None:
    """A TLS handshake in memory between ``server`` and a client trusting ``ca`` alone; raises the
    client's ``SSLCertVerificationError`` when it refuses the certificate."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client_out, server_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = ssl.create_default_context(cafile=str(ca)).wrap_bio(
        to_client, client_out, server_hostname="127.0.0.1"
    )
    served = server.wrap_bio(to_server, server_out, server_side=True)
    pending = [client, served]
    for _ in range(20):
        for end in list(pending):
            try:
                end.do_handshake()
                pending.remove(end)
            except ssl.SSLWantReadError:
                pass
        to_server.write(client_out.read())
        to_client.write(server_out.read())
        if not pending:
            return
    raise AssertionError("the handshake did not finish")


def _install(cert: Path, key: Path, folder: Path, generation: int) -> None:
    """Put a certificate where a mounted Secret's files are, the way the kubelet renews them: new
    files in a fresh folder, then the ``..data`` link switched to it."""
    data = folder / f"..{generation}"
    data.mkdir()
    shutil.copy(cert, data / "tls.crt")
    shutil.copy(key, data / "tls.key")
    (folder / "..data.tmp").symlink_to(data.name)
    os.replace(folder / "..data.tmp", folder / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")


def test_a_renewed_certificate_serves_new_connections_and_a_broken_one_is_not_taken(tmp_path: Path) -> None:
    first_ca, second_ca = make_ca(tmp_path / "ca1"), make_ca(tmp_path / "ca2", "renewed-ca")
    mounted = tmp_path / "tls"
    mounted.mkdir()
    _install(*issue_server_cert(first_ca, tmp_path, "first", ["127.0.0.1"]), mounted, 1)
    now = [0.0]
    served = ServerCertificate(str(mounted / "tls.crt"), str(mounted / "tls.key"), check_every_s=30,
                               clock=lambda: now[0])  # fmt: skip
    _handshake(served.context(), first_ca.cert)

    _install(*issue_server_cert(second_ca, tmp_path, "second", ["127.0.0.1"]), mounted, 2)
    now[0] = 10.0  # not looked at again yet
    _handshake(served.context(), first_ca.cert)
    now[0] = 31.0
    _handshake(served.context(), second_ca.cert)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(served.context(), first_ca.cert)

    cert, _ = issue_server_cert(first_ca, tmp_path, "third", ["127.0.0.1"])
    _, other_key = issue_server_cert(first_ca, tmp_path, "fourth", ["127.0.0.1"])
    _install(cert, other_key, mounted, 3)  # a key that does not match: kept the renewed one
    now[0] = 62.0
    _handshake(served.context(), second_ca.cert)
