"""The S3 endpoint URL that a job's storage is reached at: the one check that the operator's spec,
the settings and the storage opened from ``AWS_ENDPOINT_URL`` apply, so that a URL the S3 client
cannot use (``seaweedfs:8333``, without its scheme) is refused where it is given, with what to write
instead, rather than when a pod first reaches the storage."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

# http:// or https:// (any case), a host (a name, an IPv4 address or a bracketed IPv6 address), an
# optional port and an optional path; the CRD's rule of storage.endpoint matches the same pattern
ENDPOINT_URL_PATTERN = r"^[Hh][Tt][Tt][Pp][Ss]?://(\[[0-9A-Fa-f:.]+\]|[^\s/?#:@\[\]]+)(:[0-9]{1,5})?(/\S*)?$"
# what a refused URL is told (after its repr); the CRD's rule says the same
ENDPOINT_URL_EXPECTED = (
    "is not an S3 endpoint: expected an http:// or https:// URL with a host "
    "(http://seaweedfs:8333, https://s3.example.com)"
)


def check_endpoint_url(url: str) -> str:
    """``url`` if it is an http:// or https:// URL with a host; else ValueError saying so."""
    if re.fullmatch(ENDPOINT_URL_PATTERN, url) is None:
        raise ValueError(f"{url!r} {ENDPOINT_URL_EXPECTED}")
    return url


# a setting that holds an S3 endpoint URL
EndpointUrl = Annotated[str, AfterValidator(check_endpoint_url)]
