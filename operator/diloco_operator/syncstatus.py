"""Reading the synchronizer's ``GET /v1/status`` (per-unit progress, versions, tokens)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
from diloco_core.protocol import API_PREFIX, StatusResponse
from pydantic import ValidationError

log = logging.getLogger(__name__)


def http_fetcher(timeout: float) -> Callable[[str], StatusResponse | None]:
    """A fetcher that returns None when the synchronizer is unreachable or answers nonsense."""

    def fetch(base_url: str) -> StatusResponse | None:
        url = f"{base_url.rstrip('/')}{API_PREFIX}/status"
        try:
            resp = httpx.get(url, timeout=timeout)
            resp.raise_for_status()
            return StatusResponse.model_validate_json(resp.content)
        except (httpx.HTTPError, ValidationError) as exc:
            log.debug("synchronizer status unavailable at %s: %s", url, exc)
            return None

    return fetch
