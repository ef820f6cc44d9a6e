"""The wire format: round trips, error bounds, golden blobs and every way untrusted bytes can be bad."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from diloco_core import codec, payload_frame, payload_header
from diloco_core import quantize as q
from diloco_core.codec import (
    CorruptPayload,
    OversizedPayload,
    ShapeMismatch,
    TruncatedPayload,
    UnsupportedFormat,
    decode,
    encode,
)
from diloco_core.fragments import build_plan
from diloco_core.stored_frame import ENTROPY, STORED, Level
from diloco_core.uploads import FileUpload, MemoryUpload, reading
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

GOLDEN = Path(__file__).parent / "golden"
QUANTIZERS = ["fp32", "bf16", "fp16", "int8", "int4", "e3m0", "int2", "int1", "topk"]


def golden_tensors() -> dict[str, np.ndarray]:
    """A fixed input whose bytes do not depend on any random generator."""
    i = np.arange(300, dtype=np.float32)
    return {
        "h.0.attn.weight": (np.sin(i * 0.37) * np.exp(-i / 150)).reshape(20, 15).astype(np.float32),
        "h.0.ln.bias": (np.cos(i[:17]) * 1e-3).astype(np.float32),
        "wte.weight": np.linspace(-2.0, 2.0, 40, dtype=np.float32).reshape(5, 8),
    }


GOLDEN_FIELDS: dict[str, Any] = {"fragment": 2, "base_version": 7, "kind": "outer_grad", "block_size": 32}


def _encode_golden(quantizer: str, level: Level | None = None) -> bytes:
    return encode(golden_tensors(), quantizer=quantizer, level=level, **GOLDEN_FIELDS)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_golden_blob_is_reproduced_byte_for_byte(quantizer: str) -> None:
    path = GOLDEN / f"outer_grad_{quantizer}.bin"
    blob = _encode_golden(quantizer)
    if os.environ.get("DILOCO_REGEN_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_bytes(blob)
    stored = path.read_bytes()
    assert blob == stored, (
        f"the encoder's bytes changed; if on purpose, regenerate {path} (DILOCO_REGEN_GOLDEN=1), and for a "
        "change of the format itself (not of the compression level) bump FORMAT_VERSION first"
    )
    payload = decode(stored)
    assert (payload.fragment, payload.base_version, payload.kind, payload.quantizer) == (
        2,
        7,
        "outer_grad",
        quantizer,
    )
    for name, x in golden_tensors().items():
        assert payload.tensors[name].dtype == np.float32
        assert payload.tensors[name].shape == x.shape
    if quantizer == "fp32":
        for name, x in golden_tensors().items():
            np.testing.assert_array_equal(payload.tensors[name], x)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_a_payload_at_any_level_reads_as_the_same_tensors(quantizer: str) -> None:
    """The level is the writer's choice, not the format's: a payload compressed at level 3 (what
    every format used before ``payload_level``), at -1 or stored reads as the default one does."""
    default = decode(_encode_golden(quantizer)).tensors
    for level in (3, -1, STORED):
        other = decode(_encode_golden(quantizer, level)).tensors
        for name, values in default.items():
            np.testing.assert_array_equal(other[name].view(np.uint32), values.view(np.uint32))


def test_each_format_is_written_at_its_own_level() -> None:
    """Level 1 for the quantized formats, 3 for ``topk`` (docs/benchmarks.md): the frame's bytes
    are those of zstd at that level."""
    assert payload_frame.payload_level("int2") == payload_frame.payload_level("int4") == 1
    assert payload_frame.payload_level("topk") == 3
    for quantizer in ("int4", "topk"):
        by_default = _encode_golden(quantizer)
        assert by_default == _encode_golden(quantizer, payload_frame.payload_level(quantizer))
        assert by_default != _encode_golden(quantizer, -1)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_a_payload_written_as_it_is_compressed_is_the_golden_blob(quantizer: str) -> None:
    sink = MemoryUpload(lambda data: None)
    size = codec.encode_into(sink, golden_tensors(), quantizer=quantizer, **GOLDEN_FIELDS)
    assert bytes(sink.data) == (GOLDEN / f"outer_grad_{quantizer}.bin").read_bytes()
    assert size == len(sink.data)


@pytest.mark.parametrize("level", [-1, STORED])
def test_a_large_payload_written_to_a_file_is_never_held_whole(tmp_path: Path, level: Level) -> None:
    """fp32 values barely compress: ``encode`` holds the payload twice at its end when it compresses
    it (its pieces, then their join) and once when it stores it (the pieces are views of the arrays,
    joined once); written into a file upload as it is compressed (or stored, as the outer state is),
    it holds a few pieces (4 MiB each) whatever its size."""
    import tracemalloc

    values = {f"t{i}": np.random.default_rng(i).standard_normal(1 << 20, dtype=np.float32) for i in range(8)}
    size = 4 * (8 << 20)
    tracemalloc.start()
    blob = codec.encode(values, fragment=0, base_version=1, kind="params", quantizer="fp32", level=level)
    encode_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    upload = FileUpload(tmp_path, lambda upload: None)
    tracemalloc.start()
    written = codec.encode_into(
        upload, values, fragment=0, base_version=1, kind="params", quantizer="fp32", level=level
    )
    into_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    with reading(upload) as view:
        assert bytes(view) == blob
    upload.discard()
    assert written == len(blob) > 0.9 * size
    assert encode_peak > (0.9 if level == STORED else 1.9) * size
    if level == STORED:  # its blocks are views of the arrays: the join is the only copy
        assert encode_peak < 1.5 * size
    assert into_peak < 3 * payload_frame._PIECE < 0.4 * size


def test_header_describes_tensors_and_scales() -> None:
    blob = _encode_golden("int4")
    inner = zstandard.ZstdDecompressor().decompress(blob[codec._PREFIX.size :])
    (hlen,) = struct.unpack_from("<I", inner)
    header = json.loads(inner[4 : 4 + hlen])
    assert header["quantizer"] == "int4"
    assert header["block_size"] == 32
    assert header["fragment"] == 2
    first = header["tensors"][0]
    assert first["name"] == "h.0.attn.weight"
    assert first["shape"] == [20, 15]
    assert first["dtype"] == "float32"
    assert first["values"] == [0, 150]  # 300 values, two per byte
    assert first["scales"] == [150, 4 * 10]  # ceil(300 / 32) float32 scales


def error_bound(x: np.ndarray, quantizer: str, block: int) -> np.ndarray:
    flat = x.astype(np.float32).ravel()
    pad = np.zeros(-(-flat.size // block) * block, dtype=np.float32)
    pad[: flat.size] = flat
    s = np.repeat(np.abs(pad.reshape(-1, block)).max(axis=1), block)[: flat.size]
    a = np.abs(flat)
    bounds = {
        "fp32": np.zeros_like(a),
        "bf16": a * 2.0**-8,
        "fp16": np.maximum(a * 2.0**-11, 2.0**-25),
        "int8": s / 254 * 1.0001,
        "int4": s / 14 * 1.0001,
        "e3m0": np.maximum((np.sqrt(2) - 1) * a, s * 2.0**-6.5) * 1.0001,
        "int2": s / 3 * 1.0001,
        "int1": (a + s) * 1.0001,  # |x - sign(x) * mean|x||: the residual error feedback carries
        "topk": np.maximum(a, s / 254 * 1.0001),  # dropped: the value itself; kept: as int8
    }
    return bounds[quantizer].reshape(x.shape) + 1e-30


finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)
arrays = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=20), elements=finite)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(QUANTIZERS), arrays, st.sampled_from([8, 16, 256]))
def test_round_trip_stays_within_the_quantizer_error_bound(quantizer: str, x: np.ndarray, block: int) -> None:
    blob = encode(
        {"t": x}, fragment=0, base_version=3, kind="outer_grad", quantizer=quantizer, block_size=block
    )
    y = decode(blob).tensors["t"]
    assert y.shape == x.shape
    assert y.dtype == np.float32
    assert np.all(np.abs(y - x) <= error_bound(x, quantizer, block))
    # quantization is idempotent on dequantized values for the exact and float formats
    if quantizer in ("fp32", "bf16", "fp16"):
        again = decode(encode({"t": y}, fragment=0, base_version=3, kind="outer_grad", quantizer=quantizer))
        np.testing.assert_array_equal(again.tensors["t"], y)


def test_e3m0_levels_are_powers_of_two_of_the_block_scale() -> None:
    x = np.array([8.0, -4.0, 1.0, 0.125, 0.0, -8.0 * 2**-6, 8.0 * 2**-7, 3.0], dtype=np.float32)
    y = decode(
        encode({"t": x}, fragment=0, base_version=0, kind="outer_grad", quantizer="e3m0", block_size=8)
    )
    # 3.0 is 2**1.58: nearer to 4 than to 2 in log2 space; 8 * 2**-7 is below the smallest level 8 * 2**-6
    np.testing.assert_array_equal(y.tensors["t"], [8.0, -4.0, 1.0, 0.125, 0.0, -0.125, 0.0, 4.0])


def test_bf16_rounds_to_nearest_even() -> None:
    # 1 + 2**-8 lies exactly between two bf16 values: ties go to the even one (1.0)
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, np.inf, -np.inf], dtype=np.float32)
    y = decode(encode({"t": x}, fragment=0, base_version=0, kind="params", quantizer="bf16")).tensors["t"]
    np.testing.assert_array_equal(y, [1.0, 1 + 4 * 2**-8, np.inf, -np.inf])
    nan = decode(
        encode(
            {"t": np.array([np.nan], np.float32)}, fragment=0, base_version=0, kind="params", quantizer="bf16"
        )
    )
    assert np.isnan(nan.tensors["t"][0])


def test_zeros_and_empty_tensors_survive_every_quantizer() -> None:
    for quantizer in QUANTIZERS:
        blob = encode(
            {"z": np.zeros((3, 9), np.float32), "e": np.zeros((0,), np.float32)},
            fragment=1,
            base_version=-1,
            kind="params",
            quantizer=quantizer,
            block_size=8,
        )
        out = decode(blob).tensors
        np.testing.assert_array_equal(out["z"], np.zeros((3, 9)))
        assert out["e"].shape == (0,)


@pytest.mark.parametrize("quantizer", ["fp32", "int8", "topk", q.PLANES])
@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), (2, 0, 7)])
def test_a_zero_size_tensor_round_trips_with_its_shape(quantizer: str, shape: tuple[int, ...]) -> None:
    blob = encode({"e": np.zeros(shape, np.float32)}, fragment=0, base_version=0, kind="params",
                  quantizer=quantizer, block_size=8)  # fmt: skip
    for read in (decode(blob).tensors["e"], codec.decode_quantized(blob).tensors["e"]):
        assert (read.dtype, read.shape) == (np.float32, shape)


def test_encoding_is_deterministic_and_independent_of_mapping_order() -> None:
    t = golden_tensors()
    reversed_t = dict(reversed(list(t.items())))
    a = encode(t, fragment=0, base_version=1, kind="outer_grad", quantizer="int8")
    b = encode(reversed_t, fragment=0, base_version=1, kind="outer_grad", quantizer="int8")
    assert a == b


# ---- untrusted bytes ---------------------------------------------------------------------------


@pytest.fixture
def blob() -> bytes:
    return _encode_golden("fp32")


def test_truncated_payloads_raise_truncated(blob: bytes) -> None:
    for cut in (0, 5, codec._PREFIX.size, len(blob) // 2, len(blob) - 1):
        with pytest.raises(TruncatedPayload) as info:
            decode(blob[:cut])
        assert info.value.code == "truncated"


def test_flipped_bytes_raise_corrupt(blob: bytes) -> None:
    for pos in (len(blob) // 2, len(blob) - 2):
        bad = bytearray(blob)
        bad[pos] ^= 0x5A
        with pytest.raises(CorruptPayload) as info:
            decode(bytes(bad))
        assert info.value.code == "corrupt"
    with pytest.raises(CorruptPayload, match="magic"):
        decode(b"XXXX" + blob[4:])
    with pytest.raises(CorruptPayload, match="unexpected bytes"):
        decode(blob + b"\0")


def _frame(inner: bytes, *, content_size: bool = True) -> bytes:
    frame = zstandard.ZstdCompressor(write_checksum=True, write_content_size=content_size).compress(inner)
    return struct.pack("<4sHQ", b"DLCF", 1, len(frame)) + frame


def test_bad_headers_inside_a_valid_frame_raise_corrupt_or_unsupported() -> None:
    def with_header(h: object, data: bytes = b"") -> bytes:
        raw = json.dumps(h).encode()
        return _frame(struct.pack("<I", len(raw)) + raw + data)

    good = {"fragment": 0, "base_version": 0, "kind": "params", "quantizer": "fp32", "block_size": 256}
    ok_tensor = {"name": "a", "shape": [2], "dtype": "float32", "values": [0, 8], "scales": [8, 0]}
    assert decode(with_header({**good, "tensors": [ok_tensor]}, b"\0" * 8)).tensors["a"].shape == (2,)
    with pytest.raises(CorruptPayload, match="more values than 8 bytes"):
        decode(with_header({**good, "tensors": [{**ok_tensor, "shape": [1000000]}]}, b"\0" * 8))
    with pytest.raises(CorruptPayload, match="does not match its shape"):
        decode(with_header({**good, "tensors": [{**ok_tensor, "shape": [3]}]}, b"\0" * 8))
    with pytest.raises(CorruptPayload, match="data has"):
        decode(with_header({**good, "tensors": [ok_tensor]}, b"\0" * 9))
    with pytest.raises(CorruptPayload, match="missing or unexpected"):
        decode(with_header({**good, "extra": 1, "tensors": []}))
    with pytest.raises(CorruptPayload, match="not valid JSON"):
        decode(_frame(struct.pack("<I", 3) + b"{{{"))
    with pytest.raises(CorruptPayload, match="header length"):
        decode(_frame(struct.pack("<I", 1 << 30)))
    with pytest.raises(UnsupportedFormat, match="quantizer"):
        decode(with_header({**good, "quantizer": "fp8", "tensors": []}))
    with pytest.raises(CorruptPayload, match="declare its size"):
        decode(_frame(b"\0" * 8, content_size=False))
    with pytest.raises(UnsupportedFormat, match="format version 9"):
        decode(struct.pack("<4sHQ", b"DLCF", 9, 0))


def _int8_header(shape: list[int]) -> bytes:
    """A payload whose one tensor ``a`` has ``shape`` and no bytes, as for an empty tensor."""
    entry = {"name": "a", "shape": shape, "dtype": "float32", "values": [0, 0], "scales": [0, 0]}
    h = {"fragment": 0, "base_version": 0, "kind": "outer_grad", "quantizer": "int8", "block_size": 256}
    raw = json.dumps({**h, "tensors": [entry]}).encode()
    return _frame(struct.pack("<I", len(raw)) + raw)


@pytest.mark.parametrize(
    "shape",
    [[0, 2**63], [0, 2**62], [2**40, 0, 2**40], [0, payload_header.MAX_NUMEL + 1], [2**31, 0, 2**31, 2**31]],
    ids=["2^63", "2^62", "2^40_0_2^40", "one_past_the_bound", "three_2^31"],
)
def test_an_empty_shape_beyond_any_array_is_refused_with_the_header(shape: list[int]) -> None:
    """Numpy makes no array of such a shape: the header check refuses it, naming the tensor."""
    with pytest.raises(CorruptPayload, match=r"tensor 'a': shape .* describes more than") as info:
        codec.decode_quantized(_int8_header(shape))
    assert info.value.code == "corrupt"
    with pytest.raises(CorruptPayload, match="describes more than"):
        decode(_int8_header(shape))


def test_an_empty_shape_at_the_bound_is_an_array() -> None:
    shape = [0, payload_header.MAX_NUMEL]
    assert decode(_int8_header(shape)).tensors["a"].shape == tuple(shape)


def test_encode_refuses_a_shape_no_receiver_takes() -> None:
    part = codec.QuantizedTensor((0, 2**62), b"", b"")
    with pytest.raises(UnsupportedFormat, match=r"tensor 'a': shape .* describes more than"):
        codec.encode_quantized({"a": part}, fragment=0, base_version=0, kind="outer_grad", quantizer="int8")


def test_a_frame_without_its_content_checksum_is_refused(blob: bytes) -> None:
    inner = zstandard.ZstdDecompressor().decompress(blob[codec._PREFIX.size :])
    frame = zstandard.ZstdCompressor(write_checksum=False, write_content_size=True).compress(inner)
    unchecked = codec._PREFIX.pack(codec.MAGIC, codec.FORMAT_VERSION, len(frame)) + frame
    with pytest.raises(CorruptPayload, match="no content checksum") as info:
        decode(unchecked)
    assert info.value.code == "corrupt"
    assert decode(_frame(inner)).tensors.keys() == golden_tensors().keys()  # the same content, checked


@pytest.mark.parametrize("level", [None, 1, -1, STORED, ENTROPY])
def test_every_payload_the_encoder_writes_carries_its_checksum(level: Level | None) -> None:
    tensors = golden_tensors()
    blobs = [_encode_golden(quantizer, level) for quantizer in QUANTIZERS]
    blobs.append(encode(tensors, fragment=0, base_version=3, kind="params", quantizer=q.PLANES, level=level))
    sink = MemoryUpload(lambda data: None)
    codec.encode_into(sink, tensors, fragment=0, base_version=3, kind="update", quantizer="int4", level=level)
    blobs.append(bytes(sink.data))
    if level is None:
        blobs.append(codec.encode_params(tensors, 0, 3))
    for b in blobs:
        assert zstandard.get_frame_parameters(b[codec._PREFIX.size :]).has_checksum
        assert decode(b).tensors.keys() == tensors.keys()


def test_declared_size_is_checked_before_decompressing() -> None:
    bomb = _frame(b"\0" * (8 << 20))  # 8 MiB of zeros compress to a few hundred bytes
    assert len(bomb) < 2000
    with pytest.raises(OversizedPayload, match="declared size") as info:
        decode(bomb, max_bytes=1 << 20)
    assert info.value.code == "oversized"
    plan = build_plan([("a", (4,))], num_fragments=1, inner_steps=2, overlap=0)
    with pytest.raises(OversizedPayload, match="declared size"):
        decode(_frame(b"\0" * (8 << 20)), fragment=plan.fragments[0])
    with pytest.raises(OversizedPayload, match="exceeds the limit"):
        decode(b"\0" * 100, max_bytes=99)


def test_names_and_shapes_must_match_the_expected_fragment() -> None:
    plan = build_plan([("a", (2, 3)), ("b", (4,))], num_fragments=1, inner_steps=2, overlap=0)
    frag = plan.fragments[0]
    good = {"a": np.ones((2, 3), np.float32), "b": np.ones(4, np.float32)}
    assert set(
        decode(
            encode(good, fragment=0, base_version=0, kind="params", quantizer="fp32"), fragment=frag
        ).tensors
    ) == {"a", "b"}
    cases = [
        ({"a": np.ones((3, 2), np.float32), "b": np.ones(4, np.float32)}, 0, "shape"),
        ({"a": np.ones((2, 3), np.float32)}, 0, "missing"),
        ({**good, "c": np.ones(1, np.float32)}, 0, "unexpected"),
        (good, 1, "fragment 1"),
    ]
    for tensors, index, match in cases:
        blob = encode(tensors, fragment=index, base_version=0, kind="params", quantizer="fp32")
        with pytest.raises(ShapeMismatch, match=match) as info:
            decode(blob, fragment=frag)
        assert info.value.code == "wrong_shape"


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=5, unique=True),
    st.sampled_from(QUANTIZERS),
    st.integers(0, 40),
)
def test_any_real_payload_fits_its_fragment_bounds(names: list[str], quantizer: str, n: int) -> None:
    plan = build_plan([(name, (n, 1)) for name in names], num_fragments=1, inner_steps=2, overlap=0)
    frag = plan.fragments[0]
    tensors = {name: np.full((n, 1), 1e30, np.float32) for name in names}
    blob = encode(tensors, fragment=0, base_version=2**40, kind="params", quantizer=quantizer, block_size=8)
    inner = zstandard.ZstdDecompressor().decompress(blob[codec._PREFIX.size :])
    assert struct.unpack_from("<I", inner)[0] <= payload_header.max_header_size(frag)
    assert len(inner) <= codec.max_decoded_size(frag)
    assert set(decode(blob, fragment=frag).tensors) == set(names)


def test_a_header_larger_than_the_fragment_allows_is_refused() -> None:
    plan = build_plan([("a", (1000,))], num_fragments=1, inner_steps=2, overlap=0)
    padding = " " * 2000  # JSON allows whitespace: a valid header, but far larger than needed
    raw = json.dumps(
        {
            "fragment": 0,
            "base_version": 0,
            "kind": "params",
            "quantizer": "fp32",
            "block_size": 256,
            "tensors": [],
        }
    ).encode()
    blob = _frame(struct.pack("<I", len(raw) + len(padding)) + raw + padding.encode())
    assert decode(blob).tensors == {}
    with pytest.raises(CorruptPayload, match="header length"):
        decode(blob, fragment=plan.fragments[0])


def test_encode_refuses_what_it_cannot_represent() -> None:
    with pytest.raises(UnsupportedFormat, match="quantizer"):
        encode({"a": np.ones(2, np.float32)}, fragment=0, base_version=0, kind="params", quantizer="int3")
    with pytest.raises(UnsupportedFormat, match="dtype"):
        encode({"a": np.ones(2, np.int64)}, fragment=0, base_version=0, kind="params", quantizer="fp32")
    with pytest.raises(UnsupportedFormat, match="block_size"):
        encode(
            {"a": np.ones(2, np.float32)},
            fragment=0,
            base_version=0,
            kind="params",
            quantizer="int8",
            block_size=4,
        )
    # what no receiver takes is refused when encoding, not found when decoding
    deepest = np.ones((1,) * 32, np.float32)
    blob = encode({"a": deepest}, fragment=0, base_version=0, kind="params", quantizer="fp32")
    assert decode(blob).tensors["a"].shape == deepest.shape
    with pytest.raises(UnsupportedFormat, match="33 dimensions"):
        encode({"a": deepest[None]}, fragment=0, base_version=0, kind="params", quantizer="fp32")
    with pytest.raises(UnsupportedFormat, match="not a string"):
        encode({7: np.ones(2, np.float32)}, fragment=0, base_version=0, kind="params", quantizer="fp32")  # type: ignore[dict-item]


def test_nan_passes_the_codec_and_is_left_to_the_merge() -> None:
    x = np.array([1.0, np.nan, 2.0], np.float32)
    for quantizer in QUANTIZERS:
        out = decode(
            encode({"a": x}, fragment=0, base_version=0, kind="outer_grad", quantizer=quantizer, block_size=8)
        )
        assert not np.isfinite(out.tensors["a"]).all(), quantizer


def _with_raw_header(raw: bytes, data: bytes = b"") -> bytes:
    return _frame(struct.pack("<I", len(raw)) + raw + data)


_GOOD_HEADER = (
    '{{"base_version":0,"block_size":256,"fragment":0,"kind":"params","quantizer":"fp32","tensors":{}}}'
)


def _entry(shape: str, values: str = "[0,8]") -> str:
    return f'[{{"dtype":"float32","name":"a","scales":[8,0],"shape":{shape},"values":{values}}}]'


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (_GOOD_HEADER.format("[" * 5000 + "]" * 5000), "nests deeper"),
        (_GOOD_HEADER.format("[" * 100_000), "nests deeper"),
        (_GOOD_HEADER.format(_entry("[[[[2]]]]")), "nests deeper"),
        (_GOOD_HEADER.format(_entry("[" + "9" * 5000 + "]")), "integer of 5000 digits"),
        (_GOOD_HEADER.format(_entry("[123456789012345678901]")), "integer of 21 digits"),
        (_GOOD_HEADER.format(_entry("[" + ",".join(["100000000000000000000"] * 16) + "]")), "integer of 21"),
        (
            _GOOD_HEADER.format(_entry("[" + ",".join(["10000000000000000000"] * 16) + "]")),
            "more values than",
        ),
        (_GOOD_HEADER.format(_entry("[1000000000,1000000000,0]")), "does not match its shape"),
        (_GOOD_HEADER.format(_entry("[" + ",".join(["1"] * 33) + "]")), "33 dimensions"),
        (_GOOD_HEADER.format(_entry("[2.0]")), "integers only"),
        (_GOOD_HEADER.format(_entry("[NaN]")), "integers only"),
        (_GOOD_HEADER.format(_entry("[-Infinity]")), "integers only"),
        (_GOOD_HEADER.format(_entry("[1e400]")), "integers only"),
    ],
    ids=[
        "deep",
        "unclosed",
        "deep_shape",
        "5000_digits",
        "21_digits",
        "huge_product_digits",
        "huge_product",
        "product_with_zero",
        "33_dims",
        "float",
        "nan",
        "infinity",
        "float_overflow",
    ],  # fmt: skip
)
def test_crafted_headers_are_bounded_before_they_are_used(raw: str, match: str) -> None:
    """Each of these raised RecursionError, ValueError or OverflowError once (a 500 in the service)."""
    with pytest.raises(CorruptPayload, match=match) as info:
        decode(_with_raw_header(raw.encode(), b"\0" * 8))
    assert info.value.code == "corrupt"


def test_brackets_and_escapes_inside_names_do_not_count_as_nesting() -> None:
    name = 'a[[[[{{{{\\"]]]\\\\'
    tensors = {name: np.ones(3, np.float32)}
    blob = encode(tensors, fragment=0, base_version=0, kind="params", quantizer="fp32")
    assert list(decode(blob).tensors) == [name]


@pytest.mark.parametrize(
    "extra",
    [
        zstandard.ZstdCompressor().compress(b"x" * 4000),
        zstandard.ZstdCompressor().compress(b""),
        b"\0" * 4000,
        b"\x01",
    ],
    ids=["second_frame", "empty_frame", "zeros", "one_byte"],
)
def test_the_declared_length_holds_one_zstd_frame_and_nothing_else(blob: bytes, extra: bytes) -> None:
    frame = blob[codec._PREFIX.size :] + extra
    bad = struct.pack("<4sHQ", b"DLCF", 1, len(frame)) + frame
    with pytest.raises(CorruptPayload, match="one zstd frame") as info:
        decode(bad)
    assert info.value.code == "corrupt"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_header_fields = st.fixed_dictionaries(
    {
        "fragment": st.integers(-2, 2**65) | _json_values,
        "base_version": st.integers(-2, 2**65) | _json_values,
        "kind": st.sampled_from(["params", "outer_grad"]) | _json_values,
        "quantizer": st.sampled_from(QUANTIZERS) | _json_values,
        "block_size": st.sampled_from([8, 256, 2**21]) | _json_values,
        "tensors": st.lists(
            st.fixed_dictionaries(
                {
                    "name": st.text(max_size=6) | _json_values,
                    "shape": st.lists(st.integers(0, 2**64), max_size=5) | _json_values,
                    "dtype": st.sampled_from(["float32", "bfloat16"]) | _json_values,
                    "values": st.lists(st.integers(-1, 2**64), max_size=3) | _json_values,
                    "scales": st.lists(st.integers(-1, 2**64), max_size=3) | _json_values,
                }
            ),
            max_size=3,
        )
        | _json_values,
    }
)


@settings(max_examples=300, deadline=None)
@given(_header_fields, st.binary(max_size=64))
def test_any_header_decodes_or_raises_a_codec_error(header: dict[str, object], data: bytes) -> None:
    """Whatever header a learner crafts (within the frame bounds): a payload or the codec's error."""
    raw = json.dumps(header).encode()
    outcome: codec.Payload | codec.CodecError
    try:
        outcome = decode(_with_raw_header(raw, data))
    except codec.CodecError as exc:
        outcome = exc
    if isinstance(outcome, codec.CodecError):
        assert outcome.code in {"corrupt", "truncated", "oversized", "unsupported", "wrong_shape"}
        assert str(outcome)
    else:
        assert all(t.dtype == np.float32 for t in outcome.tensors.values())


