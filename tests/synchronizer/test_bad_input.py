"""Bad input against a real synchronizer: each case gets its own status and code, and changes nothing."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zstandard
from diloco_core import codec
from diloco_core.auth import learner_token
from diloco_core.protocol import API_PREFIX
from diloco_core.request_proof import instance_at
from diloco_core.uploads import UPLOAD_PREFIX
from diloco_sync.logs import LOG_BURST
from diloco_testbed.s3_server import S3Server
from diloco_testbed.waiting import wait_for

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import (
    SECRET,
    Learner,
    SyncProcess,
    encode_grad,
    initial_params,
    learner_auth,
    outer_grad,
    signed_head_lines,
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
    store: Path


@pytest.fixture(scope="module")
def env(test_logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """Quorum 1 and max staleness 0: one contribution from `a` moved fragment 1 to version 1."""
    store = tmp_path_factory.mktemp("bad-input-store")
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "1", "--max-staleness", "0",
            "--max-body-bytes", str(MAX_BODY), "--max-json-body-bytes", str(MAX_JSON_BODY)]  # fmt: skip
    sync = SyncProcess(test_logs_dir / "sync", f"file://{store}", args)
    sync.start()
    a, b, gone = Learner(sync.url, "a", PLAN), Learner(sync.url, "b", PLAN), Learner(sync.url, "gone", PLAN)
    try:
        assert a.register().status_code == 200
        assert b.register().status_code == 200
        assert gone.register().status_code == 200
        assert gone.client.post("/v1/learners/gone/leave").status_code == 204
        for p in (0, 1):
            assert a.init(p, initial_params(PLAN, p)).status_code == 200
        r = a.contribute(1, 0, encode_grad(outer_grad(PLAN, 1, seed=5), 1, 0), seq=77)
        assert r.status_code == 202, r.text
        assert a.fetch(1, newer_than=0, wait=20) is not None
        yield Env(sync, a, b, merged_seq=77, store=store)
    finally:
        for learner in (a, b, gone):
            learner.close()
        sync.stop()


def good_blob(p: int = 0, base: int = 0) -> bytes:
    return encode_grad(outer_grad(PLAN, p, seed=9), p, base)


def prefixed(frame: bytes) -> bytes:
    """``frame`` behind the codec's prefix, which declares its length."""
    return codec.MAGIC + struct.pack("<HQ", codec.FORMAT_VERSION, len(frame)) + frame


def header_blob(header: bytes, data: bytes = b"") -> bytes:
    """One well-formed zstd frame around a crafted header (a registered learner can send anything)."""
    inner = struct.pack("<I", len(header)) + header + data
    return prefixed(zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(inner))


def corrupt_header_blob() -> bytes:
    """A well-formed zstd frame whose header is not JSON."""
    return header_blob(b"{this is not json", b"\x00" * 64)


def crafted_header(p: int, tensors: str) -> bytes:
    """The header of a payload on version 1 (fragment 1's), with the JSON text of its tensor list."""
    return (
        f'{{"base_version":1,"block_size":256,"fragment":{p},"kind":"outer_grad","quantizer":"fp32",'
        f'"tensors":{tensors}}}'
    ).encode()


def huge_shape_blob() -> bytes:
    """A shape whose product has hundreds of digits: no float can hold its byte size."""
    dims = ",".join(["100000000000000000000"] * 16)
    entry = f'{{"dtype":"float32","name":"h.0.attn.weight","scales":[0,0],"shape":[{dims}],"values":[0,4]}}'
    return header_blob(crafted_header(1, f"[{entry}]"), b"\0" * 4)


def deep_header_blob() -> bytes:
    """A header nested a thousand levels deep (fits fragment 1's header bound)."""
    return header_blob(crafted_header(1, "[" * 1100 + "]" * 1100))


def long_integer_blob() -> bytes:
    """A dimension of 2,000 digits."""
    entry = (
        '{"dtype":"float32","name":"h.0.attn.weight","scales":[0,0],"shape":['
        + "9" * 2000
        + '],"values":[0,4]}'
    )
    return header_blob(crafted_header(1, f"[{entry}]"), b"\0" * 4)


def with_frame_tail(tail: bytes) -> bytes:
    """A good payload whose declared length also covers ``tail`` after its zstd frame."""
    return prefixed(good_blob()[codec._PREFIX.size :] + tail)


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


