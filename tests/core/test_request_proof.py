"""Signed learner requests: what a proof binds, how it is read, and the memory of proofs used."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from diloco_core.auth import learner_token
from diloco_core.request_proof import (
    PROBE_ABOVE_BYTES,
    PROOF_WINDOW_S,
    ProofAuth,
    SeenProofs,
    challenge,
    challenged_instance,
    new_instance,
    proven_claims,
    read_proof,
    request_target,
    response_instance,
    time_problem,
)
from diloco_core.request_proof import prove as prove_for

SECRET = "job-secret"
TOKEN = learner_token(SECRET, "a", tokens_per_step=64)
INSTANCE = "inst-1"


def prove(token: str, method: str, target: str, **kwargs: object) -> str:
    return prove_for(token, method, target, instance=INSTANCE, **kwargs)  # type: ignore[arg-type]


def test_the_proof_carries_the_claims_and_never_the_tokens_mac() -> None:
    header = prove(TOKEN, "POST", "/v1/learners/register", now=1000, nonce="n1")
    mac = TOKEN.rsplit(".", 1)[1]
    assert header.startswith("DiLoCo-Proof dl2.")
    assert mac not in header
    proof = read_proof(header)
    assert proof is not None
    assert (proof.signed_at, proof.nonce) == (1000, "n1")
    claims = proven_claims(SECRET, proof, "POST", "/v1/learners/register", INSTANCE)
    assert claims is not None
    assert (claims.learner, claims.tokens_per_step) == ("a", 64)


@pytest.mark.parametrize(
    ("method", "target", "instance", "secret"),
    [
        ("GET", "/v1/learners/register", INSTANCE, SECRET),
        ("POST", "/v1/learners/a/leave", INSTANCE, SECRET),
        ("POST", "/v1/learners/register?x=1", INSTANCE, SECRET),
        ("POST", "/v1/learners/register", "another-process", SECRET),
        ("POST", "/v1/learners/register", INSTANCE, "another job"),
        ("POST", "/v1/learners/register", INSTANCE, ""),
    ],
)
def test_a_proof_is_not_good_for_another_request_process_or_job(
    method: str, target: str, instance: str, secret: str
) -> None:
    proof = read_proof(prove(TOKEN, "POST", "/v1/learners/register", now=1000))
    assert proof is not None
    assert proven_claims(secret, proof, method, target, instance) is None


def test_the_challenge_names_the_instance_to_sign_for() -> None:
    instance = new_instance()
    assert instance != new_instance()
    assert challenged_instance(challenge(instance)) == instance
    assert challenged_instance('diloco-proof instance="x-1", realm="y"') == "x-1"
    assert challenged_instance(f'Basic realm="proxy", {challenge(instance)}') == instance  # a proxy's first
    assert challenged_instance(f'{challenge(instance)}, Basic realm="p", instance="other"') == instance
    for other in (None, "", "Bearer", 'Basic instance="x"', "DiLoCo-Proof", 'DiLoCo-Proof instance="a b"',
                  'DiLoCo-Proof foo_instance="x"', 'Basic realm="p", instance="x"'):  # fmt: skip
        assert challenged_instance(other) is None


@pytest.mark.parametrize(
    "value",
    [None, "", "Bearer " + TOKEN, "DiLoCo-Proof", "DiLoCo-Proof dl2.c.1.n", "DiLoCo-Proof dl3.c.1.n.s",
     "DiLoCo-Proof dl2.c.-1.n.s", "DiLoCo-Proof dl2.c.1e3.n.s", "DiLoCo-Proof dl2..1.n.s",
     "DiLoCo-Proof dl2.c.1.n.s" + "x" * 3000, "DiLoCo-Proof dl2.c.\u00b2\u00b3.n.s"],
)  # fmt: skip
def test_malformed_proofs_are_not_read(value: str | None) -> None:
    assert read_proof(value) is None


def test_only_a_whole_token_signs() -> None:
    for bad in ("", "dl2.claims", "abc", TOKEN + ".x"):
        with pytest.raises(ValueError):
            prove(bad, "GET", "/v1/status")


def test_the_window_of_a_proofs_time() -> None:
    proof = read_proof(prove(TOKEN, "GET", "/x", now=10_000))
    assert proof is not None
    assert time_problem(proof, 10_000 + PROOF_WINDOW_S) is None
    assert time_problem(proof, 10_000 - PROOF_WINDOW_S) is None
    assert "clocks" in str(time_problem(proof, 10_001 + PROOF_WINDOW_S))


def test_seen_proofs_leave_the_window_by_their_own_time_not_their_arrival() -> None:
    seen = SeenProofs(limit=2)
    ahead = read_proof(prove(TOKEN, "GET", "/x", now=200, nonce="ahead"))  # a clock 100 s ahead
    on_time = read_proof(prove(TOKEN, "GET", "/x", now=101, nonce="on-time"))
    later = read_proof(prove(TOKEN, "GET", "/x", now=150, nonce="later"))
    assert ahead is not None
    assert on_time is not None
    assert later is not None
    assert seen.admit("a", ahead, 100) is None
    assert seen.admit("a", on_time, 101) is None
    # at 102 + the window the on-time proof has left it though it came second; the one ahead has not
    assert seen.admit("a", later, 102 + PROOF_WINDOW_S) is None
    again = seen.admit("a", ahead, 103 + PROOF_WINDOW_S)
    assert again is not None
    assert again[0] == "replay"


def test_seen_proofs_are_refused_until_they_are_out_of_the_window() -> None:
    seen = SeenProofs(limit=2)
    first = read_proof(prove(TOKEN, "GET", "/x", now=100, nonce="n1"))
    second = read_proof(prove(TOKEN, "GET", "/x", now=100, nonce="n2"))
    third = read_proof(prove(TOKEN, "GET", "/x", now=100, nonce="n3"))
    assert first is not None
    assert second is not None
    assert third is not None
    assert seen.admit("a", first, 100) is None
    again = seen.admit("a", first, 101)
    assert again is not None
    assert again[0] == "replay"
    assert seen.admit("b", first, 101) is None  # each learner's own
    assert seen.admit("a", second, 102) is None
    refusal = seen.admit("a", third, 103)
    assert refusal is not None
    assert refusal[0] == "busy"
    # once out of the window (where the proof itself would be refused), forgotten
    assert seen.admit("a", third, 100 + PROOF_WINDOW_S + 1) is None


class ChallengingSynchronizer:
    """An httpx transport that checks proofs as the synchronizer does, for one process's instance
    (which ``restart`` draws again): 401 with the challenge unless the proof is this request's."""

    def __init__(self) -> None:
        self.instance = new_instance()
        self.seen: list[tuple[httpx.Request, int]] = []

    def restart(self) -> None:
        self.instance = new_instance()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        proof = read_proof(request.headers.get("authorization"))
        target = request_target(request.url.path.removeprefix("/prefix"), request.url.query)
        claims = None
        if proof is not None:
            claims = proven_claims(SECRET, proof, request.method, target, self.instance)
        status = 204 if claims is not None else 401
        self.seen.append((request, status))
        headers = {} if claims else {"WWW-Authenticate": challenge(self.instance)}
        return httpx.Response(status, headers=headers, json=None if claims else {"code": "unauthenticated"})


