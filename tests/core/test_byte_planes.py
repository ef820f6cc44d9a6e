"""fp32-planes: float32 values as byte planes, bit for bit, in a frame every zstd decoder reads."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import zstandard
from diloco_core import byte_planes, codec, plane_kernels
from diloco_core import quantize as q
from diloco_core.byte_planes import RUN, Planes
from diloco_core.codec import CodecError, QuantizedTensor, decode, encode
from diloco_core.config import DiLoCoSettings
from diloco_core.payload_errors import UnsupportedFormat
from diloco_core.stored_frame import ENTROPY, STORED, Level
from diloco_core.uploads import MemoryUpload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.loops import PATHS, take_path

GOLDEN = Path(__file__).parent / "golden" / "params_fp32-planes.bin"
SPECIAL_BITS = [
    0x7FC00000,
    0xFFC00001,
    0x7F800001,
    0x7F800000,
    0xFF800000,
    0x80000000,
    0x00000001,
    0x807FFFFF,
]


@pytest.fixture(autouse=True, params=PATHS)
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here runs on the numpy code and on the compiled loops, which must give the same bytes."""
    take_path(request, monkeypatch, plane_kernels.JOIN)


def bits(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).tobytes()


def with_specials(n: int, seed: int = 0) -> np.ndarray:
    """``n`` random normal values with NaN payloads, infinities, -0 and subnormals among them."""
    x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    m = min(n, len(SPECIAL_BITS))
    x.view(np.uint32)[:m] = SPECIAL_BITS[:m]
    return x


def test_the_layout_is_each_run_s_bytes_high_plane_first() -> None:
    x = np.array([1.0, -2.5, 3e-39], dtype=np.float32)  # the last one subnormal
    raw = x.astype("<f4").tobytes()
    want = bytes(raw[4 * i + b] for b in (3, 2, 1, 0) for i in range(3))
    assert Planes(x).tobytes() == want
    assert bits(byte_planes.decode(want, 3)) == bits(x)


def test_the_run_is_part_of_the_format() -> None:
    """A build with another run would read this build's payloads wrong without an error (the lengths
    and checksums would hold): the run is pinned, and so are the bytes of values over several runs."""
    assert RUN == 262_144
    i = np.arange(2 * 262_144 + 77, dtype=np.uint64)
    x = ((i * 2654435761) % (1 << 32)).astype(np.uint32).view(np.float32)  # every kind of bit pattern
    digest = hashlib.sha256(Planes(x).tobytes()).hexdigest()
    assert digest == "177e4184de95c1d5f9db394e37ebd4e91b500edb9c9813c9854434c132334e1a"


@pytest.mark.parametrize("n", [0, 1, 7, RUN - 1, RUN, RUN + 1, 2 * RUN + 5])
def test_values_come_back_bit_for_bit(n: int) -> None:
    x = with_specials(n)
    planes = Planes(x)
    assert planes.nbytes == 4 * n
    data = planes.tobytes()
    assert len(data) == 4 * n
    assert bits(byte_planes.decode(data, n)) == bits(x)
    assert bits(planes.values()) == bits(x)
    for start in range(0, n, RUN):  # run by run: the run's planes, high byte first
        m = min(RUN, n - start)
        run = np.frombuffer(data, np.uint8, 4 * m, 4 * start).reshape(4, m)
        np.testing.assert_array_equal(run[0], x[start : start + m].view(np.uint8)[3::4])
        np.testing.assert_array_equal(run[3], x[start : start + m].view(np.uint8)[0::4])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, (1 << 32) - 1), max_size=300))
def test_any_bit_patterns_come_back(patterns: list[int]) -> None:
    x = np.array(patterns, dtype=np.uint32).view(np.float32)
    assert bits(byte_planes.decode(Planes(x).tobytes(), x.size)) == bits(x)


def test_a_strided_or_wider_array_is_read_as_its_float32_values() -> None:
    base = np.arange(40, dtype=np.float64).reshape(5, 8) / 7
    view = base[:, ::2]
    assert bits(byte_planes.decode(Planes(view).tobytes(), view.size)) == bits(view.astype(np.float32))


@pytest.mark.parametrize("level", [ENTROPY, 1, 3, STORED])
@pytest.mark.parametrize("n", [0, 5, RUN + 3, 3 * RUN])
def test_payloads_round_trip_at_every_level(level: Level, n: int) -> None:
    tensors = {"a.weight": with_specials(n), "b.bias": with_specials(12, 1).reshape(3, 4)}
    blob = encode(tensors, fragment=3, base_version=9, kind="params", quantizer=q.PLANES, level=level)
    payload = decode(blob)
    assert (payload.fragment, payload.base_version, payload.kind, payload.quantizer) == (
        3,
        9,
        "params",
        q.PLANES,
    )
    for name, x in tensors.items():
        assert payload.tensors[name].dtype == np.float32
        assert payload.tensors[name].shape == x.shape
        assert bits(payload.tensors[name]) == bits(x)


