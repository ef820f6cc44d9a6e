"""A folded contribution's outer gradient: its parts added when a tensor is read, as they would
have been added at once."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core import codec
from diloco_core.code_kernels import ADD, ADD_SCALED, WRITE, decoder
from diloco_sync.contribution import Contribution, Sum, fold

from tests.core.loops import PATHS, take_path


def _part(seq: int, since: int, values: dict[str, np.ndarray]) -> Contribution:
    blob = codec.encode(values, fragment=0, base_version=0, kind="outer_grad", quantizer="int4", block_size=8)
    tensors = codec.decode_quantized(blob).tensors
    return Contribution(
        learner_id="a", fragment=0, base_version=0, seq=seq, steps=4, tokens=32, tensors=tensors,
        nbytes=len(blob), received_at=1.0 + seq, since=since,
    )  # fmt: skip


def test_three_folded_parts_read_as_their_sum_in_the_order_received() -> None:
    rng = np.random.default_rng(0)
    parts = [
        _part(seq, 4 * seq, {"w": rng.standard_normal((6, 5)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)})
        for seq in range(3)
    ]  # fmt: skip
    folded = fold(fold(parts[0], parts[1]), parts[2])
    assert isinstance(folded.tensors, Sum)
    assert sorted(folded.tensors) == ["b", "w"]
    assert len(folded.tensors) == 2
    for name in ("w", "b"):
        eager = (parts[0].tensors[name] + parts[1].tensors[name]) + parts[2].tensors[name]
        np.testing.assert_array_equal(folded.tensors[name].view(np.uint32), eager.view(np.uint32))
    assert [c.seq for c in folded.received()] == [0, 1, 2]
    filled = fold(parts[0], fold(parts[1], parts[2]))  # a part that fills the gap before a folded one
    for name in ("w", "b"):
        eager = parts[0].tensors[name] + (parts[1].tensors[name] + parts[2].tensors[name])
        np.testing.assert_array_equal(filled.tensors[name].view(np.uint32), eager.view(np.uint32))
    assert "w" in folded.tensors
    assert "x" not in folded.tensors
    assert (folded.since, folded.through, folded.steps, folded.tokens) == (0, 12, 12, 96)


def test_a_chain_of_thousands_of_continuations_reads_without_recursion() -> None:
    first = Contribution(
        learner_id="a", fragment=0, base_version=0, seq=0, steps=1, tokens=8,
        tensors={"w": np.ones(3, np.float32)}, nbytes=0, received_at=0.0,
    )  # fmt: skip
    chain = first
    for seq in range(1, 5000):
        part = Contribution(
            learner_id="a", fragment=0, base_version=0, seq=seq, steps=1, tokens=8,
            tensors={"w": np.full(3, 0.5, np.float32)}, nbytes=0, received_at=float(seq), since=seq,
        )  # fmt: skip
        chain = fold(chain, part)
    np.testing.assert_array_equal(chain.tensors["w"], np.full(3, 1 + 0.5 * 4999, np.float32))
    np.testing.assert_array_equal(first.tensors["w"], np.ones(3, np.float32))  # its parts are not changed
    assert chain.steps == 5000


def _mixed_part(seq: int, values: dict[str, np.ndarray], quantizer: str) -> Contribution:
    blob = codec.encode(
        values, fragment=0, base_version=0, kind="outer_grad", quantizer=quantizer, block_size=8
    )
    return Contribution(
        learner_id="a", fragment=0, base_version=0, seq=seq, steps=4, tokens=32,
        tensors=codec.decode_quantized(blob).tensors, nbytes=len(blob), received_at=1.0 + seq, since=4 * seq,
    )  # fmt: skip


def test_parts_of_every_format_and_odd_lengths_fold_to_the_sums_of_their_arrays() -> None:
    """Parts kept as codes are added into the sum so far in place, the others read as arrays: the
    same float32 sums either way, a last byte holding fewer values than it has room for included,
    and a non-finite value carried through as the arrays' addition carries it."""
    rng = np.random.default_rng(3)

    def values() -> dict[str, np.ndarray]:
        return {
            "w": rng.standard_normal((7, 3)).astype(np.float32),
            "b": rng.standard_normal(13).astype(np.float32),
        }

    held = {
        "w": rng.standard_normal((7, 3)).astype(np.float32),
        "b": rng.standard_normal(13).astype(np.float32),
    }
    held["b"][4] = np.inf
    kept = {name: a.copy() for name, a in held.items()}
    first = Contribution(
        learner_id="a", fragment=0, base_version=0, seq=0, steps=4, tokens=32, tensors=held, nbytes=0,
        received_at=1.0,
    )  # fmt: skip
    parts = [first] + [
        _mixed_part(seq, values(), q) for seq, q in enumerate(("int4", "fp16", "int2", "int8", "topk"), 1)
    ]
    chain = parts[0]
    for part in parts[1:]:
        chain = fold(chain, part)
    for name in ("w", "b"):
        eager = parts[0].tensors[name]
        for part in parts[1:]:
            eager = eager + part.tensors[name]
        np.testing.assert_array_equal(chain.tensors[name].view(np.uint32), eager.view(np.uint32))
        np.testing.assert_array_equal(held[name], kept[name])  # an array a part holds is not changed
    assert np.isinf(chain.tensors["b"][4])


@pytest.fixture(params=PATHS)
def int4_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy code, or the int4 decoding loops compiled before the test: a loop compiled in the
    background while memory is traced would count the compiler's own allocations."""
    take_path(request, monkeypatch, *(decoder("int4", 4, mode) for mode in (WRITE, ADD, ADD_SCALED)))


@pytest.mark.usefixtures("int4_path")
def test_a_tensor_of_many_folded_int4_parts_is_read_into_one_float32_array() -> None:
    """Each part after the first is added from its codes through a small scratch: reading the sum
    of eight parts of a million values makes one array of the tensor's size, not one per part."""
    import tracemalloc

    rng = np.random.default_rng(4)
    n = 1 << 20
    parts = [_mixed_part(seq, {"w": rng.standard_normal(n).astype(np.float32)}, "int4") for seq in range(8)]
    chain = parts[0]
    for part in parts[1:]:
        chain = fold(chain, part)
    tracemalloc.start()
    try:
        total = chain.tensors["w"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total.nbytes == 4 * n
    assert peak < 1.5 * 4 * n, peak
    eager = parts[0].tensors["w"]
    for part in parts[1:]:
        eager = eager + part.tensors["w"]
    np.testing.assert_array_equal(total.view(np.uint32), eager.view(np.uint32))