def test_the_client_signs_for_the_instance_its_challenge_names_and_again_after_a_restart() -> None:
    sync = ChallengingSynchronizer()
    client = httpx.Client(
        base_url="http://sync.example/prefix/",
        transport=httpx.MockTransport(sync),
        auth=ProofAuth(TOKEN, root="/prefix/"),
    )
    assert client.post("/v1/x", content=b"body").status_code == 204  # signed for no instance, then for it
    assert client.post("/v1/x", content=b"body").status_code == 204  # at once
    sync.restart()
    assert client.post("/v1/x", content=b"body").status_code == 204
    assert [status for _, status in sync.seen] == [401, 204, 204, 401, 204]
    assert all(request.content == b"body" for request, _ in sync.seen)  # the body sent again whole


def test_a_streamed_body_is_signed_for_the_instance_read_first_and_never_sent_twice() -> None:
    sync = ChallengingSynchronizer()
    client = httpx.Client(
        base_url="http://sync.example/", transport=httpx.MockTransport(sync), auth=ProofAuth(TOKEN)
    )
    assert client.post("/v1/x", content=iter([b"a", b"b"])).status_code == 204
    probe, streamed = (request for request, _ in sync.seen)
    assert ("authorization" in probe.headers, probe.content) == (False, b"")  # no proof, no body
    assert streamed.content == b"ab"
    sync.restart()
    assert (
        client.post("/v1/x", content=iter([b"c"])).status_code == 401
    )  # its body is spent: the caller retries
    assert client.post("/v1/x", content=iter([b"d"])).status_code == 204  # for the instance now known
    assert len(sync.seen) == 4