def test_a_payload_written_as_it_is_compressed_is_the_same_blob() -> None:
    tensors = {"w": with_specials(2 * RUN + 9)}
    sink = MemoryUpload(lambda data: None)
    fields = {"fragment": 0, "base_version": 1, "kind": "params", "quantizer": q.PLANES, "level": ENTROPY}
    size = codec.encode_into(sink, tensors, **fields)  # type: ignore[arg-type]
    assert bytes(sink.data) == encode(tensors, **fields)  # type: ignore[arg-type]
    assert size == len(sink.data)


def test_the_frame_is_one_that_any_zstd_decoder_reads() -> None:
    """An ordinary zstd frame (the blocks ended at the planes' edges are ordinary blocks): the
    library's streaming reader fed a few bytes at a time, and the zstd program where there is one."""
    tensors = {"w": with_specials(RUN + 100)}
    blob = encode(tensors, fragment=0, base_version=0, kind="params", quantizer=q.PLANES, level=ENTROPY)
    frame = blob[14:]  # after the 14-byte prefix
    whole = zstandard.ZstdDecompressor().decompress(frame)
    fed = zstandard.ZstdDecompressor().decompressobj()
    assert b"".join(fed.decompress(frame[at : at + 5003]) for at in range(0, len(frame), 5003)) == whole
    tool = shutil.which("zstd")
    if tool is not None:
        out = subprocess.run([tool, "-d", "-c", "-q"], input=frame, capture_output=True, check=True).stdout
        assert out == whole


def test_the_high_plane_compresses_and_the_others_pass_as_they_are() -> None:
    """Of random normal float32 (a model's weights at initialisation), the planes at ENTROPY are
    smaller than the interleaved values at zstd level 1 and than 0.87 of the float32 bytes, and no
    larger than the three low planes as they are, the high plane at zstd level 1 and a block header
    per 128 KiB and per plane's end."""
    x = np.random.default_rng(5).standard_normal(8 * RUN, dtype=np.float32) * np.float32(0.02)
    planes = len(
        encode({"w": x}, fragment=0, base_version=0, kind="params", quantizer=q.PLANES, level=ENTROPY)
    )
    interleaved = len(encode({"w": x}, fragment=0, base_version=0, kind="params", quantizer="fp32", level=1))
    high = zstandard.ZstdCompressor(level=1).compress(np.ascontiguousarray(x.view(np.uint8)[3::4]).tobytes())
    assert planes < interleaved
    assert planes < 3 * x.size + len(high) + 8 * (3 * RUN // (1 << 17) + 2) * 3 + 1024
    assert planes < 0.87 * 4 * x.size


def test_planes_values_pass_only_as_fp32_planes() -> None:
    x = np.ones(10, dtype=np.float32)
    as_planes = {"w": QuantizedTensor((10,), Planes(x), b"")}
    as_bytes = {"w": QuantizedTensor((10,), x.tobytes(), b"")}
    with pytest.raises(CodecError, match="fp32 values given as Planes"):
        codec.encode_quantized(as_planes, fragment=0, base_version=0, kind="params", quantizer="fp32")
    with pytest.raises(CodecError, match="fp32-planes values given as bytes"):
        codec.encode_quantized(as_bytes, fragment=0, base_version=0, kind="params", quantizer=q.PLANES)
    blob = codec.encode_quantized(as_planes, fragment=0, base_version=0, kind="params", quantizer=q.PLANES)
    assert bits(decode(blob).tensors["w"]) == bits(x)
    assert bits(codec.dequantized(as_planes["w"], q.PLANES, q.DEFAULT_BLOCK_SIZE)) == bits(x)


def test_fp32_planes_is_a_wire_format_not_a_codec_a_job_chooses() -> None:
    assert q.PLANES in q.WIRE_FORMATS
    assert q.PLANES not in q.QUANTIZERS
    with pytest.raises(ValueError, match="codec"):
        DiLoCoSettings(codec=q.PLANES)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedFormat, match="unknown quantizer 'fp33'"):
        encode({"w": np.ones(3, np.float32)}, fragment=0, base_version=0, kind="params", quantizer="fp33")


def test_golden_blob_is_reproduced_byte_for_byte() -> None:
    """A whole version as the synchronizer serves it (``codec.encode_params``)."""
    i = np.arange(3 * 1000, dtype=np.float32)
    tensors = {
        "h.0.attn.weight": (np.sin(i * 0.37) * np.exp(-i / 1500) * 0.02).reshape(30, 100).astype(np.float32),
        "h.0.ln.bias": (np.cos(i[:17]) * 1e-3).astype(np.float32),
    }
    blob = encode(tensors, fragment=1, base_version=4, kind="params", quantizer=q.PLANES, level=ENTROPY)
    if os.environ.get("DILOCO_REGEN_GOLDEN") == "1":
        GOLDEN.write_bytes(blob)
    assert blob == GOLDEN.read_bytes(), f"the wire format changed; if on purpose, regenerate {GOLDEN}"
    payload = decode(GOLDEN.read_bytes())
    for name, x in tensors.items():
        assert bits(payload.tensors[name]) == bits(x)
