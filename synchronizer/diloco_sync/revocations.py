"""Revoked learner tokens: the lowest token generation the job accepts per learner.

The operator keeps them in a ConfigMap mounted as a file (``{"<learner id>": <generation>}``); a
token of a lower generation is refused (401) from when the file says so. The file is re-read when it
changes, checked at most once a second on the request path; a file that does not parse at start is an
error, one that stops parsing later leaves the last good revocations in force (and is logged), so a
bad edit never lets a revoked token back in.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("diloco.sync.revocations")

CHECK_EVERY_S = 1.0
MAX_FILE_BYTES = 4 * 1024 * 1024


def parse_revocations(text: str) -> dict[str, int]:
    """The revocations a file holds; ``ValueError`` naming what is wrong."""
    try:
        body = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"revocations are not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("revocations must be a JSON object of learner id to generation")
    out: dict[str, int] = {}
    for learner, generation in body.items():
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise ValueError(f"revocations: generation of {learner!r} must be a non-negative integer")
        out[learner] = generation
    return out


class Revocations:
    """``min_generation(learner)`` from the revocations file (none when there is no file)."""

    def __init__(self, path: str | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._stamp: tuple[int, int] | None = None
        self._checked = float("-inf")
        self._table: Mapping[str, int] = {}
        if path is not None:
            self._table = parse_revocations(self._read(path))
            self._stamp = self._stat(path)
            self._checked = clock()

    @staticmethod
    def _stat(path: str) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    @staticmethod
    def _read(path: str) -> str:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_FILE_BYTES + 1)
        if len(text) > MAX_FILE_BYTES:
            raise ValueError(f"revocations file {path} is larger than {MAX_FILE_BYTES} bytes")
        return text

    def _refresh(self) -> None:
        if self.path is None or self.clock() - self._checked < CHECK_EVERY_S:
            return
        self._checked = self.clock()
        stamp = self._stat(self.path)
        if stamp is None or stamp == self._stamp:
            return
        try:
            table = parse_revocations(self._read(self.path))
        except (OSError, ValueError) as exc:
            log.error("revocations file %s not applied, the previous revocations stay: %s", self.path, exc)
            return
        self._stamp, self._table = stamp, table
        log.info("revocations file %s applied: %d learners", self.path, len(table))

    def min_generation(self, learner: str) -> int:
        self._refresh()
        return self._table.get(learner, 0)
