"""The Helm chart, rendered by the real helm binary: lint, defaults, non-default values, validation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.charts.helm import CHART, KUBE_VERSION, ROOT, flat_rules, helm, of_kind, one, render, values_args

CUSTOM_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example.com/ml/diloco-sync", "tag": "1.2.3", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "watchNamespaces": ["team-a", "team-b"],
    "serviceAccount": {
        "create": True,
        "name": "trainer-operator",
        "annotations": {"iam.example.com/role": "x"},
    },
    "operator": {
        "replicas": 1,
        "verbose": True,
        "resyncSeconds": 30,
        "extraArgs": ["--verbose"],
        "extraEnv": [{"name": "EXTRA", "value": "1"}],
        "resources": {"requests": {"cpu": "200m", "memory": "300Mi"}, "limits": {"memory": "1Gi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "podAnnotations": {"example.com/team": "ml"},
    },
    "peering": {"enabled": True, "name": "diloco-peers", "priority": 10},
    "metrics": {"service": {"enabled": True, "port": 9100, "annotations": {"prometheus.io/scrape": "true"}}},
    "networkPolicy": {
        "enabled": True,
        "allowedCIDRs": ["10.20.0.0/16", "fd00:10::/64"],
        "allowedNamespaceLabels": [{"kubernetes.io/metadata.name": "monitoring"}],
    },
    "dashboard": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "DiLoCo"}},
}


def _deployment(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return one(manifests, "Deployment")


def _container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    containers = _deployment(manifests)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["defaults", "custom"])
def test_helm_lint_passes_strictly(tmp_path: Path, values: dict[str, Any] | None) -> None:
    result = helm(
        "lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION, *values_args(tmp_path, values)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_defaults_render_the_operator_with_a_cluster_role(tmp_path: Path) -> None:
    manifests = render(tmp_path)
    kinds = sorted(m["kind"] for m in manifests)
    assert kinds == sorted(
        ["CustomResourceDefinition", "CustomResourceDefinition", "CustomResourceDefinition", "ServiceAccount",
         "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "NetworkPolicy"]
    )  # fmt: skip
    container = _container(manifests)
    assert container["image"] == "ghcr.io/diloco-k8s/diloco-sync:0.1.0"
    assert container["command"] == ["diloco", "operator"]
    assert container["args"] == ["--liveness=http://0.0.0.0:8080/healthz", "--peering=diloco", "--priority=0"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 9090, "health": 8080}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DILOCO_OPERATOR_METRICS_PORT"] == "9090"
    assert env["DILOCO_OPERATOR_RESYNC_SECONDS"] == "15"
    binding = one(manifests, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "diloco", "namespace": "diloco-system"}]
    service = one(manifests, "Service")
    assert service["spec"]["selector"] == _deployment(manifests)["spec"]["selector"]["matchLabels"]


def test_operator_pod_meets_the_restricted_pod_security_standard(tmp_path: Path) -> None:
    for values in (None, CUSTOM_VALUES):
        manifests = render(tmp_path, values)
        pod = _deployment(manifests)["spec"]["template"]["spec"]
        container = _container(manifests)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert "hostNetwork" not in pod
        assert all("hostPath" not in v for v in pod["volumes"])
        assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}


def test_custom_values_render_namespaced_rbac_and_everything_optional(tmp_path: Path) -> None:
    manifests = render(tmp_path, CUSTOM_VALUES)
    container = _container(manifests)
    deployment = _deployment(manifests)
    assert deployment["spec"]["replicas"] == 1
    assert container["image"] == "registry.example.com/ml/diloco-sync:1.2.3"
    assert container["imagePullPolicy"] == "Always"
    args = container["args"]
    assert "--namespace=team-a" in args
    assert "--namespace=team-b" in args
    assert "--peering=diloco-peers" in args
    assert "--priority=10" in args
    assert args[-2:] == ["--verbose", "--verbose"]  # the flag, then the same flag from extraArgs
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DILOCO_OPERATOR_RESYNC_SECONDS"] == "30"
    assert env["EXTRA"] == "1"
    # the operator creates the peering objects it joins; the chart leaves them to it
    assert of_kind(manifests, "KopfPeering") == of_kind(manifests, "ClusterKopfPeering") == []
    # without a cluster to ask (helm template), every watched namespace is rendered, kept on uninstall
    namespaces = of_kind(manifests, "Namespace")
    assert {n["metadata"]["name"] for n in namespaces} == {"team-a", "team-b"}
    assert {n["metadata"]["annotations"]["helm.sh/resource-policy"] for n in namespaces} == {"keep"}
    assert of_kind(render(tmp_path, {**CUSTOM_VALUES, "createWatchNamespaces": False}), "Namespace") == []
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "trainer-operator"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["tolerations"][0]["key"] == "dedicated"
    roles = of_kind(manifests, "Role")
    watched = {r["metadata"]["namespace"] for r in roles if r["metadata"]["name"] == "diloco-operator"}
    assert watched == {"team-a", "team-b"}
    for binding in of_kind(manifests, "RoleBinding"):
        assert binding["subjects"][0]["name"] == "trainer-operator"
    policies = of_kind(manifests, "NetworkPolicy")
    assert {p["metadata"]["namespace"] for p in policies} == {"team-a", "team-b"}
    peers = policies[0]["spec"]["ingress"][0]["from"]
    assert {"ipBlock": {"cidr": "10.20.0.0/16"}} in peers
    assert {"ipBlock": {"cidr": "fd00:10::/64"}} in peers
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in peers
    dashboard = one(manifests, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["diloco.json"])["title"] == "DiLoCo"


def test_network_policy_admits_only_learners_operator_and_configured_peers_on_the_sync_port(
    tmp_path: Path,
) -> None:
    policy = one(render(tmp_path), "NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "synchronizer"
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]  # the operator's synchronizer port
    learner, operator = rule["from"]
    assert learner == {
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "diloco", "app.kubernetes.io/component": "learner"}
        }
    }
    assert operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "diloco-system"}
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert of_kind(render(tmp_path, {"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []


def test_the_operator_guards_every_jobs_synchronizer_unless_per_job_policies_are_off(tmp_path: Path) -> None:
    def env(values: dict[str, Any] | None) -> dict[str, str]:
        return {e["name"]: e.get("value") for e in _container(render(tmp_path, values))["env"]}

    on = env(None)  # every namespace: the chart's own policy reaches only the release namespace
    assert on["DILOCO_OPERATOR_SYNC_NETWORK_POLICY"] == "true"
    assert on["DILOCO_OPERATOR_OPERATOR_NAMESPACE"] == "diloco-system"
    assert env({"networkPolicy": {"perJob": False}})["DILOCO_OPERATOR_SYNC_NETWORK_POLICY"] == "false"


def test_service_monitors_render_when_the_cluster_serves_them(tmp_path: Path) -> None:
    values = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    manifests = render(tmp_path, values, extra=("--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"))
    monitors = {m["metadata"]["name"]: m for m in of_kind(manifests, "ServiceMonitor")}
    assert set(monitors) == {"diloco-operator", "diloco-synchronizers"}
    assert monitors["diloco-operator"]["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitors["diloco-operator"]["spec"]["endpoints"][0]["honorLabels"] is True
    assert monitors["diloco-synchronizers"]["spec"]["namespaceSelector"] == {"any": True}
    assert all(m["metadata"]["labels"]["release"] == "prom" for m in monitors.values())


def test_pod_monitors_render_with_the_service_label_the_dashboard_uses(tmp_path: Path) -> None:
    values = {"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    manifests = render(tmp_path, values, extra=("--api-versions", "monitoring.coreos.com/v1/PodMonitor"))
    assert of_kind(manifests, "ServiceMonitor") == []
    monitors = {m["metadata"]["name"]: m for m in of_kind(manifests, "PodMonitor")}
    assert set(monitors) == {"diloco-operator", "diloco-synchronizers"}
    operator = monitors["diloco-operator"]["spec"]
    assert (
        operator["podMetricsEndpoints"][0]["port"],
        operator["podMetricsEndpoints"][0]["honorLabels"],
    ) == (
        "metrics",
        True,
    )
    pod = _container(manifests)
    assert "metrics" in [p["name"] for p in pod["ports"]]
    syncs = monitors["diloco-synchronizers"]["spec"]
    assert syncs["namespaceSelector"] == {"any": True}
    assert [e["port"] for e in syncs["podMetricsEndpoints"]] == ["http", "https"]
    # a synchronizer pod's ReplicaSet is its Deployment's name (= its Service's) and a hash
    (relabel,) = syncs["podMetricsEndpoints"][0]["relabelings"]
    assert relabel["targetLabel"] == "service"
    assert re.fullmatch(relabel["regex"], "llm-sync-0-5d8f7c9b4") is not None
    assert re.sub(relabel["regex"], r"\1", "llm-sync-0-5d8f7c9b4") == "llm-sync-0"
    assert relabel["replacement"] == "$1"
    assert all(m["metadata"]["labels"]["release"] == "prom" for m in monitors.values())


def test_pod_and_service_monitors_are_not_both_made(tmp_path: Path) -> None:
    both = {"metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}}
    apis = [f"--api-versions=monitoring.coreos.com/v1/{kind}" for kind in ("PodMonitor", "ServiceMonitor")]
    result = helm(
        "template", "r", str(CHART), "--kube-version", KUBE_VERSION, *apis, *values_args(tmp_path, both)
    )
    assert result.returncode != 0
    assert "scrape the same pods twice" in result.stderr, result.stderr


def test_crds_in_the_chart_are_identical_to_the_source_of_truth() -> None:
    names = ["dilocojobs.diloco.dev.yaml", "kopfpeerings.kopf.dev.yaml"]
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == names
    for name in names:
        source = ROOT / "crds" / name
        assert source.is_file(), f"crds/{name} is the CRD's source of truth"
        assert (CHART / "crds" / name).read_bytes() == source.read_bytes(), "run scripts/sync-chart-crd.sh"


def test_rendered_rbac_grants_exactly_the_rules_of_operator_rbac_yaml(tmp_path: Path) -> None:
    source = ROOT / "operator" / "rbac.yaml"
    assert (
        CHART / "files" / "operator-rbac.yaml"
    ).read_bytes() == source.read_bytes(), "run scripts/sync-chart-crd.sh"
    wanted = flat_rules(yaml.safe_load(source.read_text()))
    # what only an operator of every namespace needs: kopf's CRD watch, the cluster-wide peering and
    # reading PriorityClasses
    cluster_scoped = {
        r for r in wanted if r[1] in ("customresourcedefinitions", "clusterkopfpeerings", "priorityclasses")
    }
    assert cluster_scoped
    for values in (None, CUSTOM_VALUES, {"watchNamespaces": ["only"]}):
        manifests = render(tmp_path, values)
        roles = of_kind(manifests, "ClusterRole") + of_kind(manifests, "Role")
        # per watched namespace the union of every role the operator holds there equals the file
        namespaces = (values or {}).get("watchNamespaces") or [None]
        expected = wanted - cluster_scoped if namespaces != [None] else wanted
        for namespace in namespaces:
            held = [r for r in roles if r["metadata"].get("namespace") in (None, namespace)]
            granted = set().union(*(flat_rules(r["rules"]) for r in held))
            assert granted == expected, f"values {values}: {granted ^ expected}"
        if namespaces != [None]:  # no right at all outside the watched namespaces
            assert of_kind(manifests, "ClusterRole") == of_kind(manifests, "ClusterRoleBinding") == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy': value must be one of 'Always'"),
        ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0': 'Team_A' does not match pattern"),
        ({"operator": {"replicas": -1}}, "at '/operator/replicas': minimum: got -1, want 0"),
        ({"operator": {"replicas": 2}}, "at '/operator/replicas': maximum: got 2, want 1"),
        ({"networkPolicy": {"allowedCIDRs": ["10.0.0.0/33"]}}, "at '/networkPolicy/allowedCIDRs/0'"),
        ({"operator": {"podSecurityContext": {"runAsNonRoot": False}}}, "runAsNonRoot': value must be true"),
        ({"operator": {"resources": {"requests": None}}}, "missing property 'requests'"),
        ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "at '/metrics/serviceMonitor/interval'"),
        ({"operatr": {"replicas": 1}}, "additional properties 'operatr' not allowed"),
        ({"peering": {"name": "Not A Name"}}, "at '/peering/name': 'Not A Name' does not match pattern"),
        (
            {"metrics": {"serviceMonitor": {"enabled": True}}},
            "needs the Prometheus Operator's ServiceMonitor CRD",
        ),
        (
            {"operator": {"metricsPort": 8080, "healthPort": 8080}},
            "operator.metricsPort and operator.healthPort are both 8080",
        ),
    ],
)
def test_invalid_values_fail_with_a_message_naming_the_key(
    tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    # helm lint reports a template's `fail` only as INFO, so those are checked by rendering alone
    commands = (
        ("template", "lint")
        if message.startswith("at '") or "not allowed" in message or "missing" in message
        else ("template",)
    )
    for command in commands:
        args = [
            command,
            *(["r"] if command == "template" else []),
            str(CHART),
            "--kube-version",
            KUBE_VERSION,
        ]
        result = helm(*args, *values_args(tmp_path, values))
        assert result.returncode != 0
        assert message in result.stdout + result.stderr, result.stdout + result.stderr


def test_values_yaml_documents_every_key() -> None:
    """Every key has a comment right above it, except the fields of a documented default value
    (a key whose parent carries a `# --` value comment, such as resources.requests.cpu)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    keys: list[tuple[int, bool]] = []  # (indent, documented as a value) of the keys seen so far
    for number, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z_][\w./-]*:", line):
            continue
        indent = len(line) - len(line.lstrip())
        previous = next((p.strip() for p in reversed(lines[:number]) if p.strip()), "")
        parents = [documented for parent_indent, documented in keys if parent_indent < indent]
        inside_value = bool(parents and parents[-1])
        keys = [(i, d) for i, d in keys if i < indent] + [
            (indent, inside_value or previous.startswith("# --"))
        ]
        if inside_value:
            continue
        assert previous.startswith("#"), f"values.yaml:{number + 1} {line.strip()!r} has no comment"


def test_every_default_value_is_accepted_by_the_schema_and_the_schema_covers_every_key() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    assert set(values) <= set(schema["properties"])
