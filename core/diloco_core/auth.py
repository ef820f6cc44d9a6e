"""Learner tokens: each learner presents a token bound to its identity, derived from the job secret.

The synchronizer holds only the job secret and recomputes the token of the learner a request claims
to come from, so a token stolen from one learner cannot be replayed as another.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TOKEN_CONTEXT = b"diloco-learner-token-v1:"


def learner_token(job_secret: str, learner_id: str) -> str:
    """Hex HMAC-SHA256 of the learner id under the job secret."""
    if not job_secret:
        raise ValueError("job secret is empty")
    if not learner_id:
        raise ValueError("learner id is empty")
    mac = hmac.new(job_secret.encode(), TOKEN_CONTEXT + learner_id.encode(), hashlib.sha256)
    return mac.hexdigest()


def verify_learner_token(job_secret: str, learner_id: str, token: str) -> bool:
    """Constant-time check that ``token`` belongs to ``learner_id``."""
    if not job_secret or not learner_id or not token:
        return False
    expected = learner_token(job_secret, learner_id)
    return hmac.compare_digest(expected.encode(), token.encode())


def new_job_secret() -> str:
    """A fresh random job secret (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)