def post(env: Env, *, p: int = 0, base: int | str = 0, blob: bytes | Iterator[bytes] | None = None,
         who: dict[str, Any] | None = None, seq: int | str = 1, steps: int | str = 4,
         tokens: int | str = 32) -> httpx.Response:  # fmt: skip
    """``who``: the request's authentication (``learner_auth``'s arguments; learner b's by default)."""
    params = {"base_version": base, "steps": steps, "tokens": tokens, "seq": seq}
    return httpx.post(
        f"{env.sync.url}/v1/fragments/{p}/contributions",
        params=params,
        content=good_blob(p, int(base)) if blob is None else blob,
        timeout=30,
        **(learner_auth("b") if who is None else who),
    )


CASES: dict[str, tuple[Callable[[Env], httpx.Response], int, str]] = {
    "no_token": (lambda e: post(e, who={"headers": {"X-DiLoCo-Learner": "b"}}), 401, "unauthenticated"),
    "bad_token": (
        lambda e: post(e, who={"headers": {"Authorization": "Bearer 00ff", "X-DiLoCo-Learner": "b"}}),
        401,
        "unauthenticated",
    ),
    # the learner's whole (valid) token as a bearer: refused, only signed requests are taken
    "bearer_token": (
        lambda e: post(
            e,
            who={
                "headers": {"Authorization": f"Bearer {learner_token(SECRET, 'b')}", "X-DiLoCo-Learner": "b"}
            },
        ),  # fmt: skip
        401,
        "unauthenticated",
    ),
    "other_learners_token": (lambda e: post(e, who=learner_auth("b", token_of="a")), 403, "forbidden"),
    "heartbeat_for_another_learner": (
        lambda e: httpx.post(
            f"{e.sync.url}/v1/learners/a/heartbeat",
            **learner_auth("b"),
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
    # numbers beyond what any learner can have done: refused before the body is read
    "tokens_2e19": (lambda e: post(e, tokens=2 * 10**19, steps=1), 400, "bad_request"),
    "tokens_1e200": (lambda e: post(e, tokens=10**200), 400, "bad_request"),
    "tokens_1.3e154": (lambda e: post(e, tokens=13 * 10**153), 400, "bad_request"),
    "tokens_beyond_steps": (lambda e: post(e, tokens=10**12, steps=1), 400, "bad_request"),
    "steps_1e13": (lambda e: post(e, steps=10**13), 400, "bad_request"),
    "seq_1e30": (lambda e: post(e, seq=10**30), 400, "bad_request"),
    "base_version_1e30": (lambda e: post(e, base=10**30, blob=good_blob()), 400, "bad_request"),
    "tokens_not_a_number": (lambda e: post(e, tokens="1e3"), 400, "bad_request"),
    # crafted payloads: the codec's own error, never a server error
    "huge_shape": (lambda e: post(e, p=1, base=1, blob=huge_shape_blob()), 400, "corrupt"),
    "deeply_nested_header": (lambda e: post(e, p=1, base=1, blob=deep_header_blob()), 400, "corrupt"),
    "long_integer_in_header": (lambda e: post(e, p=1, base=1, blob=long_integer_blob()), 400, "corrupt"),
    "extra_zstd_frame": (
        lambda e: post(e, blob=with_frame_tail(zstandard.ZstdCompressor().compress(b"x" * 4000))),
        400,
        "corrupt",
    ),
    "trailing_bytes_in_frame": (lambda e: post(e, blob=with_frame_tail(b"\x00" * 4000)), 400, "corrupt"),
    # a learner that left: refused until it registers again
    "learner_that_left": (lambda e: post(e, who=learner_auth("gone")), 409, "left"),
    # authentication comes before any validation
    "malformed_query_without_token": (
        lambda e: post(e, steps="many", who={"headers": {"X-DiLoCo-Learner": "b"}}),
        401,
        "unauthenticated",
    ),
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
    assert upload_files(env.store) == []  # a body written as it arrived is removed once refused


def upload_files(root: Path) -> list[Path]:
    """The upload files under the pending folders of ``root`` (other objects' writes make their own
    temporary files for a moment)."""
    return [path for path in root.glob(f"*/pending/**/{UPLOAD_PREFIX}*") if path.is_file()]


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
    return _post_json(f"{env.sync.url}{path}", body, learner_auth(learner_id))


def _post_json(url: str, body: bytes | Iterator[bytes], who: dict[str, Any]) -> httpx.Response:
    headers = {**who.get("headers", {}), "Content-Type": "application/json"}
    return httpx.post(url, content=body, headers=headers, auth=who.get("auth"), timeout=30)


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


def raw_heartbeat(fields: str) -> bytes:
    """A heartbeat body with the JSON text of extra fields (which may override the usual ones)."""
    return f'{{"step": 1, "tokens": 8, "step_time_s": 0.1, {fields}}}'.encode()


def heartbeat_of(e: Env, body: bytes, who: dict[str, Any] | None = None) -> httpx.Response:
    return _post_json(
        f"{e.sync.url}/v1/learners/b/heartbeat", body, learner_auth("b") if who is None else who
    )


def register_of(e: Env, body: bytes, who: dict[str, Any] | None = None) -> httpx.Response:
    return _post_json(f"{e.sync.url}/v1/learners/register", body, learner_auth("c") if who is None else who)


def bad_heartbeat(fields: str) -> tuple[Callable[[Env], httpx.Response], int, str]:
    """A case: learner b's heartbeat with these fields, refused as a bad request."""
    return (lambda e: heartbeat_of(e, raw_heartbeat(fields)), 400, "bad_request")


NO_TOKEN: dict[str, Any] = {"headers": {"X-DiLoCo-Learner": "b"}}
DEEP_JSON = b"[" * 5000 + b"]" * 5000
BAD_JSON_CASES: dict[str, tuple[Callable[[Env], httpx.Response], int, str]] = {
    # heartbeat fields a learner cannot have measured
    "step_time_1e300": bad_heartbeat('"step_time_s": 1e300'),
    "step_time_infinity": bad_heartbeat('"step_time_s": Infinity'),
    "step_time_nan": bad_heartbeat('"step_time_s": NaN'),
    "step_time_negative": bad_heartbeat('"step_time_s": -1.0'),
    "eval_loss_nan": bad_heartbeat('"eval_loss": NaN'),
    "blocked_infinity": bad_heartbeat('"blocked_s": Infinity'),
    "step_1e30": bad_heartbeat(f'"step": {10**30}'),
    "tokens_1e200": bad_heartbeat(f'"tokens": {10**200}'),
    "bytes_sent_1e30": bad_heartbeat(f'"bytes_sent": {10**30}'),
    "fragment_steps_1e30": bad_heartbeat(f'"fragment_steps": {{"0": {10**30}}}'),
    "fragment_tokens_of_a_huge_fragment": bad_heartbeat('"fragment_tokens": {"99999999": 1}'),
    # fragment maps: keys are decimal fragment indices, as the OpenAPI document says
    "fragment_key_not_a_number": bad_heartbeat('"fragment_steps": {"one": 1}'),
    "fragment_key_with_a_sign": bad_heartbeat('"fragment_steps": {"+1": 1}'),
    "fragment_key_with_underscores": bad_heartbeat('"fragment_tokens": {"1_0": 1}'),
    # bodies that are not JSON at all: the protocol's error body, not the framework's
    "heartbeat_invalid_utf8": (lambda e: heartbeat_of(e, b'{"step": "\xff\xfe"}'), 400, "bad_request"),
    "heartbeat_deep_json": (lambda e: heartbeat_of(e, DEEP_JSON), 400, "bad_request"),
    "register_invalid_utf8": (lambda e: register_of(e, b"\xc3\x28"), 400, "bad_request"),
    "register_deep_json": (lambda e: register_of(e, DEEP_JSON), 400, "bad_request"),
    # authentication first: a malformed body without a token is unauthenticated, not malformed
    "heartbeat_malformed_without_token": (
        lambda e: heartbeat_of(e, b"{not json", NO_TOKEN),
        401,
        "unauthenticated",
    ),
    "heartbeat_deep_json_without_token": (
        lambda e: heartbeat_of(e, DEEP_JSON, {"headers": {}}),
        401,
        "unauthenticated",
    ),
    "register_malformed_without_token": (
        lambda e: register_of(e, b"\xc3\x28", {"headers": {"X-DiLoCo-Learner": "c"}}),
        401,
        "unauthenticated",
    ),
    # a learner that left: heartbeats do not bring it back (registering does)
    "heartbeat_of_a_learner_that_left": (
        lambda e: httpx.post(
            f"{e.sync.url}/v1/learners/gone/heartbeat", json=heartbeat_body(5), **learner_auth("gone")
        ),
        409,
        "left",
    ),
    # a route that does not exist: the protocol's error body too
    "unknown_route": (lambda e: httpx.get(f"{e.sync.url}/v2/nothing"), 404, "not_found"),
    "unknown_learner_route": (
        lambda e: httpx.get(f"{e.sync.url}/v1/nothing", **learner_auth("b")),
        404,
        "not_found",
    ),
}


@pytest.mark.parametrize("case", list(BAD_JSON_CASES))
def test_bad_json_request_is_refused_with_the_error_body_and_changes_nothing(env: Env, case: str) -> None:
    send, want_status, want_code = BAD_JSON_CASES[case]
    before, learners_before = snapshot(env), learners_state(env)
    r = send(env)
    assert r.status_code == want_status, r.text
    body = r.json()
    assert set(body) == {"code", "reason", "retryable", "current_version"}, body
    assert body["code"] == want_code
    assert body["reason"]
    assert learners_state(env) == learners_before  # /v1/status still answers, and nobody moved
    assert snapshot(env) == before


def test_fragment_maps_with_decimal_keys_are_taken(env: Env) -> None:
    """The keys the OpenAPI document allows are the keys the synchronizer takes."""
    doc = httpx.get(f"{env.sync.url}/openapi.json").json()
    heartbeat = doc["components"]["schemas"]["Heartbeat"]["properties"]
    for field in ("fragment_steps", "fragment_tokens"):
        pattern = heartbeat[field]["propertyNames"]["pattern"]
        assert all(re.fullmatch(pattern, key) for key in ("0", "12", "99999"))
        assert not any(re.fullmatch(pattern, key) for key in ("+1", "01", "1_0", " 1", "one", "-1"))
    r = heartbeat_of(env, raw_heartbeat('"fragment_steps": {"0": 3, "1": 0}, "fragment_tokens": {"1": 24}'))
    assert r.status_code == 200, r.text


def test_a_learner_that_left_rejoins_by_registering(sync_factory: SyncFactory) -> None:
    """Leaving is final until the learner registers again; then it contributes like any other."""
    sync = sync_factory(args=["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "1"])
    a = Learner(sync.url, "a", PLAN)
    try:
        assert a.register().status_code == 200
        for p in (0, 1):
            assert a.init(p, initial_params(PLAN, p)).status_code == 200
        assert a.client.post("/v1/learners/a/leave").status_code == 204
        refused = a.contribute(0, 0, good_blob(0, 0))
        assert refused.status_code == 409, refused.text
        assert refused.json()["code"] == "left"
        assert "register" in refused.json()["reason"]
        assert a.heartbeat(3).status_code == 409
        assert status(sync.url)["learners"][0]["state"] == "left"  # type: ignore[index]
        assert a.register().status_code == 200
        assert a.heartbeat(4).status_code == 200
        taken = a.contribute(0, 0, good_blob(0, 0))
        assert taken.status_code == 202, taken.text
        assert a.fetch(0, newer_than=0, wait=30) is not None
    finally:
        a.close()


def test_the_grace_window_cap_holds_whatever_a_learner_reports(sync_factory: SyncFactory) -> None:
    """One learner reporting the longest step time it may (a day) does not hold back a round that
    reached its quorum beyond --max-grace-s."""
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "1", "--max-grace-s", "1"]
    sync = sync_factory(args=args)
    a, slow = Learner(sync.url, "a", PLAN), Learner(sync.url, "slow", PLAN)
    try:
        assert a.register().status_code == 200
        assert slow.register().status_code == 200
        for p in (0, 1):
            assert a.init(p, initial_params(PLAN, p)).status_code == 200
        r = slow.heartbeat(1, step_time_s=86_400.0)
        assert r.status_code == 200, r.text
        assert r.json()["alive_learners"] == 2
        assert a.contribute(0, 0, good_blob(0, 0)).status_code == 202
        got = a.fetch(0, newer_than=0, wait=30)  # a day-long grace window would not merge in time
        assert got is not None
        assert got[0] == 1
        assert slow.heartbeat(2, step_time_s=86_400.0).status_code == 200  # still alive, still reporting
    finally:
        a.close()
        slow.close()


def test_readyz_tells_storage_details_only_to_learners(
    s3_server_factory: Callable[[], S3Server], test_logs_dir: Path
) -> None:
    """During a storage outage an unauthenticated /readyz says that storage is unavailable, not where
    it is: no endpoint, bucket or object key. A learner's token gets the details."""
    s3 = s3_server_factory()
    bucket = s3.new_bucket()
    s3.stop()
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "1"]
    sync = SyncProcess(test_logs_dir / "sync", f"s3://{bucket}/jobs/hidden", args, s3.env())
    sync.start(wait_loaded=False)
    endpoint = s3.endpoint_url.split("://", 1)[1]
    secrets = (endpoint, bucket, "jobs/hidden", "shard-000", "plan.json")
    try:

        def outage_seen() -> dict[str, object] | None:
            r = httpx.get(f"{sync.url}/readyz", **learner_auth("a"), timeout=5)
            body: dict[str, object] = r.json()
            return body if r.status_code == 503 and body["storage_ok"] is False else None

        detailed = wait_for(outage_seen, timeout=60, what="/readyz to report the storage outage")
        assert any(s in json.dumps(detailed) for s in secrets), detailed  # the learner learns where
        public = httpx.get(f"{sync.url}/readyz", timeout=5)
        assert public.status_code == 503
        body = public.json()
        assert body["ready"] is False
        assert body["storage_ok"] is False
        assert "storage unavailable" in str(body["reason"])
        for s in secrets:
            assert s not in public.text, (s, public.text)
        wrong = httpx.get(
            f"{sync.url}/readyz", headers={"Authorization": "Bearer 00", "X-DiLoCo-Learner": "a"}
        )
        for s in secrets:
            assert s not in wrong.text, (s, wrong.text)
        # learner routes need a token before they say anything, their "starting" reason included
        anonymous = httpx.post(f"{sync.url}/v1/learners/register", json=register_body("a"), timeout=5)
        assert anonymous.status_code == 401
        for s in secrets:
            assert s not in anonymous.text
    finally:
        sync.stop()


class SlowClients:
    """Connections that send a request head one byte at a time and never finish it (slowloris);
    ``reconnect`` opens a new one for each the server closed, as a persistent attacker would."""

    HEAD = b"GET /healthz HTTP/1.1\r\nHost: synchronizer\r\nX-Padding: " + b"a" * 4000

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.sockets: dict[socket.socket, int] = {}  # socket → bytes of the head sent
        self.closed_by_server = 0
        for _ in range(count):
            self._open()

    def _open(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.setblocking(False)
        self.sockets[sock] = 0

    def trickle(self, *, reconnect: bool) -> None:
        """One more byte on every connection; count (and replace) those the server closed."""
        for sock, sent in list(self.sockets.items()):
            try:
                if sock.recv(4096, socket.MSG_PEEK) == b"":  # orderly close by the server
                    raise ConnectionResetError
            except BlockingIOError:
                pass  # nothing from the server: still open
            except OSError:
                self._drop(sock, reconnect)
                continue
            try:
                sock.send(self.HEAD[sent % len(self.HEAD) : sent % len(self.HEAD) + 1])
                self.sockets[sock] = sent + 1
            except OSError:
                self._drop(sock, reconnect)

    def _drop(self, sock: socket.socket, reconnect: bool) -> None:
        del self.sockets[sock]
        sock.close()
        self.closed_by_server += 1
        if reconnect:
            with contextlib.suppress(OSError):
                self._open()

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()


def test_slow_request_heads_neither_starve_healthz_nor_flood_the_log(
    test_logs_dir: Path, tmp_path: Path
) -> None:
    """With 256 open files allowed, hundreds of connections that send their request head byte by byte
    are closed (head timeout; the connection limit closes the oldest unfinished head first), /healthz
    keeps answering, and the log says so a few times instead of once per failed accept."""
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--header-timeout-s", "3"]
    sync = SyncProcess(test_logs_dir / "sync", f"file://{tmp_path / 'store'}", args, fd_limit=256)
    sync.start()
    log_before = sync.log_path.stat().st_size
    few = SlowClients(sync.port, 20)
    many: SlowClients | None = None
    try:
        # below the connection limit: the head timeout closes every one of them
        wait_for(
            lambda: few.trickle(reconnect=False) or not few.sockets,
            timeout=60, interval=0.5, what="the server to close connections with unfinished heads",
        )  # fmt: skip
        assert few.closed_by_server == 20
        # far beyond the limit of open files, for several head timeouts
        many = SlowClients(sync.port, 300)
        for _ in range(4):  # the attack runs a moment before the first probe: a probe amid the very
            many.trickle(reconnect=True)  # first burst may find nothing old enough to close (503)
            time.sleep(0.3)
        answered = 0
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            many.trickle(reconnect=True)
            r = httpx.get(f"{sync.url}/healthz", timeout=10)
            assert r.status_code == 200
            answered += 1
            time.sleep(0.3)
        assert answered >= 5
        assert many.closed_by_server > 0  # closed to make room, or for their head timeout
    finally:
        few.close()
        if many is not None:
            many.close()
        sync.stop()
    log = sync.log_path.read_bytes()[log_before:].decode(errors="replace")
    assert log.count("Too many open files") <= 2 * LOG_BURST, log[-3000:]
    assert len(log) < 256 * 1024, f"{len(log)} bytes of log during the attack: {log[-3000:]}"


def upload_head(instance: str, learner: str, length: int) -> bytes:
    """The head of a contribution upload of ``learner`` to the synchronizer process ``instance``
    announcing a body of ``length`` bytes."""
    target = "/v1/fragments/0/contributions?base_version=0&steps=4&tokens=32&seq=1"
    return (
        f"POST {target} HTTP/1.1\r\nHost: synchronizer\r\nContent-Length: {length}\r\n"
        + signed_head_lines(learner, "POST", target, instance)
        + "\r\n"
    ).encode()


def test_a_body_cut_short_or_stalled_leaves_nothing_in_storage(
    sync_factory: SyncFactory, tmp_path: Path
) -> None:
    """A contribution body is written to storage as it arrives; one whose client leaves, or stops
    sending past --body-timeout-s, is removed, and the learner's contribution is taken afterwards."""
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--body-timeout-s", "2"]
    store = tmp_path / "store"
    sync = sync_factory(storage_url=f"file://{store}", args=args)
    a = Learner(sync.url, "a", PLAN)
    try:
        assert a.register().status_code == 200
        for p in (0, 1):
            assert a.init(p, initial_params(PLAN, p)).status_code == 200
        blob = encode_grad(outer_grad(PLAN, 0, seed=3), 0, 0)
        instance = instance_at(sync.url + API_PREFIX)
        with socket.create_connection(("127.0.0.1", sync.port), timeout=60) as left:
            left.sendall(upload_head(instance, "a", len(blob)) + blob[: len(blob) // 2])  # then it goes
        with socket.create_connection(("127.0.0.1", sync.port), timeout=60) as stalled:
            stalled.sendall(upload_head(instance, "a", len(blob)) + blob[: len(blob) // 2])
            wait_for(
                lambda: len(upload_files(store)) == 1, timeout=10, what="the body file in the pending folder"
            )
            assert stalled.recv(4096) == b""  # closed by the server after the body timeout
        deadline = time.monotonic() + 20
        while upload_files(store) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert upload_files(store) == []
        r = a.contribute(0, 0, blob, seq=1)
        assert r.status_code == 202, r.text
        assert r.json()["durable"] is True
        assert upload_files(store) == []
    finally:
        a.close()


def test_a_stalled_body_is_closed_and_a_full_house_answers_503(sync_factory: SyncFactory) -> None:
    """A request body that stops arriving is closed after --body-timeout-s; with every connection
    busy with a request (long-polls), one more is answered 503 ``overloaded``, retryable."""
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--max-connections", "8",
            "--body-timeout-s", "2"]  # fmt: skip
    sync = sync_factory(args=args)
    a = Learner(sync.url, "a", PLAN)
    try:
        assert a.register().status_code == 200
        for p in (0, 1):
            assert a.init(p, initial_params(PLAN, p)).status_code == 200
        a.close()
        instance = instance_at(sync.url + API_PREFIX)
        head = upload_head(instance, "a", 2000)
        with socket.create_connection(("127.0.0.1", sync.port), timeout=60) as stalled:
            stalled.sendall(head + b"\x00" * 100)
            assert stalled.recv(4096) == b""  # closed by the server, no answer: the body never came

        # eight long-polls, connected before the ninth connection (the server accepts in order)
        def poll() -> bytes:
            return (
                "GET /v1/fragments/0?newer_than=0&wait=8 HTTP/1.1\r\nHost: synchronizer\r\n"
                + signed_head_lines("a", "GET", "/v1/fragments/0?newer_than=0&wait=8", instance)
                + "\r\n"
            ).encode()

        polls = [socket.create_connection(("127.0.0.1", sync.port), timeout=60) for _ in range(8)]
        try:
            for sock in polls:
                sock.sendall(poll())
            refused = httpx.get(f"{sync.url}/healthz", timeout=10)
            assert refused.status_code == 503
            assert refused.json()["code"] == "overloaded"
            assert refused.json()["retryable"] is True
            assert refused.headers["Retry-After"] == "1"
            for sock in polls:  # busy with a request: never closed to make room
                assert sock.recv(4096).startswith(b"HTTP/1.1 304 ")
        finally:
            for sock in polls:
                sock.close()
        assert httpx.get(f"{sync.url}/healthz", timeout=10).status_code == 200
    finally:
        a.close()


def test_bodies_sent_slowly_to_the_public_routes_are_refused_and_hold_no_connection(
    sync_factory: SyncFactory,
) -> None:
    """As many connections as the server takes, each an unauthenticated chunked POST to a route that
    answers everyone, sending a chunk now and then: each is answered 413 at once and closed, so
    /healthz is still served (before, each body was read up to the JSON limit and the connections,
    busy with a request, filled the server: 503 overloaded)."""
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--max-connections", "8",
            "--header-timeout-s", "2", "--body-timeout-s", "10"]  # fmt: skip
    sync = sync_factory(args=args)
    socks = [socket.create_connection(("127.0.0.1", sync.port), timeout=30) for _ in range(8)]
    try:
        for i, sock in enumerate(socks):
            path = ("/healthz", "/readyz", "/v1/status", "/metrics")[i % 4]
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                + b"400\r\n"
                + b"x" * 1024
                + b"\r\n"
            )
        for sock in socks:
            answer = b""
            while chunk := sock.recv(4096):  # closed by the server once it has answered
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
            assert b"takes no request body" in answer
        assert httpx.get(f"{sync.url}/healthz", timeout=10).status_code == 200
    finally:
        for sock in socks:
            sock.close()


def test_one_learners_trickling_uploads_neither_hold_the_server_nor_starve_the_others(
    sync_factory: SyncFactory,
) -> None:
    """A learner with a valid token opens ten uploads (Content-Length 5000) and sends a byte now and
    then, each pause within the body timeout: beyond its 4 uploads it is answered 429 at once, the 4
    are closed once below the minimum rate, and meanwhile /healthz and another learner are served."""
    args = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "2",
            "--header-timeout-s", "2", "--body-timeout-s", "30", "--min-body-rate", "100"]  # fmt: skip
    sync = sync_factory(args=args)
    a, b = Learner(sync.url, "a", PLAN), Learner(sync.url, "b", PLAN)
    uploads: list[socket.socket] = []
    try:
        for learner in (a, b):
            assert learner.register().status_code == 200
        for p in (0, 1):
            assert a.init(p, initial_params(PLAN, p)).status_code == 200
        instance = instance_at(sync.url + API_PREFIX)
        for _ in range(10):
            sock = socket.create_connection(("127.0.0.1", sync.port), timeout=30)
            sock.sendall(
                upload_head(instance, "a", 5000) + b"\x00"
            )  # each signed on its own, as a learner's are
            uploads.append(sock)
        refused, admitted = [], []
        for sock in uploads:
            sock.settimeout(1.0)
            try:
                answer = sock.recv(4096)
            except TimeoutError:
                admitted.append(sock)  # no answer: its body is awaited
                continue
            assert answer.startswith(b"HTTP/1.1 429 "), answer
            refused.append(answer)
        assert (len(refused), len(admitted)) == (6, 4)
        assert b'"code":"too_many_requests"' in refused[0]
        assert b"retry-after: 1" in refused[0].lower()

        def closed(sock: socket.socket) -> bool:
            try:
                sock.send(b"\x00")
                sock.settimeout(0.05)
                return sock.recv(4096, socket.MSG_PEEK) == b""
            except TimeoutError:
                return False
            except OSError:
                return True

        still_open = list(admitted)
        deadline = time.monotonic() + 20
        while still_open and time.monotonic() < deadline:  # a byte every half second: below 100/s
            assert httpx.get(f"{sync.url}/healthz", timeout=5).status_code == 200
            still_open = [sock for sock in still_open if not closed(sock)]
            time.sleep(0.5)
        assert still_open == []
        assert b.contribute(0, 0, good_blob(0, 0)).json()["status"] == "accepted"
        assert "arrived at" in sync.log_path.read_text()  # the log says why they were closed
    finally:
        for sock in uploads:
            sock.close()
        a.close()
        b.close()
