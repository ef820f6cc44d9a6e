"""Signed learner requests: what a proof binds, how it is read, and the memory of proofs used."""

from __future__ import annotations

import httpx
import pytest
from diloco_core.auth import learner_token, read_learner_token
from diloco_core.request_proof import (
    PROOF_WINDOW_S,
    ProofAuth,
    SeenProofs,
    prove,
    proven_token,
    read_proof,
    request_target,
    time_problem,
)

SECRET = "job-secret"
TOKEN = learner_token(SECRET, "a", tokens_per_step=64)


def test_the_proof_carries_the_claims_and_never_the_tokens_mac() -> None:
    header = prove(TOKEN, "POST", "/v1/learners/register", now=1000, nonce="n1")
    mac = TOKEN.rsplit(".", 1)[1]
    assert header.startswith("DiLoCo-Proof dl2.")
    assert mac not in header
    proof = read_proof(header)
    assert proof is not None
    assert (proof.signed_at, proof.nonce) == (1000, "n1")
    token = proven_token(SECRET, proof, "POST", "/v1/learners/register")
    assert token == TOKEN
    claims = read_learner_token(SECRET, token)
    assert claims is not None
    assert claims.tokens_per_step == 64


@pytest.mark.parametrize(
    ("method", "target", "secret"),
    [
        ("GET", "/v1/learners/register", SECRET),
        ("POST", "/v1/learners/a/leave", SECRET),
        ("POST", "/v1/learners/register?x=1", SECRET),
        ("POST", "/v1/learners/register", "another job"),
    ],
)
def test_a_proof_is_not_good_for_another_request_or_job(method: str, target: str, secret: str) -> None:
    proof = read_proof(prove(TOKEN, "POST", "/v1/learners/register", now=1000))
    assert proof is not None
    assert proven_token(secret, proof, method, target) is None


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


def test_the_client_signs_the_path_from_the_apis_root_and_the_query() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    tokens = iter([TOKEN, learner_token(SECRET, "a", generation=1)])
    client = httpx.Client(
        base_url="http://sync.example/prefix/",
        transport=httpx.MockTransport(handler),
        auth=ProofAuth(lambda: next(tokens), root="/prefix/"),
    )
    client.get("/v1/fragments/0", params={"newer_than": 3, "wait": 1.5})
    client.get("/v1/fragments/0", params={"newer_than": 3, "wait": 1.5})
    first, second = (read_proof(r.headers["authorization"]) for r in seen)
    assert first is not None
    assert second is not None
    target = request_target("/v1/fragments/0", "newer_than=3&wait=1.5")
    assert proven_token(SECRET, first, "GET", target) == TOKEN
    assert first.nonce != second.nonce
    claims = read_learner_token(SECRET, proven_token(SECRET, second, "GET", target) or "")
    assert claims is not None
    assert claims.generation == 1  # the token given now: a renewal is used at once
