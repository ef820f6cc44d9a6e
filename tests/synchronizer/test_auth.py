"""Authentication decisions: who may act for which learner, for which request, until when."""

from __future__ import annotations

import pytest
from diloco_core.auth import learner_token
from diloco_core.request_proof import PROOF_WINDOW_S, SeenProofs, prove
from diloco_sync.auth import RequestHead, TokenCheck, authenticate, declared_problem
from diloco_sync.errors import ApiError

SECRET = "s3cret"
NOW = 1_000_000.0
ROUTE = "/v1/fragments/0/contributions?base_version=0&steps=4"
INSTANCE = "process-1"


def check(**kwargs: object) -> TokenCheck:
    """A check of the process ``INSTANCE`` with its own replay memory (each test starts with none used)."""
    kwargs.setdefault("instance", INSTANCE)
    return TokenCheck(SECRET, clock=lambda: NOW, **kwargs)  # type: ignore[arg-type]


def signed(learner: str, *, as_learner: str | None = None, target: str = ROUTE, at: float = NOW,
           secret: str = SECRET, instance: str = INSTANCE, **claims: int) -> RequestHead:  # fmt: skip
    """A POST to ``target`` signed with ``learner``'s token for the process ``instance``, naming
    ``as_learner`` (itself by default)."""
    proof = prove(learner_token(secret, learner, **claims), "POST", target, instance=instance, now=at)
    return RequestHead("POST", target, proof, learner if as_learner is None else as_learner)


def with_auth(authorization: str | None, learner: str | None = "a") -> RequestHead:
    return RequestHead("POST", ROUTE, authorization, learner)


@pytest.mark.parametrize(
    ("head", "subject", "status", "code"),
    [
        (with_auth(None), None, 401, "unauthenticated"),
        (with_auth("Basic abc"), None, 401, "unauthenticated"),
        (with_auth(f"Bearer {learner_token(SECRET, 'a')}"), None, 401, "unauthenticated"),  # a whole token
        (with_auth("DiLoCo-Proof dl2.e30.1.n.sig"), None, 401, "unauthenticated"),  # not signed by the job
        (with_auth("DiLoCo-Proof dl2.x.y"), None, 401, "unauthenticated"),  # malformed
        (
            with_auth("DiLoCo-Proof dl2.e30.\u00b2\u00b3.n.sig"),
            None,
            401,
            "unauthenticated",
        ),  # non-ASCII digits
        (signed("a", as_learner=""), None, 401, "unauthenticated"),  # no learner header
        (signed("a", secret="another job"), None, 401, "unauthenticated"),
        (signed("b", as_learner="a"), None, 403, "forbidden"),  # b's token, claiming to be a
        (signed("a"), "b", 403, "forbidden"),  # a acting for b
        (signed("a", expires_at=900_000), None, 401, "unauthenticated"),  # expired
        (signed("a", instance="another process"), None, 401, "unauthenticated"),  # another shard, a restart
        (signed("a", instance=""), None, 401, "unauthenticated"),  # for no process: a client's first request
        (signed("a", at=NOW - PROOF_WINDOW_S - 1), None, 401, "clock_skew"),  # signed too long ago
        (signed("a", at=NOW + PROOF_WINDOW_S + 1), None, 401, "clock_skew"),  # or for later
    ],
)
def test_authenticate_refusals(head: RequestHead, subject: str | None, status: int, code: str) -> None:
    with pytest.raises(ApiError) as info:
        authenticate(check(), head, subject=subject)
    assert (info.value.status, info.value.code) == (status, code)
    if status == 401:
        assert info.value.headers == {"WWW-Authenticate": f'DiLoCo-Proof instance="{INSTANCE}"'}
        assert info.value.body.retryable == (code == "clock_skew")  # a clock is wrong, not the token


def test_a_proof_is_good_for_the_process_it_was_signed_for_alone() -> None:
    head = signed("a", instance="shard-0")
    assert authenticate(check(instance="shard-0"), head).learner == "a"
    for other in ("shard-1", "shard-0 restarted"):
        with pytest.raises(ApiError) as info:
            authenticate(check(instance=other), head)  # never saw it, and still refuses it
        assert info.value.status == 401
        assert info.value.headers == {"WWW-Authenticate": f'DiLoCo-Proof instance="{other}"'}


def test_a_proof_dated_ahead_of_the_clock_is_used_up_by_its_refusal() -> None:
    seen = SeenProofs()
    ahead = signed("a", at=NOW + PROOF_WINDOW_S + 100)
    with pytest.raises(ApiError) as info:
        authenticate(check(seen=seen), ahead)
    assert info.value.code == "clock_skew"
    later = TokenCheck(SECRET, clock=lambda: NOW + 120, seen=seen, instance=INSTANCE)  # the clock caught up
    with pytest.raises(ApiError) as again:
        authenticate(later, ahead)
    assert "received before" in again.value.body.reason


