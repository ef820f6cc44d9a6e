"""Loops compiled in the background and used once ready: never compiled on a call, never for small
work, and the numpy code used until then or without them."""

from __future__ import annotations

import builtins
import time
from typing import Any

import numpy as np
import pytest
from diloco_core import compiled

pytest.importorskip("numba")


class Counted:
    """A loop that doubles a float32 array into another, counting how often it is built."""

    def __init__(self, fail: bool = False) -> None:
        self.builds, self.fail = 0, fail

    def build(self, njit: Any) -> Any:
        self.builds += 1
        if self.fail:
            raise RuntimeError("this loop does not compile")

        @njit()
        def double(out: Any, x: Any) -> None:
            for i in range(x.size):
                out[i] = x[i] * np.float32(2)

        return double

    def spec(self, key: str) -> compiled.Loop:
        return compiled.Loop(
            key, self.build, lambda: (np.zeros(2, np.float32), compiled.read_only(np.zeros(2, np.float32)))
        )


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "ENABLED", True)
    monkeypatch.setattr(compiled, "_ready", {})
    monkeypatch.setattr(compiled, "_asked", set())


def _when_ready(spec: compiled.Loop) -> Any:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = compiled.loop(spec, 0)
        if found is not None:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{spec.key} was not compiled in the background")


def test_small_work_never_asks_for_a_loop() -> None:
    counted = Counted()
    assert compiled.loop(counted.spec("small"), compiled.WORTH_COMPILING - 1) is None
    time.sleep(0.2)
    assert compiled.loop(counted.spec("small"), 0) is None
    assert counted.builds == 0


def test_large_work_has_its_loop_compiled_in_the_background_once() -> None:
    counted = Counted()
    spec = counted.spec("large")
    assert compiled.loop(spec, compiled.WORTH_COMPILING) is None  # the numpy code, this time
    for _ in range(5):
        compiled.loop(spec, compiled.WORTH_COMPILING)
    double = _when_ready(spec)
    out = np.zeros(3, np.float32)
    double(out, compiled.read_only(np.array([1, 2, 3], np.float32)))
    np.testing.assert_array_equal(out, [2, 4, 6])
    assert counted.builds == 1
    assert compiled.loop(spec, 1) is double  # small work uses it once it is there


def test_a_loop_that_does_not_compile_leaves_the_numpy_code_in_use(caplog: pytest.LogCaptureFixture) -> None:
    failing = Counted(fail=True)
    assert compiled.compile_now(failing.spec("failing")) is None
    assert compiled.loop(failing.spec("failing"), compiled.WORTH_COMPILING) is None
    assert "compiling the loop 'failing' failed" in caplog.text


def test_a_numba_that_does_not_load_leaves_the_numpy_code_in_use(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_import = builtins.__import__

    def failing_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "numba":
            raise OSError("libLLVM: cannot open shared object file")  # a broken install, not a missing one
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(compiled, "_njits", [])
    monkeypatch.setattr(builtins, "__import__", failing_import)
    counted = Counted()
    assert compiled.compile_now(counted.spec("no-numba")) is None
    assert compiled.loop(counted.spec("no-numba"), compiled.WORTH_COMPILING) is None
    assert counted.builds == 0
    assert "importing numba failed" in caplog.text


def test_turned_off_nothing_is_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "ENABLED", False)
    counted = Counted()
    assert compiled.compile_now(counted.spec("off")) is None
    assert compiled.loop(counted.spec("off"), compiled.WORTH_COMPILING) is None
    assert counted.builds == 0


def test_read_only_gives_a_view_that_refuses_writes_and_leaves_the_array_writable() -> None:
    a = np.zeros(3, np.float32)
    view = compiled.read_only(a)
    assert view.base is a
    assert not view.flags.writeable
    assert a.flags.writeable
    assert compiled.read_only(view) is view
