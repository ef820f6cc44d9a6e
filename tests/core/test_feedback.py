"""Error feedback: the residual carries what a payload left out into the next one."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core import codec, feedback
from diloco_core.quantize import QUANTIZERS


def _delta(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((8, 32)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float32),
    }


@pytest.mark.parametrize("quantizer", ["int4", "int2", "int1", "topk"])
def test_payload_plus_residual_is_what_was_to_be_sent(quantizer: str) -> None:
    residual = None
    for seed in range(3):
        delta = _delta(seed)
        enc = feedback.encode(
            delta, residual, fragment=0, base_version=seed, kind="outer_grad", quantizer=quantizer
        )
        wanted = feedback.compensate(delta, residual)
        assert codec.decode(enc.blob).tensors.keys() == delta.keys()
        for n in delta:
            np.testing.assert_allclose(enc.decoded[n] + enc.residual[n], wanted[n], rtol=1e-6, atol=1e-7)
        residual = enc.residual


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_what_is_kept_as_decoded_is_bit_for_bit_what_the_receiver_decodes(quantizer: str) -> None:
    """The decoded values come from the quantized parts, not from reading the blob back: they must
    be what a receiver of the blob decodes (a downloaded update makes the same version on both sides)."""
    delta = _delta(4)
    delta["w"][0, :3] = [0.0, -0.0, 1e-30]
    enc = feedback.encode(delta, _delta(5), fragment=1, base_version=7, kind="update", quantizer=quantizer)
    received = codec.decode(enc.blob)
    assert (received.fragment, received.base_version, received.kind) == (1, 7, "update")
    assert received.tensors.keys() == enc.decoded.keys()
    for n, got in received.tensors.items():
        assert enc.decoded[n].dtype == got.dtype == np.float32
        assert enc.decoded[n].shape == got.shape == delta[n].shape
        np.testing.assert_array_equal(enc.decoded[n].view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("quantizer", ["int2", "int1", "topk"])
def test_the_sum_of_what_is_sent_tracks_the_sum_of_the_deltas(quantizer: str) -> None:
    """Over many rounds the sent total differs from the true total only by the last residual, which
    stays bounded; without feedback the error of the total grows with the rounds."""
    residual, sent, true, plain = None, 0.0, 0.0, 0.0
    for seed in range(40):
        delta = _delta(seed)["w"] * 0.01 + 0.002  # a persistent direction under the noise
        enc = feedback.encode({"w": delta}, residual, fragment=0, base_version=seed, kind="outer_grad",
                              quantizer=quantizer)  # fmt: skip
        residual = enc.residual
        sent, true = sent + enc.decoded["w"], true + delta
        plain = plain + codec.decode(codec.encode({"w": delta}, fragment=0, base_version=seed, kind="outer_grad",
                                                  quantizer=quantizer)).tensors["w"]  # fmt: skip
    np.testing.assert_allclose(sent + residual["w"], true, atol=1e-5)
    assert np.abs(sent - true).mean() < np.abs(plain - true).mean()


def test_a_residual_of_other_tensors_is_refused() -> None:
    with pytest.raises(ValueError, match="different tensors"):
        feedback.compensate({"a": np.zeros(2, np.float32)}, {"b": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="residual"):
        feedback.compensate({"a": np.zeros(2, np.float32)}, {"a": np.zeros(3, np.float32)})


@pytest.mark.parametrize("quantizer", ["int4", "int2", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_a_delta_given_up_is_encoded_in_place_to_the_same_bits(quantizer: str, with_residual: bool) -> None:
    residual = _delta(9) if with_residual else None
    kept = feedback.encode(
        _delta(1), residual, fragment=0, base_version=2, kind="update", quantizer=quantizer
    )
    given = _delta(1)
    arrays = {n: given[n] for n in given}
    owned = feedback.encode(
        given, residual, fragment=0, base_version=2, kind="update", quantizer=quantizer, owned=True
    )
    assert owned.blob == kept.blob
    for n in arrays:
        np.testing.assert_array_equal(owned.residual[n].view(np.uint32), kept.residual[n].view(np.uint32))
        np.testing.assert_array_equal(owned.decoded[n], kept.decoded[n])
        assert owned.residual[n] is arrays[n]  # the residual was computed in the array given up
    if residual is not None:
        np.testing.assert_array_equal(residual["w"], _delta(9)["w"])  # the residual given is untouched
