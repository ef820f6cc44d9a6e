"""The server's TLS certificate: a context made from its PEM files, made again when a renewal
rewrites them."""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context with the certificate chain and key (PEM files); raises ``ValueError`` saying
    which file could not be used and why."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"cannot use the TLS certificate {cert_file} with the key {key_file}: {exc}"
        ) from exc
    return context


class ServerCertificate:
    """The server's TLS context, read again when its certificate or key file changes: a renewed
    certificate (cert-manager rewrites the Secret, the kubelet the mounted files) serves new
    connections without a restart. The files are looked at when a connection arrives, at most every
    ``check_every_s``; a renewal that cannot be used keeps the previous certificate (logged)."""

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        *,
        check_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cert_file, self.key_file, self.check_every_s, self._clock = (
            cert_file,
            key_file,
            check_every_s,
            clock,
        )
        self._context = server_tls_context(cert_file, key_file)
        self._stamp = self._files()
        self._next_check = clock() + check_every_s

    def _files(self) -> tuple[tuple[int, int, int], ...]:
        """What identifies the files' contents: inode, size and modification time of each (the
        kubelet replaces a mounted Secret's files by switching a symbolic link)."""
        try:
            stats = [os.stat(f) for f in (self.cert_file, self.key_file)]
        except OSError:
            return ()
        return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in stats)

    def context(self) -> ssl.SSLContext:
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self.check_every_s
            stamp = self._files()
            if stamp and stamp != self._stamp:
                try:
                    self._context = server_tls_context(self.cert_file, self.key_file)
                    log.info("serving HTTPS with the renewed certificate %s", self.cert_file)
                except ValueError as exc:
                    log.warning("kept the previous TLS certificate: %s", exc)
                self._stamp = stamp
        return self._context
