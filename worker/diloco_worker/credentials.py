"""The learner's token: given once, or read from a file that is re-read whenever it changes (a
mounted Secret, which the operator renews before the token expires and replaces when it is revoked;
the kubelet swaps the file in place, so a running learner picks the new token up)."""

from __future__ import annotations

import os
import threading
import time

MAX_TOKEN_FILE_BYTES = 4096
POLL_S = 1.0


class TokenSource:
    """``current()``: the token to send now."""

    def __init__(self, token: str | None = None, path: str | None = None) -> None:
        if (token is None) == (path is None):
            raise ValueError("a learner token, or the file that holds it: exactly one")
        self.path = path
        self._token = token or ""
        self._stamp: tuple[int, int, int] | None = None
        self._lock = threading.Lock()
        if path is not None:
            self._reload(required=True)

    def _reload(self, *, required: bool = False) -> None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self.path, encoding="utf-8") as f:
                text = f.read(MAX_TOKEN_FILE_BYTES + 1).strip()
        except OSError as exc:
            if required:
                raise ValueError(
                    f"cannot read the learner token file {self.path} (--token-file): {exc}"
                ) from exc
            return  # (a moment between the kubelet's swaps: keep the token held)
        if not text or len(text) > MAX_TOKEN_FILE_BYTES:
            if required:
                raise ValueError(f"the learner token file {self.path} (--token-file) is empty or too large")
            return
        self._token, self._stamp = text, stamp

    def wait_for_new(self, refused: str, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Wait up to ``timeout_s`` for a token other than ``refused`` (the kubelet brings a renewed
        or re-minted one within a minute or two); True once there is one. A given token never changes."""
        deadline = time.monotonic() + timeout_s
        while self.current() == refused:
            if self.path is None or time.monotonic() >= deadline:
                return False
            if stop is not None and stop.wait(POLL_S):
                return False
            if stop is None:
                time.sleep(POLL_S)
        return True

    def current(self) -> str:
        if self.path is not None:
            with self._lock:
                self._reload()
        return self._token
