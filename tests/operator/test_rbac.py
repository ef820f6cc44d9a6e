"""Least privilege, for real: ``diloco operator`` as a process, authenticated as the chart's own
ServiceAccount (a token for it) with the RBAC the chart installs, in both of the chart's modes:
every namespace (a ClusterRole with exactly the rules of operator/rbac.yaml) and named namespaces
(a Role in each, nothing cluster-wide). The operator runs with the arguments and variables of the
chart's Deployment (the chart is installed with ``operator.replicas=0``, so only this process acts).

The job must reconcile completely (children, pods Running, status, events, a unit removed live)
and the operator's log must show no request refused for lack of permission, nor the job Secret.
"""

from __future__ import annotations

import base64
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from diloco_testbed.kube import Cluster
from diloco_testbed.process import ManagedProcess
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from tests.charts.helm import CHART, helm, values_args
from tests.operator.kubejobs import (
    children,
    create_job,
    events,
    expected_children,
    get_job,
    job_manifest,
    learner_pods,
    operator_process,
    patch_spec,
    phase_is,
    running_on_kwok,
    unit,
)

pytestmark = [pytest.mark.integration, pytest.mark.kwok]

AUDIENCE = "https://kubernetes.default.svc.cluster.local"  # the test apiserver's issuer
# a 403 status as the clients log it ("(403)", "HTTP 403:", "Code: 403"), not digits of a
# timestamp (",403]"), a port or a uid; and kopf's own words for a refusal it works around
REFUSED = re.compile(r"(?<![\w,.:-])403(?!\w)|[Ff]orbidden|[Nn]ot enough permissions")


@dataclass
class ChartOperator:
    proc: ManagedProcess
    live_port: int
    kubeconfig: Path
    account: str  # the ServiceAccount, namespace/name
    jobs: str  # the namespace the test's job lives in


@pytest.fixture
def jobs_namespace(kube: Cluster) -> Iterator[str]:
    name = kube.create_namespace("t-rbac-jobs")
    try:
        yield name
    finally:
        kube.delete_namespace(name)


def token_kubeconfig(kube: Cluster, api: k8s.ApiClient, namespace: str, account: str, path: Path) -> Path:
    request = k8s.AuthenticationV1TokenRequest(
        spec=k8s.V1TokenRequestSpec(audiences=[AUDIENCE], expiration_seconds=3600)
    )
    token = (
        k8s.CoreV1Api(api).create_namespaced_service_account_token(account, namespace, request).status.token
    )
    config = yaml.safe_load(Path(kube.kubeconfig).read_text())
    config["users"] = [{"name": "operator", "user": {"token": token}}]
    for ctx in config["contexts"]:
        ctx["context"]["user"] = "operator"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(params=["every-namespace", "named-namespaces"])
def chart_operator(
    request: pytest.FixtureRequest,
    kube: Cluster,
    api: k8s.ApiClient,
    namespace: str,
    jobs_namespace: str,
    tmp_path: Path,
    test_logs_dir: Path,
) -> Iterator[ChartOperator]:
    """The chart installed in ``namespace`` (its RBAC, no operator pod), and ``diloco operator`` run
    as the chart's ServiceAccount with the chart's Deployment's arguments and variables."""
    named = request.param == "named-namespaces"
    release = f"rbac-{secrets.token_hex(3)}"
    values = {
        "operator": {"replicas": 0},
        "peering": {"name": f"rbac-{secrets.token_hex(4)}"},
        "watchNamespaces": [jobs_namespace] if named else [],
    }
    installed = helm(
        "install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        *values_args(tmp_path, values),
        env=kube.env(),
    )
    assert installed.returncode == 0, installed.stderr
    proc = None
    try:
        fullname = f"{release}-diloco"
        container = (
            k8s.AppsV1Api(api)
            .read_namespaced_deployment(f"{fullname}-operator", namespace)
            .spec.template.spec.containers[0]
        )
        args = [a for a in container.args if not a.startswith("--liveness=")]
        chart_env = {e.name: e.value for e in container.env if e.name.startswith("DILOCO_OPERATOR_")}
        kubeconfig = token_kubeconfig(kube, api, namespace, fullname, tmp_path / "operator-kubeconfig.yaml")
        log = test_logs_dir / "operator-rbac" / f"{release}.log"
        proc, live_port = operator_process("operator", kubeconfig, args, log, chart_env)
        proc.start()
        yield ChartOperator(proc, live_port, kubeconfig, f"{namespace}/{fullname}", jobs_namespace)
    finally:
        if proc is not None:
            proc.stop()
        helm("uninstall", release, "--namespace", namespace, "--wait", env=kube.env())


# a 403 that is not about permissions: an event or object written into a namespace being deleted
# (in every-namespace mode the operator also sees the jobs of other tests' namespaces as they go)
TERMINATING = "because it is being terminated"


# a log record starts with its timestamp; the lines up to the next one (an API error's reason, headers
# and body) belong to it
RECORD_START = re.compile(r"^(?=\[\d{4}-\d\d-\d\d )", re.MULTILINE)


def refused_lines(proc: ManagedProcess) -> list[str]:
    """The operator's log records that tell of a refused request, each whole (its first line names
    the failed request, the following ones say why)."""
    records = RECORD_START.split(proc.log_path.read_text(errors="replace"))
    return [r for r in records if REFUSED.search(r) and TERMINATING not in r]


