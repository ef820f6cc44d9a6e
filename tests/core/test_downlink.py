"""Compressed global versions: the learner's copy is the synchronizer's version bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core import codec, downlink, update_kernel
from diloco_core.fragments import build_plan

from tests.core.loops import PATHS, take_path

PLAN = build_plan([("w", (16, 24)), ("b", (7,))], num_fragments=1, inner_steps=4, overlap=0)


@pytest.fixture(autouse=True, params=PATHS)
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here runs on the numpy code and on the compiled int2 update, which must give the
    same bytes and bits."""
    take_path(request, monkeypatch, update_kernel.INT2_UPDATE)


def _params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((16, 24)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float32),
    }


@pytest.mark.parametrize("quantizer", ["int8", "int4", "int2", "int1", "topk"])
def test_a_chain_of_updates_reproduces_every_version_exactly(quantizer: str) -> None:
    frag = PLAN.fragments[0]
    server, learner, residual = _params(0), _params(0), None
    version = 0
    for step in range(1, 30):
        merged = {n: v + 0.01 * _params(step)[n] for n, v in server.items()}  # what the outer step made
        out = downlink.publish(server, merged, residual, fragment=0, version=version, quantizer=quantizer)
        made = downlink.apply(version, learner, out.blob, frag)
        assert made is not None
        version, learner = made
        assert version == out.version == step
        for n in server:
            np.testing.assert_array_equal(learner[n], out.params[n])
            # nothing is lost: what is not yet published is carried in the residual
            carried = 0.0 if residual is None else residual[n]
            np.testing.assert_allclose(out.params[n] + out.residual[n], merged[n] + carried, atol=1e-5)
        server, residual = out.params, out.residual


def test_an_update_for_another_version_asks_for_the_whole_version() -> None:
    frag = PLAN.fragments[0]
    out = downlink.publish(_params(0), _params(1), None, fragment=0, version=5, quantizer="int2")
    assert downlink.apply(4, _params(0), out.blob, frag) is None
    assert downlink.apply(5, _params(0), out.blob, frag) is not None


def test_a_whole_version_is_not_taken_for_an_update() -> None:
    blob = codec.encode(_params(0), fragment=0, base_version=1, kind="params", quantizer="fp32")
    with pytest.raises(codec.UnsupportedFormat, match="update"):
        downlink.apply(1, _params(0), blob, PLAN.fragments[0])


def test_an_update_is_smaller_than_the_whole_version() -> None:
    out = downlink.publish(_params(0), _params(1), None, fragment=0, version=0, quantizer="int2")
    whole = codec.encode(out.params, fragment=0, base_version=1, kind="params", quantizer="fp32")
    assert len(out.blob) * 4 < len(whole)


def test_a_damaged_or_foreign_update_is_refused_before_anything_is_applied() -> None:
    """The decode is the codec's bounded one: a truncated, oversized or other-shaped update raises."""
    frag = PLAN.fragments[0]
    out = downlink.publish(_params(0), _params(1), None, fragment=0, version=2, quantizer="int4")
    with pytest.raises(codec.CodecError):
        downlink.apply(2, _params(0), out.blob[:-7], frag)
    other = build_plan([("w", (16, 25)), ("b", (7,))], num_fragments=1, inner_steps=4, overlap=0)
    with pytest.raises(codec.ShapeMismatch):
        downlink.apply(2, _params(0), out.blob, other.fragments[0])
    with pytest.raises(codec.OversizedPayload):
        codec.decode(out.blob, fragment=frag, max_bytes=len(out.blob) - 1)


@pytest.mark.parametrize("quantizer", ["int4", "int2", "bf16"])
def test_a_version_is_the_previous_plus_the_decoded_update_and_the_rest_is_carried_bit_for_bit(
    quantizer: str,
) -> None:
    """What publish computes in place is, bit for bit, the rule written out one array per step."""
    previous, residual = _params(0), {n: 0.001 * v for n, v in _params(5).items()}
    merged = {n: v + 0.01 * _params(1)[n] for n, v in previous.items()}
    out = downlink.publish(previous, merged, residual, fragment=0, version=3, quantizer=quantizer)
    u = {n: (merged[n] - previous[n]) + residual[n] for n in previous}
    blob = codec.encode(u, fragment=0, base_version=3, kind="update", quantizer=quantizer)
    decoded = codec.decode(blob).tensors
    assert out.blob == blob
    for n in previous:
        np.testing.assert_array_equal(
            out.params[n].view(np.uint32), (previous[n] + decoded[n]).view(np.uint32)
        )
        np.testing.assert_array_equal(out.residual[n].view(np.uint32), (u[n] - decoded[n]).view(np.uint32))
    np.testing.assert_array_equal(previous["w"], _params(0)["w"])  # the inputs are left as they were
    np.testing.assert_array_equal(merged["b"], (_params(0)["b"] + 0.01 * _params(1)["b"]))


