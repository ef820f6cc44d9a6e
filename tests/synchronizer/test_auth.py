"""Authentication decisions: who may act for which learner."""

from __future__ import annotations

import pytest
from diloco_core.auth import learner_token
from diloco_sync.auth import authenticate
from diloco_sync.errors import ApiError

SECRET = "s3cret"


def bearer(learner: str) -> str:
    return f"Bearer {learner_token(SECRET, learner)}"


@pytest.mark.parametrize(
    ("authorization", "claimed", "subject", "status", "code"),
    [
        (None, "a", None, 401, "unauthenticated"),
        ("Basic abc", "a", None, 401, "unauthenticated"),
        (bearer("a"), None, None, 401, "unauthenticated"),
        ("Bearer deadbeef", "a", None, 401, "unauthenticated"),
        (bearer("b"), "a", None, 403, "forbidden"),  # b's token, claiming to be a
        (bearer("a"), "a", "b", 403, "forbidden"),  # a acting for b
        (bearer("zz"), "a", None, 401, "unauthenticated"),  # a token of nobody registered
    ],
)
def test_authenticate_refusals(
    authorization: str | None, claimed: str | None, subject: str | None, status: int, code: str
) -> None:
    with pytest.raises(ApiError) as info:
        authenticate(SECRET, authorization, claimed, subject=subject, known_learners=["a", "b"])
    assert (info.value.status, info.value.code) == (status, code)


def test_authenticate_accepts_own_token() -> None:
    assert authenticate(SECRET, bearer("a"), "a", subject="a", known_learners=["a"]) == "a"
