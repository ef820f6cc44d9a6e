"""The compiled loops over codes themselves; what they decode is checked against each format's
formula in tests/core/test_code_levels.py, which runs every test on both the numpy code and them."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core import code_kernels, code_levels, compiled
from diloco_core import quantize as q

pytest.importorskip("numba")


@pytest.fixture(autouse=True)
def compiled_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "ENABLED", True)
    for mode in (code_kernels.WRITE, code_kernels.ADD_SCALED):
        assert compiled.compile_now(code_kernels.decoder("int4", 4, mode))


def test_codes_or_scales_too_short_for_the_values_are_refused_before_the_loop() -> None:
    """The loops check no bounds: a caller's wrong length is a ValueError, never a read past the end."""
    n, block = 1000, 100
    values, scales = q.quantize(np.ones(n, dtype=np.float32), "int4", block)
    s = np.frombuffer(scales, dtype="<f4")
    with pytest.raises(ValueError, match="need more codes or scales"):
        code_levels.decode(bytes(values)[:-1], s, "int4", n, block)
    with pytest.raises(ValueError, match="need more codes or scales"):
        code_levels.add_decoded(np.zeros(n, np.float32), np.float32(2), values, s[:-1], "int4", n, block)


def test_a_loop_takes_the_types_it_was_compiled_for_and_no_others() -> None:
    """Compiling on a call would put the compiler on a request's way: other types are refused."""
    kernel = compiled.loop(code_kernels.decoder("int4", 4, code_kernels.WRITE), 0)
    assert kernel is not None
    packed = compiled.read_only(np.full(4, 0x98, np.uint8))  # codes 8 and 9: levels 0 and 1/7
    out = np.empty(8, np.float32)
    kernel(out, np.float32(1), packed, np.full(1, 7, np.float32), code_levels.level_table("int4"), 8)
    np.testing.assert_array_equal(out, np.tile(np.array([0, 1], np.float32), 4))
    with pytest.raises(TypeError):
        kernel(
            out.astype(np.float64),
            np.float32(1),
            packed,
            np.ones(1, np.float32),
            code_levels.level_table("int4"),
            8,
        )
    # writable codes are taken as read-only ones, by the same compiled code
    kernel(
        out,
        np.float32(1),
        np.full(4, 0x98, np.uint8),
        np.full(1, 7, np.float32),
        code_levels.level_table("int4"),
        8,
    )
    np.testing.assert_array_equal(out, np.tile(np.array([0, 1], np.float32), 4))
    assert len(kernel.signatures) == 1