def test_pre_quantized_tensors_encode_to_the_same_payload_and_wrong_sizes_are_refused() -> None:
    arrays = golden_tensors()
    parts = {n: codec.QuantizedTensor(a.shape, *q.quantize(a, "int4", 32)) for n, a in arrays.items()}
    args = {"fragment": 2, "base_version": 7, "kind": "outer_grad", "quantizer": "int4", "block_size": 32}
    assert codec.encode_quantized(parts, **args) == encode(arrays, **args)  # type: ignore[arg-type]
    short = dict(
        parts, **{"wte.weight": codec.QuantizedTensor((5, 8), b"\x00" * 19, parts["wte.weight"].scales)}
    )
    with pytest.raises(codec.CodecError, match="'wte.weight': 19 value and 8 scale bytes"):
        codec.encode_quantized(short, **args)  # type: ignore[arg-type]


def test_a_topk_payload_with_a_bad_index_is_corrupt() -> None:
    x = {"t": np.arange(1, 41, dtype=np.float32)}
    blob = encode(x, fragment=0, base_version=0, kind="outer_grad", quantizer="topk", block_size=16)
    inner = bytearray(zstandard.ZstdDecompressor().decompress(blob[codec._PREFIX.size :]))
    (hlen,) = struct.unpack_from("<I", inner)
    struct.pack_into("<H", inner, 4 + hlen, 16)  # the first index, one past its block
    frame = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(bytes(inner))
    bad = codec._PREFIX.pack(codec.MAGIC, codec.FORMAT_VERSION, len(frame)) + frame
    with pytest.raises(CorruptPayload, match="topk index"):
        decode(bad)
    kept = codec.decode_quantized(bad)  # the layout is sound: the index is found when the tensor is read
    with pytest.raises(CorruptPayload, match="topk index"):
        kept.tensors["t"]


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_a_payload_kept_quantized_reads_as_the_decoded_one(quantizer: str) -> None:
    rng = np.random.default_rng(3)
    x = {"a": rng.standard_normal((33, 7)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    blob = encode(x, fragment=2, base_version=9, kind="outer_grad", quantizer=quantizer, block_size=16)
    whole, kept = decode(blob), codec.decode_quantized(blob)
    assert (kept.fragment, kept.base_version, kept.kind, kept.quantizer) == (2, 9, "outer_grad", quantizer)
    assert sorted(kept.tensors) == sorted(whole.tensors)
    assert len(kept.tensors) == 2
    for name, value in whole.tensors.items():
        again = kept.tensors[name]
        assert (again.dtype, again.shape) == (np.float32, value.shape)
        np.testing.assert_array_equal(again.view(np.uint32), value.view(np.uint32))  # bit for bit


def test_topk_refuses_a_block_size_its_indices_cannot_address() -> None:
    with pytest.raises(UnsupportedFormat, match="topk"):
        encode({"t": np.zeros(4, np.float32)}, fragment=0, base_version=0, kind="outer_grad", quantizer="topk",
               block_size=q.TOPK_MAX_BLOCK * 2)  # fmt: skip


def test_with_its_fragment_given_a_payload_is_bounded_by_the_fragment_not_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = build_plan([("w", [100, 100])], 1, 4, 1)  # 40,000 bytes in fp32
    blob = encode(
        {"w": np.ones((100, 100), np.float32)}, fragment=0, base_version=0, kind="params", quantizer="fp32"
    )
    monkeypatch.setattr(codec, "DEFAULT_MAX_BYTES", 1024)
    with pytest.raises(OversizedPayload):
        decode(blob)  # no fragment: the default bound
    assert decode(blob, fragment=plan.fragments[0]).tensors["w"].shape == (100, 100)
    with pytest.raises(OversizedPayload):
        decode(blob, fragment=plan.fragments[0], max_bytes=1024)  # a bound given is kept


def test_parameters_written_as_they_are_encoded_are_the_bytes_served() -> None:
    """A version the commit encodes into its object is byte for byte the one a round encodes whole."""
    params = {
        f"t{i}": np.random.default_rng(i).standard_normal((300, 7 + i), dtype=np.float32) for i in range(3)
    }
    sink = MemoryUpload(lambda data: None)
    size = codec.encode_params_into(sink, params, 2, 9)
    assert bytes(sink.data) == codec.encode_params(params, 2, 9)
    assert size == len(sink.data)
