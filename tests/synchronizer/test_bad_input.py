"""Bad input against a real synchronizer: each case gets its own status and code, and changes nothing."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import zstandard
from diloco_core import codec

from tests.synchronizer.helpers import (
    Learner,
    SyncProcess,
    auth_headers,
    encode_grad,
    initial_params,
    outer_grad,
    status,
    tiny_plan,
)

pytestmark = pytest.mark.integration
PLAN = tiny_plan()
MAX_BODY = 64 * 1024
MAX_JSON_BODY = 16 * 1024


@dataclass
class Env:
    sync: SyncProcess
    a: Learner
    b: Learner
    merged_seq: int


@pytest.fixture(scope="module")
def env(test_logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """Quorum 1 and max staleness 0: one contribution from `a` moved fragment 1 to version 1."""
    store = tmp_path_factory.mktemp("bad-input-store")
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "1", "--max-staleness", "0",
            "--max-body-bytes", str(MAX_BODY), "--max-json-body-bytes", str(MAX_JSON_BODY)]  # fmt: skip
    sync = SyncProcess(test_logs_dir / "sync", f"file://{store}", args)
    sync.start()
    a, b = Learner(sync.url, "a", PLAN), Learner(sync.url, "b", PLAN)
    try:
        assert a.register().status_code == 200
        assert b.register().status_code == 200
        for p in (0, 1):
            assert a.init(p, initial_params(PLAN, p)).status_code == 200
        r = a.contribute(1, 0, encode_grad(outer_grad(PLAN, 1, seed=5), 1, 0), seq=77)
        assert r.status_code == 202, r.text
        assert a.fetch(1, newer_than=0, wait=20) is not None
        yield Env(sync, a, b, merged_seq=77)
    finally:
        a.close()
        b.close()
        sync.stop()


def good_blob(p: int = 0, base: int = 0) -> bytes:
    return encode_grad(outer_grad(PLAN, p, seed=9), p, base)


def corrupt_header_blob() -> bytes:
    """A well-formed zstd frame whose header is not JSON."""
    header = b"{this is not json"
    inner = struct.pack("<I", len(header)) + header + b"\x00" * 64
    frame = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(inner)
    return codec.MAGIC + struct.pack("<HQ", codec.FORMAT_VERSION, len(frame)) + frame


def nan_blob() -> bytes:
    grad = outer_grad(PLAN, 0, seed=1)
    name = next(iter(grad))
    grad[name][0, 0] = np.nan
    return encode_grad(grad, 0, 0)


def wrong_shape_blob() -> bytes:
    grad = outer_grad(PLAN, 0, seed=1)
    name = next(iter(grad))
    grad[name] = np.zeros((3, 3), np.float32)
    return encode_grad(grad, 0, 0)


def post(env: Env, *, p: int = 0, base: int = 0, blob: bytes | Iterator[bytes] | None = None, headers: dict[str, str] | None = None,
         seq: int = 1, steps: int = 4) -> httpx.Response:  # fmt: skip
    params = {"base_version": base, "steps": steps, "tokens": 32, "seq": seq}
    return httpx.post(
        f"{env.sync.url}/v1/fragments/{p}/contributions",
        params=params,
        content=good_blob(p, base) if blob is None else blob,
        headers=auth_headers("b") if headers is None else headers,
        timeout=30,
    )


CASES: dict[str, tuple[Callable[[Env], httpx.Response], int, str]] = {
    "no_token": (lambda e: post(e, headers={"X-DiLoCo-Learner": "b"}), 401, "unauthenticated"),
    "bad_token": (
        lambda e: post(e, headers={"Authorization": "Bearer 00ff", "X-DiLoCo-Learner": "b"}),
        401,
        "unauthenticated",
    ),
    "other_learners_token": (lambda e: post(e, headers=auth_headers("b", token_of="a")), 403, "forbidden"),
    "heartbeat_for_another_learner": (
        lambda e: httpx.post(
            f"{e.sync.url}/v1/learners/a/heartbeat",
            headers=auth_headers("b"),
            json={"step": 1, "tokens": 1, "step_time_s": 0.1},
        ),  # fmt: skip
        403,
        "forbidden",
    ),
    "oversized_body": (lambda e: post(e, blob=b"\x01" * (MAX_BODY + 1)), 413, "oversized"),
    "oversized_chunked_body": (  # no Content-Length: refused while streaming, once past the limit
        lambda e: post(e, blob=iter([b"\x01" * 16384] * 8)),
        413,
        "oversized",
    ),
    "truncated_zstd": (lambda e: post(e, blob=good_blob()[:-17]), 400, "truncated"),
    "corrupt_header": (lambda e: post(e, blob=corrupt_header_blob()), 400, "corrupt"),
    "flipped_bytes": (
        lambda e: post(e, blob=good_blob()[:40] + bytes([good_blob()[40] ^ 0xFF]) + good_blob()[41:]),
        400,
        "corrupt",
    ),  # fmt: skip
    "wrong_shapes": (lambda e: post(e, blob=wrong_shape_blob()), 400, "wrong_shape"),
    "nan": (lambda e: post(e, blob=nan_blob()), 400, "non_finite"),
    "payload_for_another_fragment": (  # fragment 0's tensors, but the header names fragment 1
        lambda e: post(
            e,
            p=0,
            blob=codec.encode(
                outer_grad(PLAN, 0, 1), fragment=1, base_version=0, kind="outer_grad", quantizer="fp32"
            ),
        ),  # fmt: skip
        400,
        "wrong_shape",
    ),
    "params_instead_of_outer_grad": (
        lambda e: post(
            e,
            blob=codec.encode(
                outer_grad(PLAN, 0, 1), fragment=0, base_version=0, kind="params", quantizer="fp32"
            ),
        ),  # fmt: skip
        400,
        "bad_request",
    ),
    "stale_base_version": (lambda e: post(e, p=1, base=0, blob=good_blob(1, 0)), 409, "stale"),
    "base_version_from_the_future": (lambda e: post(e, p=0, base=5, blob=good_blob(0, 5)), 409, "stale"),
    "unknown_fragment": (lambda e: post(e, p=7, blob=good_blob(0)), 404, "unknown_fragment"),
    "zero_steps": (lambda e: post(e, steps=0), 400, "bad_request"),
    "empty_body": (lambda e: post(e, blob=b""), 400, "bad_request"),
}


def snapshot(env: Env) -> tuple[object, ...]:
    s = status(env.sync.url)
    params = [env.a.fetch(p) for p in (0, 1)]
    return (
        s["fragments"],
        s["rounds"],
        [(v, {k: a.tobytes() for k, a in t.items()}) for v, t in (x for x in params if x is not None)],
    )


@pytest.mark.parametrize("case", list(CASES))
def test_bad_contribution_is_refused_and_changes_nothing(env: Env, case: str) -> None:
    send, want_status, want_code = CASES[case]
    before = snapshot(env)
    r = send(env)
    assert r.status_code == want_status, r.text
    body = r.json()
    assert body["code"] == want_code
    assert body["reason"]
    if want_code == "stale":
        assert body["current_version"] is not None
    assert snapshot(env) == before


def test_duplicate_of_a_merged_contribution_answers_duplicate(env: Env) -> None:
    before = snapshot(env)
    blob = encode_grad(outer_grad(PLAN, 1, seed=5), 1, 0)
    r = env.a.contribute(1, 0, blob, seq=env.merged_seq)
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "duplicate"
    assert snapshot(env) == before


def padded_json(body: dict[str, object], size: int) -> bytes:
    """``body`` as JSON followed by whitespace up to ``size`` bytes: valid JSON, just big."""
    text = json.dumps(body).encode()
    return text + b" " * (size - len(text))


def in_chunks(data: bytes, chunk: int = 4096) -> Iterator[bytes]:
    """A body httpx sends chunked, without Content-Length."""
    return (data[i : i + chunk] for i in range(0, len(data), chunk))


def register_body(learner_id: str) -> dict[str, object]:
    return {"learner_id": learner_id, "plan": PLAN.to_dict(), "plan_hash": PLAN.hash(), "tokens_per_step": 8}


def heartbeat_body(step: int) -> dict[str, object]:
    return {"step": step, "tokens": step * 8, "step_time_s": 0.1}


def post_json(env: Env, path: str, learner_id: str, body: bytes | Iterator[bytes]) -> httpx.Response:
    headers = {**auth_headers(learner_id), "Content-Type": "application/json"}
    return httpx.post(f"{env.sync.url}{path}", content=body, headers=headers, timeout=30)


OVERSIZED = MAX_JSON_BODY + 1
JSON_CASES: dict[str, Callable[[Env], httpx.Response]] = {
    "register": lambda e: post_json(
        e, "/v1/learners/register", "c", padded_json(register_body("c"), OVERSIZED)
    ),
    "register_chunked": lambda e: post_json(
        e, "/v1/learners/register", "c", in_chunks(padded_json(register_body("c"), OVERSIZED))
    ),
    "heartbeat": lambda e: post_json(
        e, "/v1/learners/b/heartbeat", "b", padded_json(heartbeat_body(999), OVERSIZED)
    ),
    "heartbeat_chunked": lambda e: post_json(
        e, "/v1/learners/b/heartbeat", "b", in_chunks(padded_json(heartbeat_body(999), 4 * MAX_JSON_BODY))
    ),
}


def learners_state(env: Env) -> list[tuple[object, ...]]:
    learners = status(env.sync.url)["learners"]
    assert isinstance(learners, list)
    return sorted((lr["learner_id"], lr["state"], lr["step"], lr["tokens"]) for lr in learners)


@pytest.mark.parametrize("case", list(JSON_CASES))
def test_oversized_json_body_is_refused_and_changes_nothing(env: Env, case: str) -> None:
    """Register and heartbeat bodies past the JSON limit answer 413 ``oversized`` (the protocol's
    error body), with or without Content-Length; no learner is added or moved."""
    before, learners_before = snapshot(env), learners_state(env)
    r = JSON_CASES[case](env)
    assert r.status_code == 413, r.text
    body = r.json()
    assert body["code"] == "oversized"
    assert str(MAX_JSON_BODY) in body["reason"]
    assert body["retryable"] is False
    assert learners_state(env) == learners_before
    assert "c" not in [lr[0] for lr in learners_before]
    assert snapshot(env) == before


def test_json_body_within_the_limit_is_served_with_or_without_content_length(env: Env) -> None:
    """The same requests just under the limit go through, chunked ones included."""
    size = MAX_JSON_BODY - 10
    r = post_json(env, "/v1/learners/register", "d", in_chunks(padded_json(register_body("d"), size)))
    assert r.status_code == 200, r.text
    assert r.json()["plan_hash"] == PLAN.hash()
    r = post_json(env, "/v1/learners/d/heartbeat", "d", in_chunks(padded_json(heartbeat_body(41), size)))
    assert r.status_code == 200, r.text
    r = post_json(env, "/v1/learners/d/heartbeat", "d", padded_json(heartbeat_body(42), size))
    assert r.status_code == 200, r.text
    assert ("d", "training", 42, 42 * 8) in learners_state(env)