def may(api: k8s.ApiClient, account: str, verb: str, resource: str, namespace: str | None = None) -> bool:
    """Whether the apiserver lets the ServiceAccount do it (a SubjectAccessReview); ``resource`` is
    ``plural`` or ``plural.group``."""
    ns, name = account.split("/")
    plural, _, group = resource.partition(".")
    review = k8s.V1SubjectAccessReview(
        spec=k8s.V1SubjectAccessReviewSpec(
            user=f"system:serviceaccount:{ns}:{name}",
            groups=["system:serviceaccounts", "system:authenticated"],
            resource_attributes=k8s.V1ResourceAttributes(
                verb=verb, resource=plural, group=group, namespace=namespace
            ),
        )
    )
    return bool(k8s.AuthorizationV1Api(api).create_subject_access_review(review).status.allowed)


def test_operator_reconciles_with_exactly_the_charts_rules(
    api: k8s.ApiClient,
    namespace: str,
    chart_operator: ChartOperator,
    request: pytest.FixtureRequest,
) -> None:
    proc, ns = chart_operator.proc, chart_operator.jobs
    # The token really is the ServiceAccount's: what the rules do not grant is refused.
    with k8s_config.new_client_from_config(config_file=str(chart_operator.kubeconfig)) as sa_api:
        with pytest.raises(ApiException) as denied:
            k8s.CoreV1Api(sa_api).list_namespaced_secret(ns)
        assert denied.value.status == 403
    account = chart_operator.account
    assert not may(api, account, "list", "namespaces")  # in either mode
    if "--namespace=" in " ".join(proc.argv):  # named namespaces: no right outside them at all
        assert may(api, account, "watch", "dilocojobs.diloco.dev", ns)
        assert not may(api, account, "watch", "dilocojobs.diloco.dev", namespace)
        assert not may(api, account, "list", "customresourcedefinitions.apiextensions.k8s.io")
        bindings = k8s.RbacAuthorizationV1Api(api).list_cluster_role_binding().items
        assert not [
            b.metadata.name
            for b in bindings
            if any(s.name == account.split("/")[1] for s in b.subjects or [])
        ]

    core = k8s.CoreV1Api(api)
    core.create_namespaced_secret(
        ns,
        {
            "metadata": {"name": "s3-creds"},
            "stringData": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "key"},
        },
    )
    storage = {"bucket": "diloco-test", "credentialsSecretRef": {"name": "s3-creds"}}
    # what the pods name is read to check it exists (a PriorityClass only where the rules reach it)
    core.create_namespaced_service_account(ns, {"metadata": {"name": "trainer"}})
    priority = f"least-{ns}"[:63]
    k8s.SchedulingV1Api(api).create_priority_class({"metadata": {"name": priority}, "value": 10})
    request.addfinalizer(lambda: k8s.SchedulingV1Api(api).delete_priority_class(priority))
    pods = {"serviceAccountName": "trainer", "priorityClassName": priority}
    create_job(api, ns, job_manifest("least", [unit("a", 2), unit("b")], storage=storage, pods=pods))
    wait_for(
        lambda: children(api, ns, "least") == expected_children("least", ["a", "b"]),
        timeout=90,
        what="all children",
        describe=lambda: f"{children(api, ns, 'least')}\n{proc.log_tail()}",
    )
    wait_for(lambda: running_on_kwok(learner_pods(api, ns, "least"), 3), timeout=90, what="3 pods Running")
    wait_for(
        lambda: phase_is(api, ns, "least", "Running", "2/2"),
        timeout=60,
        what="phase Running",
        describe=lambda: f"{get_job(api, ns, 'least').get('status')}\n{proc.log_tail()}",
    )
    wait_for(lambda: "Running" in events(api, ns, "least"), timeout=30, what="the Running event")
    live = wait_for(
        lambda: httpx.get(f"http://127.0.0.1:{chart_operator.live_port}/healthz", timeout=5),
        timeout=30,
        what="the liveness endpoint",
    )
    assert (live.status_code, live.json().get("api")) == (200, "ok")

    # A live change: unit b removed (list and delete), a deleted child restored (get and patch).
    patch_spec(api, ns, "least", {"learnerUnits": [unit("a", 2)]})
    wait_for(
        lambda: children(api, ns, "least") == expected_children("least", ["a"]),
        timeout=60,
        what="unit b pruned",
        describe=lambda: f"{children(api, ns, 'least')}\n{proc.log_tail()}",
    )
    core.delete_namespaced_service("least-a", ns)
    wait_for(lambda: core.read_namespaced_service("least-a", ns), timeout=30, what="Service restored")
    wait_for(lambda: phase_is(api, ns, "least", "Running", "1/1"), timeout=60, what="Running 1/1")

    assert proc.running(), proc.failure_report()
    log = proc.log_path.read_text(errors="replace")
    # The log holds the operator's work, so a refused request would be in it too.
    assert "created StatefulSet least-a" in log
    assert "deleted StatefulSet least-b" in log
    assert "created the peering object" in log  # it may create the peering object it joins
    assert refused_lines(proc) == []
    # The job Secret it generated never shows in its (verbose) log, neither plain nor as stored.
    stored = core.read_namespaced_secret("least-secret", ns).data
    assert stored
    for encoded in stored.values():
        plain = base64.b64decode(encoded).decode()
        assert len(plain) >= 16
        assert plain not in log
        assert encoded not in log
