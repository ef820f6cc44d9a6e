"""Least privilege, for real: ``diloco operator`` as a process, authenticated as a ServiceAccount
bound to a ClusterRole with exactly the rules of operator/rbac.yaml (the apiserver runs RBAC).

The job must reconcile completely (children, pods Running, status, events, a unit removed live)
and the operator's log must show no request refused for lack of permission, nor the job Secret.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from tests.operator.kubejobs import (
    ROOT,
    children,
    create_job,
    events,
    expected_children,
    get_job,
    job_manifest,
    learner_pods,
    patch_spec,
    phase_is,
    running_on_kwok,
    unit,
)
from tests.support.kube import Cluster
from tests.support.ports import free_port
from tests.support.process import ManagedProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

AUDIENCE = "https://kubernetes.default.svc.cluster.local"  # the test apiserver's issuer
# a 403 status as the clients log it ("(403)", "HTTP 403:", "Code: 403"), not digits of a
# timestamp (",403]"), a port or a uid
REFUSED = re.compile(r"(?<![\w,.:-])403(?!\w)|[Ff]orbidden")


def rbac_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load((ROOT / "operator" / "rbac.yaml").read_text())
    assert isinstance(rules, list), "operator/rbac.yaml must be a list of rules"
    assert rules
    return list(rules)


@pytest.fixture
def service_account_kubeconfig(kube: Cluster, api: k8s.ApiClient, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """A ServiceAccount bound to exactly the documented rules, and a kubeconfig with its token."""
    name = f"diloco-operator-{secrets.token_hex(4)}"
    core, rbac = k8s.CoreV1Api(api), k8s.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "diloco-operator"}})
    rbac.create_cluster_role({"metadata": {"name": name}, "rules": rbac_rules()})
    rbac.create_cluster_role_binding({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "diloco-operator", "namespace": namespace}],
    })
    try:
        request = k8s.AuthenticationV1TokenRequest(
            spec=k8s.V1TokenRequestSpec(audiences=[AUDIENCE], expiration_seconds=3600))
        token = core.create_namespaced_service_account_token("diloco-operator", namespace, request).status.token
        config = yaml.safe_load(Path(kube.kubeconfig).read_text())
        config["users"] = [{"name": "operator", "user": {"token": token}}]
        for ctx in config["contexts"]:
            ctx["context"]["user"] = "operator"
        path = tmp_path / "operator-kubeconfig.yaml"
        path.write_text(yaml.safe_dump(config))
        yield path
    finally:
        for delete in (rbac.delete_cluster_role_binding, rbac.delete_cluster_role):
            try:
                delete(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise


@pytest.fixture
def operator_process(service_account_kubeconfig: Path, test_logs_dir: Path) -> Iterator[tuple[ManagedProcess, int]]:
    live_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DILOCO_OPERATOR_", "KUBERNETES_SERVICE"))}
    env.update({
        "KUBECONFIG": str(service_account_kubeconfig),
        "DILOCO_OPERATOR_RESYNC_SECONDS": "2",
        "DILOCO_OPERATOR_METRICS_PORT": "0",
        "DILOCO_OPERATOR_SYNC_URL": "http://127.0.0.1:9",  # no synchronizer runs on kwok
    })
    argv = [sys.executable, "-m", "diloco", "operator", "--standalone", "--verbose",
            f"--liveness=http://127.0.0.1:{live_port}/healthz"]
    proc = ManagedProcess("operator", argv, test_logs_dir / "operator-rbac" / f"operator-{live_port}.log", env=env)
    proc.start()
    try:
        yield proc, live_port
    finally:
        proc.stop()


def refused_lines(proc: ManagedProcess) -> list[str]:
    return [line for line in proc.log_path.read_text(errors="replace").splitlines()
            if REFUSED.search(line)]


def test_operator_reconciles_with_exactly_the_documented_rules(
    api: k8s.ApiClient, namespace: str, service_account_kubeconfig: Path,
    operator_process: tuple[ManagedProcess, int],
) -> None:
    proc, live_port = operator_process
    # The token really is the ServiceAccount's: what the rules do not grant is refused.
    with k8s_config.new_client_from_config(config_file=str(service_account_kubeconfig)) as sa_api:
        with pytest.raises(ApiException) as denied:
            k8s.CoreV1Api(sa_api).list_namespaced_secret(namespace)
        assert denied.value.status == 403

    core = k8s.CoreV1Api(api)
    core.create_namespaced_secret(namespace, {
        "metadata": {"name": "s3-creds"},
        "stringData": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "key"},
    })
    storage = {"bucket": "diloco-test", "credentialsSecretRef": {"name": "s3-creds"}}
    create_job(api, namespace, job_manifest("least", [unit("a", 2), unit("b")], storage=storage))
    wait_for(lambda: children(api, namespace, "least") == expected_children("least", ["a", "b"]), timeout=90,
             what="all children", describe=lambda: f"{children(api, namespace, 'least')}\n{proc.log_tail()}")
    wait_for(lambda: running_on_kwok(learner_pods(api, namespace, "least"), 3), timeout=90, what="3 pods Running")
    wait_for(lambda: phase_is(api, namespace, "least", "Running", "2/2"), timeout=60, what="phase Running",
             describe=lambda: f"{get_job(api, namespace, 'least').get('status')}\n{proc.log_tail()}")
    wait_for(lambda: "Running" in events(api, namespace, "least"), timeout=30, what="the Running event")
    live = httpx.get(f"http://127.0.0.1:{live_port}/healthz", timeout=5)
    assert (live.status_code, live.json().get("api")) == (200, "ok")

    # A live change: unit b removed (list and delete), a deleted child restored (get and patch).
    patch_spec(api, namespace, "least", {"learnerUnits": [unit("a", 2)]})
    wait_for(lambda: children(api, namespace, "least") == expected_children("least", ["a"]), timeout=60,
             what="unit b pruned", describe=lambda: f"{children(api, namespace, 'least')}\n{proc.log_tail()}")
    core.delete_namespaced_service("least-a", namespace)
    wait_for(lambda: core.read_namespaced_service("least-a", namespace), timeout=30, what="Service restored")
    wait_for(lambda: phase_is(api, namespace, "least", "Running", "1/1"), timeout=60, what="Running 1/1")

    assert proc.running(), proc.failure_report()
    log = proc.log_path.read_text(errors="replace")
    # The log holds the operator's work, so a refused request would be in it too.
    assert "created StatefulSet least-a" in log
    assert "deleted StatefulSet least-b" in log
    assert refused_lines(proc) == []
    # The job Secret it generated never shows in its (verbose) log, neither plain nor as stored.
    stored = core.read_namespaced_secret("least-secret", namespace).data
    assert stored
    for encoded in stored.values():
        plain = base64.b64decode(encoded).decode()
        assert len(plain) >= 16
        assert plain not in log
        assert encoded not in log