def test_each_process_draws_its_own_instance() -> None:
    assert TokenCheck(SECRET).instance != TokenCheck(SECRET).instance


def test_a_bearer_token_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(ApiError) as info:
        authenticate(check(), with_auth(f"Bearer {learner_token(SECRET, 'a')}"))
    assert "bearer token is not accepted" in info.value.body.reason
    assert info.value.headers == {"WWW-Authenticate": f'DiLoCo-Proof instance="{INSTANCE}"'}


def test_a_proof_is_good_for_its_own_request_once() -> None:
    c = check()
    head = signed("a")
    assert authenticate(c, head, subject="a").learner == "a"
    with pytest.raises(ApiError) as again:
        authenticate(c, head)
    assert again.value.status == 401
    assert "received before" in again.value.body.reason
    for other in ("/v1/learners/a/leave", ROUTE.replace("steps=4", "steps=400"), ROUTE + "&seq=2"):
        moved = RequestHead("POST", other, head.authorization, "a")
        with pytest.raises(ApiError) as info:
            authenticate(check(), moved)  # even to a synchronizer that never saw it
        assert info.value.status == 401
        assert "not this request's" in info.value.body.reason
    get = RequestHead("GET", ROUTE, head.authorization, "a")
    with pytest.raises(ApiError):
        authenticate(check(), get)
    assert authenticate(c, signed("a")).learner == "a"  # a new proof of the same request is


def test_authenticate_accepts_own_token_until_it_expires() -> None:
    assert authenticate(check(), signed("a"), subject="a").learner == "a"
    # within the clocks' leeway of its expiry, and within the window of the request's time
    claims = authenticate(check(), signed("a", expires_at=999_900, tokens_per_step=512, at=NOW - 299))
    assert (claims.expires_at, claims.tokens_per_step) == (999_900, 512)


def test_a_revoked_generation_is_refused_and_the_next_one_accepted() -> None:
    c = check(min_generation=lambda learner: 2 if learner == "a" else 0)
    with pytest.raises(ApiError) as info:
        authenticate(c, signed("a", generation=1))
    assert info.value.status == 401
    assert "revoked" in info.value.body.reason
    assert authenticate(c, signed("a", generation=2)).generation == 2
    assert authenticate(c, signed("b", generation=0)).learner == "b"


def test_a_learner_past_its_proofs_in_the_window_waits_and_others_do_not() -> None:
    c = check(seen=SeenProofs(limit=3))
    for _ in range(3):
        authenticate(c, signed("a"))
    with pytest.raises(ApiError) as info:
        authenticate(c, signed("a"))
    assert (info.value.status, info.value.code) == (429, "too_many_requests")
    assert authenticate(c, signed("b")).learner == "b"


def test_proofs_dated_ahead_count_only_for_the_learner_whose_valid_token_signed_them() -> None:
    """Proofs dated far ahead, signed with another learner's token, or with an expired or revoked
    one, naming learner a: each is refused for what it is, none is remembered for a, so a's own
    requests are still taken (before, each was counted against a until a was refused 429)."""
    seen = SeenProofs(limit=3)
    c = check(seen=seen, min_generation=lambda learner: 2 if learner == "a" else 0)
    far = NOW + 10**9
    for i in range(5):
        with pytest.raises(ApiError) as other:
            authenticate(c, signed("b", as_learner="a", at=far + i))
        assert (other.value.status, other.value.code) == (403, "forbidden")
        for stale in ({"expires_at": 900_000}, {"generation": 1}):
            with pytest.raises(ApiError) as bad:
                authenticate(c, signed("a", at=far + i, generation=stale.get("generation", 2), **{
                    k: v for k, v in stale.items() if k != "generation"}))  # fmt: skip
            assert (bad.value.status, bad.value.code) == (401, "unauthenticated")
    for _ in range(3):
        assert authenticate(c, signed("a", generation=2)).learner == "a"


def test_tokens_are_checked_against_the_declared_tokens_per_step() -> None:
    claims = authenticate(check(), signed("a", tokens_per_step=256))
    assert declared_problem(claims, steps=4, tokens=1024) is None
    assert declared_problem(claims, steps=4, tokens=1000) is None  # fewer (padding) is fine
    assert "256 tokens per step" in str(declared_problem(claims, steps=4, tokens=1025))
    undeclared = authenticate(check(), signed("a"))
    assert declared_problem(undeclared, steps=1, tokens=10**9) is None
