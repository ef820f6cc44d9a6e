"""Learner tokens: signed claims that only the job secret mints and nothing can alter."""

from __future__ import annotations

import base64
import json

import pytest
from diloco_core.auth import (
    TokenClaims,
    learner_token,
    mint_token,
    read_learner_token,
    token_mac,
    token_problem,
    verify_learner_token,
)

SECRET = "job-secret"


def test_claims_round_trip() -> None:
    claims = TokenClaims("job-u-0", issued_at=100, expires_at=200, generation=3, tokens_per_step=4096)
    assert read_learner_token(SECRET, mint_token(SECRET, claims)) == claims
    paced = TokenClaims("job-u-0", issued_at=100, tokens_per_step=4096, min_step_s=0.25)
    assert read_learner_token(SECRET, mint_token(SECRET, paced)) == paced


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf"), 3601.0])
def test_a_step_time_outside_the_bounds_is_not_minted(seconds: float) -> None:
    with pytest.raises(ValueError, match="min_step_s"):
        learner_token(SECRET, "a", min_step_s=seconds)


def _altered(token: str, **changes: object) -> str:
    prefix, payload, mac = token.split(".")
    body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    body.update(changes)
    new = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
    return f"{prefix}.{new}.{mac}"


@pytest.mark.parametrize(
    "token",
    [
        "",
        "deadbeef",
        "dl2..",
        "dl1.e30.abc",
        _altered(learner_token(SECRET, "a"), sub="b"),  # another learner's name on a's mac
        _altered(learner_token(SECRET, "a", expires_at=10), exp=10**12),  # a later expiry
        _altered(learner_token(SECRET, "a", tokens_per_step=8), tps=10**9),
        _altered(learner_token(SECRET, "a", min_step_s=1.0), mss=0.001),  # a faster pace
        learner_token("another secret", "a"),
        learner_token(SECRET, "a") + "x",
        "dl2." + "A" * 5000 + ".x",
    ],
)
def test_anything_not_minted_with_the_secret_is_no_token(token: str) -> None:
    assert read_learner_token(SECRET, token) is None
    assert not verify_learner_token(SECRET, "a", token)


def test_malformed_claims_under_a_valid_mac_are_no_token() -> None:
    for body in (
        '{"sub": "a"}',
        '{"sub": "a", "iat": -1}',
        '{"sub": "a", "iat": 1, "tps": 0}',
        '{"sub": "a", "iat": 1, "mss": 0}',
        '{"sub": "a", "iat": 1, "mss": NaN}',
        '{"sub": "a", "iat": 1, "mss": "1"}',
        '{"sub": "a", "iat": 1, "mss": 1e9}',
        "[]",
        "nul",
    ):
        payload = base64.urlsafe_b64encode(body.encode()).rstrip(b"=").decode()
        assert read_learner_token(SECRET, f"dl2.{payload}.{token_mac(SECRET, payload)}") is None


def test_problems_name_the_reason() -> None:
    claims = TokenClaims("a", issued_at=0, expires_at=1000, generation=1)
    assert token_problem(claims, "a", now=1000 + 299) is None  # within the leeway
    assert "expired" in str(token_problem(claims, "a", now=1000 + 301))
    assert "another learner" in str(token_problem(claims, "b", now=0))
    assert "revoked" in str(token_problem(claims, "a", now=0, min_generation=2))
