"""Certificates and keys for the test control plane, made with the `openssl` command."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from .prereq import require_tool

_OPENSSL_HINT = "install OpenSSL (Debian/Ubuntu: apt-get install openssl)"
_SERVER_EXT = """\
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.96.0.1
"""

_CLIENT_EXT = """\
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
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


def make_pki(folder: Path) -> Pki:
    """A throw-away CA, a serving certificate for 127.0.0.1 and a service-account key pair."""
    openssl = require_tool("openssl", _OPENSSL_HINT)
    folder.mkdir(parents=True, exist_ok=True)
    names = ("ca.crt", "ca.key", "server.crt", "server.key", "sa.key", "sa.pub", "kubelet-client.crt",
             "kubelet-client.key")  # fmt: skip
    pki = Pki(*(folder / n for n in names))
    days = "30"
    _run(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", days, "-subj", "/CN=diloco-test-ca", cwd=folder)  # fmt: skip
    _run(openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=kube-apiserver", cwd=folder)  # fmt: skip
    (folder / "server.ext").write_text(_SERVER_EXT)
    _run(openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.crt", "-days", days, "-extfile", "server.ext", cwd=folder)  # fmt: skip
    _run(openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kubelet-client.key", "-out", "kubelet-client.csr",
         "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client", cwd=folder)  # fmt: skip
    (folder / "client.ext").write_text(_CLIENT_EXT)
    _run(openssl, "x509", "-req", "-in", "kubelet-client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "kubelet-client.crt", "-days", days, "-extfile", "client.ext", cwd=folder)  # fmt: skip
    _run(openssl, "genrsa", "-out", "sa.key", "2048", cwd=folder)
    _run(openssl, "rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)
    return pki
