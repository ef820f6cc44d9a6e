"""A job whose synchronizer serves HTTPS (``synchronizer.tls``) and learners that trust a CA bundle
(``synchronizer.ca``): the children that carry them, the spec's rules, and the operator reading an
https synchronizer's status with that bundle."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.builders.children import build_children
from diloco_operator.builders.names import JobRef
from diloco_operator.runtime.syncstatus import http_fetcher
from diloco_operator.schema.references import config_map_references, secret_references
from diloco_operator.schema.spec import SpecError, parse_spec
from diloco_testbed.pki import issue_server_cert, make_ca

from tests.operator.builders.test_children import by_kind, env_of
from tests.operator.runtime.test_syncstatus import STATUS, Handler
from tests.operator.schema.test_crd import schema
from tests.operator.schema.test_spec import raw

JOB = JobRef("ra", "ml", "u")
TLS = {"tls": {"secretName": "ra-sync-tls"}, "ca": {"secretName": "ra-sync-tls"}}


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return dict(obj["spec"]["template"]["spec"]["containers"][0])


def _volumes(obj: dict[str, Any]) -> dict[str, Any]:
    return {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}


def test_a_synchronizer_with_a_certificate_serves_https_to_learners_that_trust_its_ca() -> None:
    spec = parse_spec(raw(synchronizer={**TLS, "shards": 2}, diloco={"fragments": 2}))
    children = build_children(JOB, spec)
    deployments, services = by_kind(children, "Deployment"), by_kind(children, "Service")
    sync, sts = deployments[0], by_kind(children, "StatefulSet")[0]

    env = env_of(sync)
    assert env["DILOCO_TLS_CERT"] == "/etc/diloco-tls/tls.crt"
    assert env["DILOCO_TLS_KEY"] == "/etc/diloco-tls/tls.key"
    assert env["DILOCO_SHARD_URLS"] == "https://ra-sync.ml.svc:8080,https://ra-sync-1.ml.svc:8080"
    # only the certificate and the key reach the synchronizer, nothing else of the Secret
    assert _volumes(sync)["tls"]["secret"]["secretName"] == "ra-sync-tls"
    assert [i["key"] for i in _volumes(sync)["tls"]["secret"]["items"]] == ["tls.crt", "tls.key"]
    container = _container(sync)
    assert {"name": "tls", "mountPath": "/etc/diloco-tls", "readOnly": True} in container["volumeMounts"]
    assert container["ports"] == [{"name": "https", "containerPort": 8080}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
        assert container[probe]["httpGet"]["port"] == "https"
    sync_services = [s for s in services if s["metadata"]["name"].startswith("ra-sync")]
    assert len(sync_services) == 2
    assert all(s["spec"]["ports"][0]["name"] == "https" for s in sync_services)

    env = env_of(sts)
    assert env["DILOCO_SYNC_URL"] == "https://ra-sync.ml.svc:8080"
    assert env["DILOCO_SYNC_CA_FILE"] == "/etc/diloco-sync-ca/ca.crt"
    # the learners get the CA bundle only: never the private key of the same Secret
    assert _volumes(sts)["sync-ca"]["secret"] == {"secretName": "ra-sync-tls",
                                                  "items": [{"key": "ca.crt", "path": "ca.crt"}]}  # fmt: skip
    assert "tls" not in _volumes(sts)
    assert secret_references(spec)[-3:] == [("ra-sync-tls", "tls.crt"), ("ra-sync-tls", "tls.key"),
                                            ("ra-sync-tls", "ca.crt")]  # fmt: skip


def test_learners_of_an_external_https_synchronizer_trust_a_config_map_bundle() -> None:
    external = {"url": "https://10.236.0.1:8443", "jobId": "ra", "tokenSecretRef": {"name": "t", "key": "k"}}
    spec = parse_spec(
        raw(synchronizer={"external": external, "ca": {"configMapName": "ra-ca", "key": "bundle.pem"}})
    )
    children = build_children(JobRef("rb", "ml", "u"), spec)
    assert not by_kind(children, "Deployment")
    sts = by_kind(children, "StatefulSet")[0]
    assert env_of(sts)["DILOCO_SYNC_URL"] == "https://10.236.0.1:8443"
    assert env_of(sts)["DILOCO_SYNC_CA_FILE"] == "/etc/diloco-sync-ca/ca.crt"
    assert _volumes(sts)["sync-ca"]["configMap"] == {
        "name": "ra-ca",
        "items": [{"key": "bundle.pem", "path": "ca.crt"}],
    }
    assert config_map_references(spec) == [("ra-ca", "bundle.pem")]


def test_a_plain_job_is_unchanged() -> None:
    children = build_children(JOB, parse_spec(raw()))
    sync, sts = by_kind(children, "Deployment")[0], by_kind(children, "StatefulSet")[0]
    assert "scheme" not in _container(sync)["livenessProbe"]["httpGet"]
    assert set(_volumes(sync)) == {"config", "tmp", "revocations"}
    assert set(_volumes(sts)) == {"config", "tmp", "learner-token"}
    assert "DILOCO_SYNC_CA_FILE" not in env_of(sts)
    assert env_of(sts)["DILOCO_SYNC_URL"] == "http://ra-sync.ml.svc:8080"


@pytest.mark.parametrize(("synchronizer", "message"), [
    ({"ca": {"secretName": "a", "configMapName": "b"}}, "exactly one"),
    ({"tls": {"secretName": "x"}, "ca": {}}, "exactly one"),
    ({"ca": {"configMapName": "b"}}, "reached over HTTPS"),
    ({"external": {"url": "http://s", "tokenSecretRef": {"name": "t", "key": "k"}, "insecure": True},
      "ca": {"configMapName": "b"}}, "reached over HTTPS"),
    ({"external": {"url": "http://s", "tokenSecretRef": {"name": "t", "key": "k"}}}, "must be https://"),
    ({"external": {"url": "https://s", "tokenSecretRef": {"name": "t", "key": "k"}}, "tls": {"secretName": "x"}},
     "not with external"),
])  # fmt: skip
def test_tls_settings_that_cannot_work_are_refused(synchronizer: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec(raw(synchronizer=synchronizer))


def test_the_crd_refuses_the_same_at_admission() -> None:
    sync = schema()["properties"]["spec"]["properties"]["synchronizer"]
    assert "!(has(self.tls) && has(self.external))" in {r["rule"] for r in sync["x-kubernetes-validations"]}
    ca_rules = {r["rule"] for r in sync["properties"]["ca"]["x-kubernetes-validations"]}
    assert "has(self.secretName) != has(self.configMapName)" in ca_rules
    assert sync["properties"]["ca"]["properties"]["key"]["default"] == "ca.crt"
    assert sync["properties"]["tls"]["required"] == ["secretName"]


@pytest.fixture
def https_server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The status endpoint over HTTPS; yields its URL and the PEM of the CA that signed it."""
    ca = make_ca(tmp_path / "ca")
    cert, key = issue_server_cert(ca, tmp_path, "status", ["127.0.0.1"])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}", ca.cert.read_text()
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.integration
def test_the_operator_reads_an_https_status_with_the_bundle_only(
    https_server: tuple[str, str], tmp_path: Path
) -> None:
    url, ca_pem = https_server
    fetch = http_fetcher(timeout=5.0)
    assert fetch(f"{url}/ok", ca_pem) == STATUS
    assert fetch(f"{url}/ok", None) is None  # the public CAs do not know this one
    other = make_ca(tmp_path / "other", "another-ca").cert.read_text()
    assert fetch(f"{url}/ok", other) is None
    assert fetch(f"{url}/ok", "not a certificate") is None


def test_the_example_with_tls_is_a_valid_pair() -> None:
    docs = [d for d in yaml.safe_load_all((Path(__file__).resolve().parents[3] / "examples" / "multi-region.yaml")
                                          .read_text()) if d]  # fmt: skip
    a, b = (parse_spec(d["spec"]) for d in docs)
    assert a.synchronizer.tls is not None
    assert a.synchronizer.https
    assert b.synchronizer.external is not None
    assert b.synchronizer.https
    assert b.synchronizer.ca is not None
