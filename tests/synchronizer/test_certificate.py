"""A renewed TLS certificate taken without a restart, and a broken renewal not taken."""

from __future__ import annotations

import os
import shutil
import ssl
from pathlib import Path

import pytest
from diloco_sync.certificate import ServerCertificate
from diloco_testbed.pki import issue_server_cert, make_ca


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
