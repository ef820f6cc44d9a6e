"""The learner tokens of a job's units (pure): what each unit's token claims, when the operator
mints it again, and the revocations the job's synchronizer applies.

A unit's token names its leader, declares the most tokens the unit trains on per step (batch x
context x accumulation x pods, or the unit's ``tokensPerStep``) and, where set, the fastest its
step can be (``minStepTimeSeconds``), carries the unit's ``tokenGeneration`` and expires
``synchronizer.tokenLifetimeSeconds`` after it was minted. The operator mints it again when the
generation, the tokens per step or the step time change, and when less than half its life is left,
into the same Secret; the pods read it from the mounted Secret, which the kubelet updates in place,
so a renewal restarts nothing. A raised generation revokes the older tokens: the synchronizer
refuses them from when its revocations file (the ``<job>-revocations`` ConfigMap) carries the new
generation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from diloco_core.auth import TokenClaims

from diloco_operator.builders.names import JobRef, unit_leader_id
from diloco_operator.schema.spec import DiLoCoJobSpec, LearnerUnit

GENERATION_ANNOTATION = "diloco.dev/token-generation"
TOKENS_PER_STEP_ANNOTATION = "diloco.dev/tokens-per-step"
EXPIRES_ANNOTATION = "diloco.dev/token-expires"
MIN_STEP_ANNOTATION = "diloco.dev/min-step-time"


def unit_tokens_per_step(spec: DiLoCoJobSpec, unit: LearnerUnit) -> int:
    """The most tokens one step of the unit trains on: what its token declares."""
    if unit.tokens_per_step is not None:
        return unit.tokens_per_step
    return unit.batch_size * spec.model.block_size * spec.train.grad_accum * max(unit.replicas, 1)


def unit_claims(job: JobRef, spec: DiLoCoJobSpec, unit: LearnerUnit, now: int) -> TokenClaims:
    """The claims of the unit's token minted at ``now`` (unix seconds)."""
    return TokenClaims(
        learner=unit_leader_id(job.name, unit.name),
        issued_at=now,
        expires_at=now + spec.synchronizer.token_lifetime_seconds,
        generation=unit.token_generation,
        tokens_per_step=unit_tokens_per_step(spec, unit),
        min_step_s=unit.min_step_time_seconds,
    )


def claim_annotations(claims: TokenClaims) -> dict[str, str]:
    """What the token Secret says of its token (read back by ``mint_reason``, never secret)."""
    return {
        GENERATION_ANNOTATION: str(claims.generation),
        TOKENS_PER_STEP_ANNOTATION: str(claims.tokens_per_step),
        EXPIRES_ANNOTATION: str(claims.expires_at),
        MIN_STEP_ANNOTATION: _pace(claims.min_step_s),
    }


def _pace(min_step_s: float | None) -> str:
    return "" if min_step_s is None else repr(min_step_s)


def mint_reason(secret: Mapping[str, Any] | None, wanted: TokenClaims, now: int) -> str | None:
    """Why the unit's token must be minted (again) now, or None: no Secret, a Secret written before
    tokens expired, another generation or tokens per step, or less than half its life left."""
    if secret is None:
        return "missing"
    notes = (secret.get("metadata") or {}).get("annotations") or {}
    try:
        generation = int(notes[GENERATION_ANNOTATION])
        per_step = int(notes[TOKENS_PER_STEP_ANNOTATION])
        expires = int(notes[EXPIRES_ANNOTATION])
    except (KeyError, ValueError):
        return "written without an expiry"
    if generation != wanted.generation:
        return f"generation {generation} -> {wanted.generation}"
    if per_step != wanted.tokens_per_step:
        return f"tokens per step {per_step} -> {wanted.tokens_per_step}"
    pace = notes.get(MIN_STEP_ANNOTATION, "")  # a Secret minted before units declared a pace: none
    if pace != _pace(wanted.min_step_s):
        return f"step time {pace or 'unset'} -> {_pace(wanted.min_step_s) or 'unset'}"
    assert wanted.expires_at is not None
    lifetime = wanted.expires_at - now
    if expires - now < lifetime // 2:
        return "renewal (less than half its life left)"
    return None


def revocations(job: JobRef, spec: DiLoCoJobSpec) -> dict[str, int]:
    """The lowest token generation the job's synchronizer accepts per learner: each unit's
    ``tokenGeneration`` where raised, and ``synchronizer.minTokenGenerations`` (other regions' units)."""
    own = {
        unit_leader_id(job.name, u.name): u.token_generation for u in spec.learner_units if u.token_generation
    }
    return {**spec.synchronizer.min_token_generations, **own}


def revocations_text(job: JobRef, spec: DiLoCoJobSpec) -> str:
    return json.dumps(revocations(job, spec), sort_keys=True)
