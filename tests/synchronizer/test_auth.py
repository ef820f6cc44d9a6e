"""Authentication decisions: who may act for which learner, until when."""

from __future__ import annotations

import pytest
from diloco_core.auth import learner_token
from diloco_sync.auth import TokenCheck, authenticate, declared_problem
from diloco_sync.errors import ApiError

SECRET = "s3cret"
CHECK = TokenCheck(SECRET, clock=lambda: 1_000_000.0)


def bearer(learner: str, **claims: int) -> str:
    return f"Bearer {learner_token(SECRET, learner, **claims)}"


@pytest.mark.parametrize(
    ("authorization", "claimed", "subject", "status", "code"),
    [
        (None, "a", None, 401, "unauthenticated"),
        ("Basic abc", "a", None, 401, "unauthenticated"),
        (bearer("a"), None, None, 401, "unauthenticated"),
        ("Bearer deadbeef", "a", None, 401, "unauthenticated"),
        (f"Bearer {learner_token('another job', 'a')}", "a", None, 401, "unauthenticated"),
        (bearer("b"), "a", None, 403, "forbidden"),  # b's token, claiming to be a
        (bearer("a"), "a", "b", 403, "forbidden"),  # a acting for b
        (bearer("a", expires_at=900_000), "a", None, 401, "unauthenticated"),  # expired
    ],
)
def test_authenticate_refusals(
    authorization: str | None, claimed: str | None, subject: str | None, status: int, code: str
) -> None:
    with pytest.raises(ApiError) as info:
        authenticate(CHECK, authorization, claimed, subject=subject)
    assert (info.value.status, info.value.code) == (status, code)


def test_authenticate_accepts_own_token_until_it_expires() -> None:
    assert authenticate(CHECK, bearer("a"), "a", subject="a").learner == "a"
    # within the clocks' leeway of its expiry
    claims = authenticate(CHECK, bearer("a", expires_at=999_900, tokens_per_step=512), "a")
    assert (claims.expires_at, claims.tokens_per_step) == (999_900, 512)


def test_a_revoked_generation_is_refused_and_the_next_one_accepted() -> None:
    check = TokenCheck(SECRET, min_generation=lambda learner: 2 if learner == "a" else 0, clock=CHECK.clock)
    with pytest.raises(ApiError) as info:
        authenticate(check, bearer("a", generation=1), "a")
    assert info.value.status == 401
    assert "revoked" in info.value.body.reason
    assert authenticate(check, bearer("a", generation=2), "a").generation == 2
    assert authenticate(check, bearer("b", generation=0), "b").learner == "b"


def test_tokens_are_checked_against_the_declared_tokens_per_step() -> None:
    claims = authenticate(CHECK, bearer("a", tokens_per_step=256), "a")
    assert declared_problem(claims, steps=4, tokens=1024) is None
    assert declared_problem(claims, steps=4, tokens=1000) is None  # fewer (padding) is fine
    assert "256 tokens per step" in str(declared_problem(claims, steps=4, tokens=1025))
    undeclared = authenticate(CHECK, bearer("a"), "a")
    assert declared_problem(undeclared, steps=1, tokens=10**9) is None
