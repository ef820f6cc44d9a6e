from __future__ import annotations

import numpy as np
import pytest
from diloco_core import codec, quantized_arrays
from diloco_core.code_norms import array_sum_squares
from diloco_core.fragments import build_plan
from diloco_core.merge import Codes, merge_fragment
from diloco_core.payload_errors import CorruptPayload
from diloco_core.quantized_arrays import QuantizedArrays

SPEC = build_plan([("a", [300, 7]), ("b", [1001])], 1, 4, 1).fragments[0]


def _payload(quantizer: str, seed: int = 0) -> QuantizedArrays:
    rng = np.random.default_rng(seed)
    tensors = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in SPEC.tensors}
    blob = codec.encode(tensors, fragment=0, base_version=0, kind="outer_grad", quantizer=quantizer)
    return codec.decode_quantized(blob, fragment=SPEC).tensors


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1"])
def test_a_blocked_payloads_tensor_is_read_from_its_codes_as_its_decoded_values(quantizer: str) -> None:
    arrays = _payload(quantizer)
    for name in arrays:
        codes = arrays.codes(name)
        assert isinstance(codes, Codes)
        decoded = arrays[name]
        assert codes.shape == decoded.shape
        np.testing.assert_array_equal(codes.values(), decoded)
        assert codes.sum_squares() == pytest.approx(array_sum_squares(decoded), rel=1e-6)
        acc = np.ones(decoded.size, dtype=np.float32)
        codes.add_to(acc, np.float32(0.3))
        np.testing.assert_array_equal(acc, np.float32(1) + decoded.reshape(-1) * np.float32(0.3))


@pytest.mark.parametrize("quantizer", ["fp32", "fp16", "bf16", "topk"])
def test_other_formats_are_read_as_arrays_and_merge_as_their_decoded_values(quantizer: str) -> None:
    payloads = [_payload(quantizer, seed) for seed in range(3)]
    assert all(p.codes(name) is None for p in payloads for name in p)
    weights = [1.0, 2.0, 0.5]
    merged = merge_fragment(payloads, weights, rule="rda", kind="dense")  # type: ignore[arg-type]
    expected = merge_fragment([dict(p) for p in payloads], weights, rule="rda", kind="dense")
    for name in expected:
        assert merged[name].tobytes() == expected[name].tobytes()


def test_a_tensors_sum_of_squares_is_found_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    found = quantized_arrays.sum_squares

    def counted(*args: object) -> float:
        calls.append(1)
        return found(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(quantized_arrays, "sum_squares", counted)
    arrays = _payload("int4")
    first = [arrays.sum_squares(name) for name in arrays]
    again = [arrays.sum_squares(name) for name in arrays]
    assert first == again
    assert len(calls) == len(arrays)


@pytest.mark.parametrize("shape", [(0, 2**63), (0, 2**62), (2**40, 0, 2**40)])
def test_a_shape_no_array_can_have_is_corrupt_when_read(shape: tuple[int, ...]) -> None:
    """The header check refuses these first; the read does not let numpy's ValueError out either."""
    arrays = QuantizedArrays(memoryview(b""), [("a", shape, (0, 0), (0, 0))], "int8", 256)
    assert arrays.shape("a") == shape
    with pytest.raises(CorruptPayload, match="tensor 'a': shape"):
        arrays["a"]
