"""check_spec against a real apiserver: every Secret and ConfigMap key the spec names must exist."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_operator.builders.names import JobRef
from diloco_operator.kube import Kube
from diloco_operator.runtime.checks import check_spec
from diloco_operator.schema.spec import SpecError
from kubernetes import client as k8s

from tests.operator.kubejobs import job_manifest, unit

pytestmark = pytest.mark.integration

SYNCHRONIZER = {
    "external": {"url": "https://sync.example.invalid", "jobId": "home",
                 "tokenSecretRef": {"name": "home-token", "key": "job-secret"}},
    "ca": {"configMapName": "home-ca"},
}  # fmt: skip


@pytest.mark.parametrize(
    ("secret", "config_map", "error"),
    [
        (None, None, "Secret 'home-token' referenced by the spec does not exist in namespace {ns}"),
        ({"other": "x"}, None, "Secret 'home-token' has no key 'job-secret' that the spec refers to"),
        (
            {"job-secret": "x"},
            None,
            "ConfigMap 'home-ca' referenced by the spec does not exist in namespace {ns}",
        ),
        (
            {"job-secret": "x"},
            {"other": "x"},
            "ConfigMap 'home-ca' has no key 'ca.crt' that the spec refers to",
        ),
        ({"job-secret": "x"}, {"ca.crt": "x"}, None),
    ],
)
def test_the_secret_and_config_map_keys_the_spec_names_must_exist(
    api: k8s.ApiClient, namespace: str, secret: dict[str, str] | None, config_map: dict[str, str] | None,
    error: str | None,
) -> None:  # fmt: skip
    core = k8s.CoreV1Api(api)
    if secret is not None:
        core.create_namespaced_secret(namespace, {"metadata": {"name": "home-token"}, "stringData": secret})
    if config_map is not None:
        core.create_namespaced_config_map(namespace, {"metadata": {"name": "home-ca"}, "data": config_map})
    raw: dict[str, Any] = job_manifest("eu", [unit("a")], synchronizer=SYNCHRONIZER)["spec"]
    job = JobRef("eu", namespace, "uid")
    if error is None:
        assert check_spec(Kube(api), job, raw).synchronizer.ca is not None
        return
    with pytest.raises(SpecError) as raised:
        check_spec(Kube(api), job, raw)
    assert str(raised.value) == error.format(ns=namespace)
