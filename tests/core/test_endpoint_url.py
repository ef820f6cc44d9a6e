"""The S3 endpoint URL: refused without its scheme or host, with the value and what to write, in the
settings (StorageSettings) and when opening storage from the standard AWS variables."""

from __future__ import annotations

import re

import pytest
from diloco_core.config import StorageSettings
from diloco_core.endpoint_url import ENDPOINT_URL_PATTERN, check_endpoint_url
from diloco_core.storage import S3Store, open_store
from pydantic import ValidationError

EXPECTED = "is not an S3 endpoint: expected an http:// or https:// URL with a host"


@pytest.mark.parametrize(
    "url",
    [
        "http://seaweedfs:8333",
        "http://seaweedfs.storage.svc.cluster.local:8333/",
        "https://s3.us-east-1.amazonaws.com",
        "HTTPS://S3.EXAMPLE.COM",
        "http://10.0.0.7:9000",
        "http://[::1]:9000",
        "https://storage.example.com/s3",
    ],
)
def test_endpoints_the_s3_client_can_use(url: str) -> None:
    assert check_endpoint_url(url) == url
    assert StorageSettings(url="s3://b", endpoint_url=url).endpoint_url == url


@pytest.mark.parametrize(
    "url",
    [
        "seaweedfs:8333",
        "seaweedfs",
        "s3.amazonaws.com",
        "ftp://host:21",
        "s3://bucket",
        "http://",
        "http://:8333",
        "http:/seaweedfs:8333",
        "http://seaweed fs:8333",
        "http://seaweedfs:port",
        "http://seaweedfs:8333\n",
        "",
    ],
)
def test_endpoints_it_cannot_are_refused_with_the_value_and_what_to_write(url: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{url!r} {EXPECTED}")) as refused:
        check_endpoint_url(url)
    assert "http://seaweedfs:8333" in str(refused.value)  # an example of what to write
    with pytest.raises(ValidationError, match="endpoint_url"):
        StorageSettings(url="s3://b", endpoint_url=url)


def test_the_pattern_is_anchored() -> None:
    """The CRD's rule (CEL's ``matches``) searches the value: the pattern must hold for all of it."""
    assert ENDPOINT_URL_PATTERN.startswith("^")
    assert ENDPOINT_URL_PATTERN.endswith("$")


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_storage_opened_from_the_aws_variables_refuses_an_endpoint_without_scheme(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv(variable, "seaweedfs:8333")
    with pytest.raises(ValueError, match="^" + re.escape(f"{variable}: 'seaweedfs:8333' {EXPECTED}")):
        open_store("s3://bucket/prefix")
    monkeypatch.setenv(variable, "http://seaweedfs:8333")
    assert isinstance(open_store("s3://bucket/prefix"), S3Store)


def test_storage_opened_with_an_endpoint_refuses_one_without_scheme() -> None:
    with pytest.raises(ValueError, match="^" + re.escape(f"endpoint: 'seaweedfs:8333' {EXPECTED}")):
        open_store("s3://bucket", endpoint_url="seaweedfs:8333")
