"""The units' learner tokens: what each claims, when the operator mints one again, the revocations,
and the minting against a real apiserver (renewed and revoked in the same Secret)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from diloco_core.auth import TokenClaims, read_learner_token
from diloco_operator.builders.names import JobRef
from diloco_operator.builders.tokens import (
    claim_annotations,
    mint_reason,
    revocations,
    unit_claims,
    unit_tokens_per_step,
)
from diloco_operator.kube import Kube
from diloco_operator.runtime.reconcile import ensure_learner_tokens, ensure_secret, secret_value
from diloco_operator.schema.spec import parse_spec
from kubernetes import client as k8s

from tests.operator.kubejobs import create_job, get_job, job_manifest, unit

NOW = 1_800_000_000
DAY = 86_400


def spec_of(units: list[dict[str, Any]], **extra: Any) -> Any:
    return parse_spec(job_manifest("gpt", units, **extra)["spec"])


def test_a_unit_declares_batch_times_context_times_accumulation_times_pods() -> None:
    spec = spec_of(
        [unit("a", replicas=2, batchSize=8), unit("b", tokensPerStep=4096), unit("c", replicas=0)],
        model={"blockSize": 256},
        train={"gradAccum": 4},
    )
    a, b, c = spec.learner_units
    assert unit_tokens_per_step(spec, a) == 8 * 256 * 4 * 2
    assert unit_tokens_per_step(spec, b) == 4096  # the unit says so (longer sequences than blockSize)
    assert unit_tokens_per_step(spec, c) == 16 * 256 * 4  # scaled to zero: still a valid claim


def _secret(claims: TokenClaims) -> dict[str, Any]:
    return {"metadata": {"annotations": claim_annotations(claims)}}


def test_when_a_token_is_minted_again() -> None:
    spec = spec_of([unit("a")])
    job = JobRef("gpt", "ns", "uid")
    held = unit_claims(job, spec, spec.learner_units[0], NOW)
    assert held.expires_at == NOW + DAY
    assert mint_reason(None, held, NOW) == "missing"
    assert mint_reason({"metadata": {}}, held, NOW) == "written without an expiry"
    assert (
        mint_reason(_secret(held), unit_claims(job, spec, spec.learner_units[0], NOW + DAY // 2 - 1), NOW)
        is None
    )
    later = NOW + DAY // 2 + 1
    assert "renewal" in str(
        mint_reason(_secret(held), unit_claims(job, spec, spec.learner_units[0], later), later)
    )
    raised = spec_of([unit("a", tokenGeneration=1)])
    assert "generation 0 -> 1" in str(
        mint_reason(_secret(held), unit_claims(job, raised, raised.learner_units[0], NOW), NOW)
    )
    bigger = spec_of([unit("a", batchSize=32)])
    assert "tokens per step" in str(
        mint_reason(_secret(held), unit_claims(job, bigger, bigger.learner_units[0], NOW), NOW)
    )
    paced = spec_of([unit("a", minStepTimeSeconds=0.5)])
    slow = unit_claims(job, paced, paced.learner_units[0], NOW)
    assert mint_reason(_secret(held), slow, NOW) == "step time unset -> 0.5"
    assert mint_reason(_secret(slow), held, NOW) == "step time 0.5 -> unset"
    assert mint_reason(_secret(slow), slow, NOW) is None
    before = {
        "metadata": {"annotations": {k: v for k, v in claim_annotations(held).items() if "min-step" not in k}}
    }
    assert mint_reason(before, held, NOW) is None  # minted before units declared a pace: still good


def test_a_units_step_time_is_in_its_token_and_only_sane_values_are_taken() -> None:
    spec = spec_of([unit("a", minStepTimeSeconds=0.25), unit("b")])
    job = JobRef("gpt", "ns", "uid")
    a, b = (unit_claims(job, spec, u, NOW) for u in spec.learner_units)
    assert (a.min_step_s, b.min_step_s) == (0.25, None)
    for bad in (0, -1, 3601, "fast"):
        with pytest.raises(Exception, match="minStepTimeSeconds"):
            spec_of([unit("a", minStepTimeSeconds=bad)])


def test_revocations_are_the_raised_generations_and_other_regions_learners() -> None:
    spec = spec_of(
        [unit("a", tokenGeneration=2), unit("b")],
        synchronizer={"minTokenGenerations": {"eu-x-0": 1}},
    )
    assert revocations(JobRef("gpt", "ns", "uid"), spec) == {"gpt-a-0": 2, "eu-x-0": 1}


@pytest.mark.integration
def test_tokens_are_minted_renewed_and_revoked_in_the_units_secret(
    api: k8s.ApiClient, namespace: str
) -> None:
    create_job(api, namespace, job_manifest("gpt", [unit("a", replicas=2)]))
    meta = get_job(api, namespace, "gpt")["metadata"]
    job, kube = JobRef("gpt", namespace, meta["uid"]), Kube(api)
    spec = spec_of([unit("a", replicas=2)])
    assert ensure_secret(kube, job, spec) == 1
    job_secret = secret_value(kube, namespace, "gpt-secret", "job-secret")
    assert job_secret

    def held() -> tuple[TokenClaims | None, str]:
        secret = k8s.CoreV1Api(api).read_namespaced_secret("gpt-a-token", namespace)
        token = base64.b64decode(secret.data["token"]).decode()
        return read_learner_token(job_secret, token), secret.metadata.resource_version

    assert ensure_learner_tokens(kube, job, spec, NOW) == 1
    first, version = held()
    assert first == TokenClaims("gpt-a-0", NOW, NOW + DAY, 0, 16 * 128 * 2)
    assert ensure_learner_tokens(kube, job, spec, NOW + DAY // 4) == 0  # nothing to do
    assert held()[1] == version

    assert ensure_learner_tokens(kube, job, spec, NOW + DAY // 2 + 60) == 1  # renewed in place
    renewed, _ = held()
    assert renewed is not None
    assert renewed.expires_at == NOW + DAY + DAY // 2 + 60

    revoked = spec_of([unit("a", replicas=2, tokenGeneration=1)])
    assert ensure_learner_tokens(kube, job, revoked, NOW + DAY // 2 + 120) == 1
    after, _ = held()
    assert after is not None
    assert after.generation == 1
    assert json.loads(json.dumps(revocations(job, revoked))) == {"gpt-a-0": 1}
