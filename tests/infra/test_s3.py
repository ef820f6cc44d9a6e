"""The S3 test server is a real SeaweedFS that stores objects and checks credentials."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from botocore.exceptions import ClientError
from diloco_testbed.s3_server import S3Server, bucket_name


@pytest.mark.integration
def test_object_round_trip(s3: S3Server) -> None:
    client = s3.client()
    bucket = s3.new_bucket()
    payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
    client.put_object(Bucket=bucket, Key="dir/blob.bin", Body=payload)
    assert client.get_object(Bucket=bucket, Key="dir/blob.bin")["Body"].read() == payload
    listed = client.list_objects_v2(Bucket=bucket, Prefix="dir/")
    assert [o["Key"] for o in listed["Contents"]] == ["dir/blob.bin"]


@pytest.mark.integration
def test_new_buckets_are_distinct_and_valid(s3: S3Server) -> None:
    first, second = s3.new_bucket(), s3.new_bucket()
    assert first != second
    for name in (first, second):
        assert 3 <= len(name) <= 63
        assert name == name.lower()
    names = {b["Name"] for b in s3.client().list_buckets()["Buckets"]}
    assert {first, second} <= names


@pytest.mark.integration
@pytest.mark.parametrize(
    ("which", "expected"),
    [("wrong secret", "SignatureDoesNotMatch"), ("unknown key", "InvalidAccessKeyId")],
)
def test_wrong_credentials_are_refused(s3: S3Server, which: str, expected: str) -> None:
    bucket = s3.new_bucket()
    s3.client().put_object(Bucket=bucket, Key="secret", Body=b"x")
    if which == "wrong secret":
        intruder = s3.client(secret_key=s3.secret_key + "x", max_attempts=1)
    else:
        intruder = s3.client(access_key="AKNOBODY0000", max_attempts=1)
    with pytest.raises(ClientError) as info:
        intruder.get_object(Bucket=bucket, Key="secret")
    assert info.value.response["Error"]["Code"] == expected
    with pytest.raises(ClientError) as info:
        intruder.put_object(Bucket=bucket, Key="planted", Body=b"y")
    assert info.value.response["Error"]["Code"] == expected


@pytest.mark.integration
def test_dedicated_server_survives_restart(s3_server_factory: Callable[[], S3Server]) -> None:
    server = s3_server_factory()
    bucket = server.new_bucket()
    server.client().put_object(Bucket=bucket, Key="k", Body=b"kept")
    endpoint = server.endpoint_url

    server.stop()
    assert not server.running()
    with pytest.raises(Exception, match="(?i)connect"):
        server.client(max_attempts=1, connect_timeout=1).get_object(Bucket=bucket, Key="k")

    server.start()
    assert server.endpoint_url == endpoint
    assert server.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"kept"


def test_bucket_names_are_valid() -> None:
    names = {bucket_name() for _ in range(100)}
    assert len(names) == 100
    assert all(3 <= len(n) <= 63 and n.replace("-", "").isalnum() and n == n.lower() for n in names)
