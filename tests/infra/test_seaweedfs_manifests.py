"""The storage objects of ``diloco_testbed.storage``, as data: SeaweedFS's Deployment and Service
fit together, the Secret holds the keys a job reads, and they are the storage the examples name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from diloco_testbed.storage import (
    BUCKET,
    ENDPOINT,
    IDENTITIES,
    SECRET,
    S3Credentials,
    build_bucket_pod,
    build_identities_secret,
    build_seaweedfs_deployment,
    build_seaweedfs_service,
    build_storage_secret,
    storage_namespaces,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "single-region.yaml"
CREDS = S3Credentials("AKEXAMPLE", "secret-example")


def test_the_single_region_example_names_this_storage() -> None:
    storage = yaml.safe_load(EXAMPLE.read_text())["spec"]["storage"]
    assert (storage["endpoint"], storage["bucket"], storage["credentialsSecretRef"]["name"]) == (
        ENDPOINT,
        BUCKET,
        SECRET,
    )


def test_the_service_reaches_the_deployment_s3_port() -> None:
    deployment, service = build_seaweedfs_deployment("seaweedfs:test"), build_seaweedfs_service()
    template = deployment["spec"]["template"]
    assert service["spec"]["selector"] == template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == template["metadata"]["labels"]
    (container,) = template["spec"]["containers"]
    assert container["image"] == "seaweedfs:test"
    (port,) = service["spec"]["ports"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == port["port"] == int(ENDPOINT.rsplit(":", 1)[1])
    assert f"-s3.port={port['port']}" in container["args"]


def test_seaweedfs_reads_the_identity_it_is_given() -> None:
    secret = build_identities_secret(CREDS)
    spec = build_seaweedfs_deployment("seaweedfs:test")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (container,) = spec["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "identities")
    assert volumes["identities"]["secret"]["secretName"] == secret["metadata"]["name"] == IDENTITIES
    (file_name,) = secret["stringData"]
    assert f"-s3.config={mount['mountPath']}/{file_name}" in container["args"]
    (identity,) = json.loads(secret["stringData"][file_name])["identities"]
    assert identity["credentials"] == [{"accessKey": "AKEXAMPLE", "secretKey": "secret-example"}]


def test_the_storage_secret_holds_the_keys_a_job_reads() -> None:
    secret = build_storage_secret(CREDS)
    assert secret["metadata"]["name"] == SECRET
    assert secret["stringData"] == {
        "AWS_ACCESS_KEY_ID": "AKEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "secret-example",
    }


def test_the_bucket_pod_uses_the_secret_and_the_endpoint() -> None:
    pod = build_bucket_pod("sync:test")
    (container,) = pod["spec"]["containers"]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert container["image"] == "sync:test"
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert refs == {k: {"name": SECRET, "key": k} for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    script = container["command"][-1]
    compile(script, "make-bucket", "exec")
    assert f"endpoint_url='{ENDPOINT}'" in script
    assert f"Bucket='{BUCKET}'" in script


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], []),
        (["default"], ["default"]),
        (["default,jobs"], ["default", "jobs"]),
        (["jobs", "default, jobs", ""], ["jobs", "default"]),
    ],
)
def test_storage_namespaces(values: list[str], expected: list[str]) -> None:
    assert storage_namespaces(values) == expected


@pytest.mark.parametrize("value", ["Default", "jobs_a", "-jobs", "a" * 64])
def test_storage_namespaces_refuses_what_kubernetes_would(value: str) -> None:
    with pytest.raises(ValueError, match="not namespace names"):
        storage_namespaces([value])