def test_an_answer_that_took_the_request_is_never_followed_by_another_whatever_its_challenge() -> None:
    sent: list[httpx.Request] = []

    def taken_with_a_challenge(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(202, headers={"WWW-Authenticate": challenge("elsewhere")})

    auth = ProofAuth(TOKEN)
    auth.instance = INSTANCE
    client = httpx.Client(
        base_url="http://sync.example/", transport=httpx.MockTransport(taken_with_a_challenge), auth=auth
    )
    assert client.post("/v1/x", content=b"contribution").status_code == 202
    assert len(sent) == 1
    assert auth.instance == INSTANCE


def test_a_large_body_is_not_sent_before_its_instance_is_known() -> None:
    sync = ChallengingSynchronizer()
    client = httpx.Client(
        base_url="http://sync.example/", transport=httpx.MockTransport(sync), auth=ProofAuth(TOKEN)
    )
    body = bytes(PROBE_ABOVE_BYTES + 1)
    assert client.post("/v1/x", content=body).status_code == 204
    probe, sent = (request for request, _ in sync.seen)
    assert (probe.content, sent.content) == (b"", body)  # the body crossed the link once


def test_the_instance_is_read_among_several_challenges() -> None:
    def two_challenges(request: httpx.Request) -> httpx.Response:
        headers = [("WWW-Authenticate", 'Basic realm="proxy"'), ("WWW-Authenticate", challenge("i-2"))]
        return httpx.Response(401, headers=headers)

    response = httpx.Client(transport=httpx.MockTransport(two_challenges)).get("http://sync.example/")
    assert response_instance(response) == "i-2"


def test_an_async_client_signs_for_the_instance_its_challenge_names() -> None:
    sync = ChallengingSynchronizer()

    async def two_posts() -> list[int]:
        transport = httpx.MockTransport(sync)
        async with httpx.AsyncClient(
            base_url="http://sync.example/", transport=transport, auth=ProofAuth(TOKEN)
        ) as c:
            return [(await c.post("/v1/x", content=b"body")).status_code for _ in range(2)]

    assert asyncio.run(two_posts()) == [204, 204]
    assert [status for _, status in sync.seen] == [401, 204, 204]


def test_a_refusal_for_another_reason_than_the_instance_is_not_sent_again() -> None:
    sync = ChallengingSynchronizer()
    client = httpx.Client(
        base_url="http://sync.example/",
        transport=httpx.MockTransport(sync),
        auth=ProofAuth(learner_token("another job", "a")),
    )
    assert client.get("/v1/x").status_code == 401
    assert [status for _, status in sync.seen] == [401, 401]  # learned the instance, signed again, refused
    assert client.get("/v1/x").status_code == 401  # the instance known: refused once, not sent again
    assert len(sync.seen) == 3


def test_the_client_signs_the_path_from_the_apis_root_and_the_query() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    tokens = iter([TOKEN, learner_token(SECRET, "a", generation=1)])
    auth = ProofAuth(lambda: next(tokens), root="/prefix/")
    auth.instance = INSTANCE
    client = httpx.Client(
        base_url="http://sync.example/prefix/", transport=httpx.MockTransport(handler), auth=auth
    )
    client.get("/v1/fragments/0", params={"newer_than": 3, "wait": 1.5})
    client.get("/v1/fragments/0", params={"newer_than": 3, "wait": 1.5})
    first, second = (read_proof(r.headers["authorization"]) for r in seen)
    assert first is not None
    assert second is not None
    target = request_target("/v1/fragments/0", "newer_than=3&wait=1.5")
    assert proven_claims(SECRET, first, "GET", target, INSTANCE) is not None
    assert first.nonce != second.nonce
    claims = proven_claims(SECRET, second, "GET", target, INSTANCE)
    assert claims is not None
    assert claims.generation == 1  # the token given now: a renewal is used at once
