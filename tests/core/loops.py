"""Tests that run on the numpy code and on the compiled loops (``diloco_core.compiled``) alike."""

from __future__ import annotations

import pytest
from diloco_core import compiled

PATHS = ["numpy", "compiled"]


def take_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, *loops: compiled.Loop) -> None:
    """For an autouse fixture parametrized with ``PATHS``: no compiled loop at all, or ``loops``
    compiled before the test (skipped without numba)."""
    if request.param == "numpy":
        monkeypatch.setattr(compiled, "_ready", {})
        monkeypatch.setattr(compiled, "ENABLED", False)
        return
    pytest.importorskip("numba")
    monkeypatch.setattr(compiled, "ENABLED", True)
    for loop in loops:
        assert compiled.compile_now(loop), loop.key