@pytest.mark.parametrize("quantizer", ["int4", "int2"])
def test_a_merged_version_given_up_holds_the_residual_and_nothing_else_changes(quantizer: str) -> None:
    """``owned``: the merged arrays are reused for the difference and become the new residual; the
    bytes, the new version and the residual are those of the copying path, bit for bit."""
    previous, residual = _params(0), {n: 0.001 * v for n, v in _params(5).items()}
    merged = {n: v + 0.01 * _params(1)[n] for n, v in previous.items()}
    copied = downlink.publish(previous, merged, residual, fragment=0, version=3, quantizer=quantizer)
    given = {n: v.copy() for n, v in merged.items()}
    out = downlink.publish(previous, given, residual, fragment=0, version=3, quantizer=quantizer, owned=True)
    assert out.blob == copied.blob
    for n in previous:
        np.testing.assert_array_equal(out.params[n].view(np.uint32), copied.params[n].view(np.uint32))
        np.testing.assert_array_equal(out.residual[n].view(np.uint32), copied.residual[n].view(np.uint32))
        assert out.residual[n] is given[n]  # no array of its size made for the difference
    np.testing.assert_array_equal(previous["w"], _params(0)["w"])


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1"])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("block", [64, 9])
def test_an_update_made_a_chunk_at_a_time_is_the_rule_on_whole_arrays_bit_for_bit(
    quantizer: str, with_residual: bool, block: int
) -> None:
    """Tensors of several of the quantizer's chunks (a megabyte of float32 at a time) and ragged ends,
    with exact zeros (their int2 code depends on their position in the tensor), a NaN and an
    infinity, against the rule written out one whole array per step."""
    step = 1 << 18
    rng = np.random.default_rng(7)
    sizes = {"a": (3, step - 5), "b": (2 * step + 13,), "c": (1,), "d": (0,), "e": (step,)}
    previous = {n: rng.standard_normal(s).astype(np.float32) for n, s in sizes.items()}
    merged = {
        n: v + np.float32(0.01) * rng.standard_normal(v.shape).astype(np.float32) for n, v in previous.items()
    }
    merged["a"][1, 100:300] = previous["a"][1, 100:300]  # a difference of exact zeros across blocks
    merged["e"][: 4 * block] = previous["e"][: 4 * block]  # blocks of zeros (with a residual, not)
    merged["b"][step + 3] = np.nan
    merged["b"][5] = np.inf
    residual = (
        {n: np.float32(1e-3) * rng.standard_normal(v.shape).astype(np.float32) for n, v in previous.items()}
        if with_residual
        else None
    )
    out = downlink.publish(
        previous, merged, residual, fragment=0, version=3, quantizer=quantizer, block_size=block
    )
    u = {n: (merged[n] - previous[n]) + (0 if residual is None else residual[n]) for n in previous}
    with np.errstate(invalid="ignore"):
        blob = codec.encode(
            u, fragment=0, base_version=3, kind="update", quantizer=quantizer, block_size=block
        )
        decoded = codec.decode(blob).tensors
        assert out.blob == blob
        for n in previous:
            np.testing.assert_array_equal(
                out.params[n].view(np.uint32), (previous[n] + decoded[n]).view(np.uint32)
            )
            np.testing.assert_array_equal(
                out.residual[n].view(np.uint32), (u[n] - decoded[n]).view(np.uint32)
            )


def test_an_update_of_tensors_that_do_not_match_is_refused() -> None:
    previous = _params(0)
    with pytest.raises(ValueError, match="different tensors"):
        downlink.publish(previous, {"w": previous["w"]}, None, fragment=0, version=0, quantizer="int2")
    with pytest.raises(ValueError, match="tensor 'b'"):
        downlink.publish(
            previous,
            {**previous, "b": np.zeros(8, np.float32)},
            None,
            fragment=0,
            version=0,
            quantizer="int2",
        )
    with pytest.raises(ValueError, match="residual"):
        downlink.publish(previous, previous, {"w": previous["w"]}, fragment=0, version=0, quantizer="int4")


@pytest.mark.parametrize("quantizer", ["int8", "int2"])
def test_a_scalar_tensor_keeps_its_shape_through_an_update(quantizer: str) -> None:
    plan = build_plan([("s", ()), ("w", (33,))], num_fragments=1, inner_steps=4, overlap=0)
    previous = {"s": np.array(1.5, np.float32), "w": np.linspace(-1, 1, 33, dtype=np.float32)}
    merged = {n: v + np.float32(0.25) for n, v in previous.items()}
    out = downlink.publish(previous, merged, None, fragment=0, version=3, quantizer=quantizer)
    assert out.params["s"].shape == out.residual["s"].shape == ()
    made = downlink.apply(3, previous, out.blob, plan.fragments[0])
    assert made is not None
    assert made[1]["s"].shape == ()
    for n in previous:
        np.testing.assert_array_equal(made[1][n], out.params[n])
