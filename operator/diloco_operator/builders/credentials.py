"""The job's credentials as children: the job secret, each unit's token Secret and the revocations
ConfigMap the synchronizer reads."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from diloco_operator.builders import env
from diloco_operator.builders.names import (
    UNIT_LABEL,
    JobRef,
    learner_token_secret_name,
    metadata,
    revocations_name,
    secret_name,
)


def build_learner_token_secret(
    job: JobRef, unit: str, token: str, annotations: Mapping[str, str]
) -> dict[str, Any]:
    """The unit's learner token (its leader's), the only credential its pods get; ``annotations``
    say what the token claims (``tokens.claim_annotations``)."""
    meta = metadata(job, learner_token_secret_name(job.name, unit), "learner-token", **{UNIT_LABEL: unit})
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta | {"annotations": dict(annotations)},
        "type": "Opaque",
        "data": {env.LEARNER_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_revocations_config_map(job: JobRef, revocations_json: str) -> dict[str, Any]:
    """The lowest learner-token generation the job's synchronizer accepts per learner, mounted into
    its pods and re-read there when it changes (a change restarts nothing)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, revocations_name(job.name), "revocations"),
        "data": {env.REVOCATIONS_KEY: revocations_json},
    }


def build_secret(job: JobRef, job_secret: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(job, secret_name(job.name), "secret"),
        "type": "Opaque",
        "stringData": {env.JOB_SECRET_KEY: job_secret},
    }
