"""The three ways a storage call fails (``diloco_core.storage``), and the keys every store takes."""

from __future__ import annotations

import re

_KEY_RE = re.compile(r"^[A-Za-z0-9._\-][A-Za-z0-9._\-/]*$")


class StorageError(Exception):
    """A storage failure that retrying will not fix."""


class StorageUnavailable(StorageError):
    """The backend cannot be reached right now; retry later."""


class ObjectNotFound(StorageError, KeyError):
    """The key does not exist."""


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, without '..' segments, empty segments or odd characters."""
    if not _KEY_RE.match(key) or any(part in ("", ".", "..") for part in key.split("/")):
        raise StorageError(f"invalid object key {key!r}")
    return key
