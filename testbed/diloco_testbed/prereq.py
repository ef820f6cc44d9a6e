"""What to do when a test needs a binary or server that is not there.

Policy: fail with a message that says what to install or run. Outside CI (``CI`` unset) a user
may opt out explicitly with ``DILOCO_TEST_SKIP_MISSING=1``; then the test is skipped with the
same message. Never a silent skip.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

import pytest

BUILD_HINT = "run scripts/build-test-binaries.sh (needs Go >= 1.24 and access to the Go module proxy)"
CACHE_ROOT = Path.home() / ".cache" / "diloco" / "bin"


def skipping_allowed() -> bool:
    return os.environ.get("DILOCO_TEST_SKIP_MISSING") == "1" and not os.environ.get("CI")


def unavailable(message: str) -> NoReturn:
    """Fail (or, when the user opted out outside CI, skip) with `message`."""
    if skipping_allowed():
        pytest.skip(message)
    pytest.fail(
        message + "\n(outside CI, DILOCO_TEST_SKIP_MISSING=1 skips such tests instead)", pytrace=False
    )


def bin_dir() -> Path:
    """The folder with etcd, kube-* , kwok and helm: $DILOCO_TEST_BIN_DIR or the cached build."""
    configured = os.environ.get("DILOCO_TEST_BIN_DIR")
    return Path(configured) if configured else CACHE_ROOT / "current"


def require_binary(name: str) -> Path:
    path = bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        unavailable(f"test binary {name!r} not found in {path.parent}: {BUILD_HINT}")
    return path


def find_tool(name: str) -> str | None:
    """A command next to this Python (tools installed in the venv), else on PATH; None when neither."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def require_tool(name: str, hint: str) -> str:
    """A command from PATH (or next to this Python, for tools installed in the venv)."""
    found = find_tool(name)
    if found is None:
        unavailable(f"{name!r} not found on PATH or in {Path(sys.executable).parent}: {hint}")
    return found
