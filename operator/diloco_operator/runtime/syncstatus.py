"""Reading the synchronizer's ``GET /v1/status`` (per-unit progress, versions, tokens)."""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import httpx
from diloco_core.protocol import API_PREFIX, StatusResponse
from pydantic import ValidationError

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def _trusting(ca_pem: str) -> ssl.SSLContext:
    """A client context trusting ``ca_pem``, as strict as the learners' (``VERIFY_X509_STRICT``)."""
    context = ssl.create_default_context(cadata=ca_pem)
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    return context


def http_fetcher(timeout: float) -> Callable[[str, str | None], StatusResponse | None]:
    """A fetcher that returns None when the synchronizer is unreachable or answers nonsense;
    ``fetch(url, ca_pem)`` checks an https synchronizer's certificate against ``ca_pem`` (a PEM CA
    bundle), or against the public certificate authorities when it is None."""

    def fetch(base_url: str, ca_pem: str | None = None) -> StatusResponse | None:
        url = f"{base_url.rstrip('/')}{API_PREFIX}/status"
        try:
            verify = _trusting(ca_pem) if ca_pem else True
            resp = httpx.get(url, timeout=timeout, verify=verify)
            resp.raise_for_status()
            return StatusResponse.model_validate_json(resp.content)
        except (httpx.HTTPError, ValidationError, ssl.SSLError) as exc:
            log.debug("synchronizer status unavailable at %s: %s", url, exc)
            return None

    return fetch


def redacted_url(url: str) -> str:
    """``url`` as a status message may show it: without user info, query or fragment, which may
    carry credentials."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
