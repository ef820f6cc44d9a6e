"""How much of the server one learner may hold at once: its requests in progress, and among them its
uploads (codec payload bodies, which may arrive slowly). One more is answered 429
``too_many_requests`` (retryable, ``Retry-After``) before its body is read, so one learner with a
valid token cannot take the connections the others and the health probes need.

A learner needs one upload per synchronizer shard at a time (its sends are queued), a long-poll per
fragment and a heartbeat: the default request limit is twice the fragments plus a margin.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from diloco_core.protocol import ErrorBody
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .auth import AUTHENTICATED_LEARNER

REQUEST_MARGIN = 16


def default_max_requests(fragments: int) -> int:
    """The requests one learner may have in progress: a long-poll per fragment, twice, and a margin."""
    return 2 * fragments + REQUEST_MARGIN


def over_limit(
    requests: int, uploads: int, *, upload: bool, max_requests: int, max_uploads: int
) -> str | None:
    """Why one more request (an upload when ``upload``) of a learner that has ``requests`` in
    progress, ``uploads`` of them uploads, is refused (None: it is served)."""
    if requests >= max_requests:
        return f"{requests} requests of this learner are in progress (at most {max_requests})"
    if upload and uploads >= max_uploads:
        return f"{uploads} uploads of this learner are in progress (at most {max_uploads})"
    return None


class PerLearnerLimits:
    """ASGI middleware, after authentication: counts each learner's requests in progress."""

    def __init__(
        self, app: ASGIApp, *, max_requests: int, max_uploads: int, is_upload: Callable[[str], bool]
    ) -> None:
        self.app = app
        self.max_requests, self.max_uploads, self.is_upload = max_requests, max_uploads, is_upload
        self.requests: Counter[str] = Counter()
        self.uploads: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        learner = scope.get("state", {}).get(AUTHENTICATED_LEARNER) if scope["type"] == "http" else None
        if learner is None:
            await self.app(scope, receive, send)
            return
        upload = scope["method"] in ("POST", "PUT") and self.is_upload(scope["path"])
        reason = over_limit(
            self.requests[learner],
            self.uploads[learner],
            upload=upload,
            max_requests=self.max_requests,
            max_uploads=self.max_uploads,
        )
        if reason is not None:
            body = ErrorBody(code="too_many_requests", reason=reason, retryable=True)
            await JSONResponse(body.model_dump(), status_code=429, headers={"Retry-After": "1"})(
                scope, receive, send
            )
            return
        self.requests[learner] += 1
        self.uploads[learner] += upload
        try:
            await self.app(scope, receive, send)
        finally:
            self.requests[learner] -= 1
            self.uploads[learner] -= upload
            if self.requests[learner] <= 0:
                del self.requests[learner]
                self.uploads.pop(learner, None)
