"""Certificates and keys made with the `openssl` command: the test control plane's (``make_pki``),
and a CA with serving certificates for any names (``make_ca``, ``issue_server_cert``)."""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .prereq import require_tool

_OPENSSL_HINT = "install OpenSSL (Debian/Ubuntu: apt-get install openssl)"
# RFC 5280 as strict verifiers read it (Python 3.13's default contexts, and the worker's, set
# VERIFY_X509_STRICT): a CA with a critical keyUsage, certificates naming their issuer's key
_SERVER_EXT = """\
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer
subjectAltName={names}
"""
_APISERVER_NAMES = ("127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                    "10.96.0.1")  # fmt: skip

_CLIENT_EXT = """\
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer
"""


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    sa_key: Path
    sa_pub: Path
    kubelet_client_cert: Path  # the apiserver's identity towards kubelets (logs, exec): system:masters
    kubelet_client_key: Path


def _run(openssl: str, *args: str, cwd: Path) -> None:
    result = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{result.stderr}")


_DAYS = "30"


@dataclass(frozen=True)
class Ca:
    cert: Path
    key: Path


def make_ca(folder: Path, name: str = "diloco-test-ca", *, key_usage: bool = True) -> Ca:
    """A throw-away certificate authority: ``ca.crt`` and ``ca.key`` in ``folder``. Without
    ``key_usage`` its certificate lacks the keyUsage extension, which strict verifiers refuse."""
    openssl = require_tool("openssl", _OPENSSL_HINT)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ca.ext").write_text("[ca]\nbasicConstraints=critical,CA:TRUE\nsubjectKeyIdentifier=hash\n"
                                   + ("keyUsage=critical,keyCertSign,cRLSign\n" if key_usage else ""))  # fmt: skip
    _run(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", _DAYS, "-subj", f"/CN={name}", "-config", "ca.ext", "-extensions", "ca", cwd=folder)  # fmt: skip
    return Ca(folder / "ca.crt", folder / "ca.key")


def issue_server_cert(ca: Ca, folder: Path, stem: str, names: Sequence[str]) -> tuple[Path, Path]:
    """A serving certificate signed by ``ca`` for ``names`` (IP addresses and DNS names, the first
    also its common name): ``<stem>.crt`` and ``<stem>.key`` in ``folder``."""
    openssl = require_tool("openssl", _OPENSSL_HINT)
    folder.mkdir(parents=True, exist_ok=True)
    sans = ",".join(f"IP:{n}" if _is_ip(n) else f"DNS:{n}" for n in names)
    _run(openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{stem}.key", "-out", f"{stem}.csr",
         "-subj", f"/CN={names[0]}", cwd=folder)  # fmt: skip
    (folder / f"{stem}.ext").write_text(_SERVER_EXT.format(names=sans))
    _run(openssl, "x509", "-req", "-in", f"{stem}.csr", "-CA", str(ca.cert), "-CAkey", str(ca.key),
         "-CAcreateserial", "-out", f"{stem}.crt", "-days", _DAYS, "-extfile", f"{stem}.ext", cwd=folder)  # fmt: skip
    return folder / f"{stem}.crt", folder / f"{stem}.key"


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def make_pki(folder: Path) -> Pki:
    """A throw-away CA, a serving certificate for 127.0.0.1 and a service-account key pair."""
    openssl = require_tool("openssl", _OPENSSL_HINT)
    folder.mkdir(parents=True, exist_ok=True)
    names = ("ca.crt", "ca.key", "server.crt", "server.key", "sa.key", "sa.pub", "kubelet-client.crt",
             "kubelet-client.key")  # fmt: skip
    pki = Pki(*(folder / n for n in names))
    days = _DAYS
    ca = make_ca(folder)
    issue_server_cert(ca, folder, "server", _APISERVER_NAMES)
    _run(openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kubelet-client.key", "-out", "kubelet-client.csr",
         "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client", cwd=folder)  # fmt: skip
    (folder / "client.ext").write_text(_CLIENT_EXT)
    _run(openssl, "x509", "-req", "-in", "kubelet-client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "kubelet-client.crt", "-days", days, "-extfile", "client.ext", cwd=folder)  # fmt: skip
    _run(openssl, "genrsa", "-out", "sa.key", "2048", cwd=folder)
    _run(openssl, "rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)
    return pki
