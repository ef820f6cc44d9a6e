"""The chart against a real kube-apiserver: server-side validation of every manifest, install,
upgrade and uninstall."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from diloco_testbed.kube import Cluster, ControlPlane
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s
from kubernetes import dynamic
from kubernetes.client.rest import ApiException

from tests.charts.helm import CHART, Manifest, helm, render, values_args

pytestmark = pytest.mark.integration

CRD_NAME = "dilocojobs.diloco.dev"
CHART_CRDS = (CRD_NAME, "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")


@pytest.fixture
def second_namespace(kube: Cluster) -> Iterator[str]:
    name = kube.create_namespace("t-chart-second")
    try:
        yield name
    finally:
        kube.delete_namespace(name)


def _dry_run_create(api: k8s.ApiClient, manifest: Manifest) -> None:
    """POST with dryRun=All and fieldValidation=Strict: the apiserver runs defaulting, validation
    and admission against its own schemas and rejects unknown or duplicate fields, stores nothing."""
    resource = dynamic.DynamicClient(api).resources.get(
        api_version=manifest["apiVersion"], kind=manifest["kind"]
    )
    namespace = manifest["metadata"].get("namespace") if resource.namespaced else None
    api.call_api(
        resource.path(namespace=namespace), "POST",
        query_params=[("dryRun", "All"), ("fieldValidation", "Strict")],
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
        body=manifest, auth_settings=["BearerToken"], response_type="object", _return_http_data_only=True,
    )  # fmt: skip


def _ensure_crds(api: k8s.ApiClient, manifests: list[Manifest]) -> None:
    """Create the chart's CRDs for real (as `helm install` does first), so that the custom resources
    among the templates (the kopf peering objects) can be validated against them."""
    extensions = k8s.ApiextensionsV1Api(api)
    for crd in (m for m in manifests if m["kind"] == "CustomResourceDefinition"):
        try:
            extensions.create_custom_resource_definition(crd)
        except ApiException as exc:
            if exc.status != 409:
                raise
        name = crd["metadata"]["name"]
        wait_for(partial(_crd_established, api, name), timeout=60, what=f"CRD {name} established")
    dynamic.DynamicClient(api).resources.invalidate_cache()


def _validate_all(kube: Cluster, manifests: list[Manifest]) -> list[str]:
    validated = []
    with kube.api_client() as api:
        _ensure_crds(api, manifests)
        for manifest in manifests:
            try:
                _dry_run_create(api, manifest)
            except ApiException as exc:
                # an existing CRD (installed by another test) or namespace answers 409 only after it
                # passed validation
                if not (exc.status == 409 and manifest["kind"] in ("CustomResourceDefinition", "Namespace")):
                    raise AssertionError(
                        f"{manifest['kind']} {manifest['metadata']['name']}: {exc.body}"
                    ) from exc
            validated.append(manifest["kind"])
    return validated


def test_default_manifests_pass_server_side_validation(kube: Cluster, namespace: str, tmp_path: Path) -> None:
    manifests = render(tmp_path, namespace=namespace, release="dry")
    validated = _validate_all(kube, manifests)
    assert sorted(validated) == sorted(m["kind"] for m in manifests)
    assert "Deployment" in validated
    assert validated.count("CustomResourceDefinition") == 3


def test_custom_manifests_pass_server_side_validation(
    kube: Cluster, namespace: str, second_namespace: str, tmp_path: Path
) -> None:
    from tests.charts.test_chart_render import CUSTOM_VALUES

    values: dict[str, Any] = {
        **CUSTOM_VALUES,
        "watchNamespaces": [namespace, second_namespace],
        "dashboard": {**CUSTOM_VALUES["dashboard"], "namespace": namespace},
    }
    manifests = render(tmp_path, values, namespace=namespace, release="dry")
    validated = _validate_all(kube, manifests)
    assert validated.count("Role") >= 2
    assert validated.count("NetworkPolicy") == 2
    assert "ConfigMap" in validated
    assert validated.count("Namespace") == 2


def _crd_established(api: k8s.ApiClient, name: str = CRD_NAME) -> bool:
    crd = k8s.ApiextensionsV1Api(api).read_custom_resource_definition(name)
    return any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or []))


def _exists(read: Any, *args: str) -> bool:
    try:
        read(*args)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


@pytest.fixture(scope="module")
def fresh_cluster(request: pytest.FixtureRequest, test_logs_dir: Path) -> Iterator[Cluster]:
    """A control plane of its own, with none of the CRDs other tests install, so that `helm install`
    must create the chart's CRDs itself. With DILOCO_TEST_KUBECONFIG (an existing cluster) that
    cluster is used as it is."""
    if os.environ.get("DILOCO_TEST_KUBECONFIG"):
        yield request.getfixturevalue("kube")
        return
    plane = ControlPlane(test_logs_dir / "kube-chart-install")
    plane.start()
    try:
        yield plane
    finally:
        plane.close()


def _served_crds(api: k8s.ApiClient) -> set[str]:
    return {c.metadata.name for c in k8s.ApiextensionsV1Api(api).list_custom_resource_definition().items}


def _install(cluster: Cluster, release: str, namespace: str) -> None:
    with cluster.api_client() as api:
        fresh = isinstance(cluster, ControlPlane)
        if fresh:  # a new control plane: helm has to create every CRD before the templates
            assert not _served_crds(api) & set(CHART_CRDS)
        installed = helm("install", release, str(CHART), "--namespace", namespace, env=cluster.env())
        assert installed.returncode == 0, installed.stderr
        for name in CHART_CRDS:
            wait_for(partial(_crd_established, api, name), timeout=60, what=f"CRD {name} established")


def test_install_serves_the_crd_then_upgrade_and_uninstall(fresh_cluster: Cluster, tmp_path: Path) -> None:
    namespace = fresh_cluster.create_namespace("t-chart-install")
    release = f"it-{namespace[-8:]}"
    fullname = f"{release}-diloco"
    env = fresh_cluster.env()
    _install(fresh_cluster, release, namespace)
    with fresh_cluster.api_client() as api:
        jobs = k8s.CustomObjectsApi(api).list_namespaced_custom_object(
            "diloco.dev", "v1alpha1", namespace, "dilocojobs"
        )
        assert jobs["items"] == []
        apps, rbac = k8s.AppsV1Api(api), k8s.RbacAuthorizationV1Api(api)
        deployment = apps.read_namespaced_deployment(f"{fullname}-operator", namespace)
        assert deployment.spec.replicas == 1
        args = deployment.spec.template.spec.containers[0].args
        assert not any(a.startswith("--namespace") for a in args)
        assert "--peering=diloco" in args  # `diloco operator`'s default: one started by hand pauses for it
        assert _exists(rbac.read_cluster_role, f"{fullname}-operator")

        upgraded = helm(
            "upgrade", release, str(CHART), "--namespace", namespace, env=env,
            *values_args(tmp_path, {"operator": {"verbose": True}, "watchNamespaces": [namespace]}),
        )  # fmt: skip
        assert upgraded.returncode == 0, upgraded.stderr
        args = (
            apps.read_namespaced_deployment(f"{fullname}-operator", namespace)
            .spec.template.spec.containers[0]
            .args
        )
        assert f"--namespace={namespace}" in args
        assert "--verbose" in args
        assert _exists(rbac.read_namespaced_role, f"{fullname}-operator", namespace)
        # namespaced watch: the cluster-wide role is replaced by the namespaced one, and nothing
        # cluster-wide is left
        assert not _exists(rbac.read_cluster_role, f"{fullname}-operator")
        assert not _exists(rbac.read_cluster_role, f"{fullname}-operator-cluster")
        status = helm("status", release, "--namespace", namespace, "-o", "json", env=env)
        assert json.loads(status.stdout)["version"] == 2

        removed = helm("uninstall", release, "--namespace", namespace, "--wait", env=env)
        assert removed.returncode == 0, removed.stderr
        assert not _exists(apps.read_namespaced_deployment, f"{fullname}-operator", namespace)
        assert not _exists(rbac.read_namespaced_role, f"{fullname}-operator", namespace)
        assert not _exists(rbac.read_cluster_role, f"{fullname}-operator-cluster")
        # helm never deletes CRDs from crds/: the jobs (and their training state) survive an uninstall
        assert all(_crd_established(api, name) for name in CHART_CRDS)
    fresh_cluster.delete_namespace(namespace)


def test_notes_tell_the_user_what_to_do_next(kube: Cluster, namespace: str, tmp_path: Path) -> None:
    # a dry run installs no CRDs (a documented Helm limitation), so the kopf peering objects among
    # the templates map only where the chart's CRDs are already served
    with kube.api_client() as api:
        _ensure_crds(api, render(tmp_path, namespace=namespace, release="demo"))
    result = helm(
        "install", "demo", str(CHART), "--dry-run=client", "--namespace", namespace, env=kube.env(),
        *values_args(tmp_path, {"watchNamespaces": ["team-a"], "networkPolicy": {"allowedCIDRs": ["10.20.0.0/16"]}}),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "kubectl get crd dilocojobs.diloco.dev" in notes
    assert "kubectl apply -n team-a -f" in notes
    assert "kubectl get dilocojobs -A -w" in notes
    assert "It reconciles DiLoCoJobs in: team-a." in notes
    assert "the operator gives it a NetworkPolicy" in notes  # every job, wherever it runs
    assert "admits the learners of the namespace, the operator and 10.20.0.0/16." in notes


def _namespace(api: k8s.ApiClient, name: str) -> k8s.V1Namespace | None:
    try:
        return k8s.CoreV1Api(api).read_namespace(name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_install_creates_the_watched_namespaces_that_do_not_exist_and_keeps_them(
    kube: Cluster, namespace: str, second_namespace: str, tmp_path: Path
) -> None:
    """`--set watchNamespaces={ml}` on a cluster without `ml`: the install creates it (and an existing
    watched namespace is left alone); upgrades keep it; `helm uninstall` leaves it with its jobs."""
    missing = f"{namespace[:50]}-ml"
    release = f"ns-{namespace[-8:]}"
    env = kube.env()
    values = values_args(
        tmp_path, {"watchNamespaces": [missing, second_namespace], "operator": {"replicas": 0}}
    )
    try:
        with kube.api_client() as api:
            assert _namespace(api, missing) is None
            installed = helm("install", release, str(CHART), "--namespace", namespace, *values, env=env)
            assert installed.returncode == 0, installed.stderr
            made = _namespace(api, missing)
            assert made is not None
            assert made.metadata.labels["app.kubernetes.io/instance"] == release
            assert made.metadata.annotations["helm.sh/resource-policy"] == "keep"
            existing = _namespace(api, second_namespace)
            assert existing is not None
            assert "meta.helm.sh/release-name" not in (existing.metadata.annotations or {})  # not adopted
            rbac = k8s.RbacAuthorizationV1Api(api)
            for ns in (missing, second_namespace):
                assert _exists(rbac.read_namespaced_role, f"{release}-diloco-operator", ns)
            upgraded = helm(
                "upgrade",
                release,
                str(CHART),
                "--namespace",
                namespace,
                *values,
                "--set",
                "operator.verbose=true",
                env=env,
            )
            assert upgraded.returncode == 0, upgraded.stderr
            assert _namespace(api, missing) is not None
            removed = helm("uninstall", release, "--namespace", namespace, "--wait", env=env)
            assert removed.returncode == 0, removed.stderr
            kept = _namespace(api, missing)
            assert kept is not None
            assert kept.status.phase == "Active"
            assert not _exists(rbac.read_namespaced_role, f"{release}-diloco-operator", missing)
    finally:
        kube.delete_namespace(missing)


def test_watched_namespaces_required_to_exist_fail_the_install_before_anything_is_written(
    kube: Cluster, namespace: str, tmp_path: Path
) -> None:
    missing = f"{namespace[:50]}-ml"
    release = f"req-{namespace[-8:]}"
    env = kube.env()
    values = values_args(
        tmp_path, {"watchNamespaces": [missing], "createWatchNamespaces": False, "operator": {"replicas": 0}}
    )
    failed = helm("install", release, str(CHART), "--namespace", namespace, *values, env=env)
    assert failed.returncode != 0
    assert f"namespace(s) {missing} do not exist" in failed.stderr
    # no failed release left behind: once the namespace exists, the same install works
    status = helm("status", release, "--namespace", namespace, env=env)
    assert status.returncode != 0
    assert "not found" in status.stderr
    with kube.api_client() as api:
        k8s.CoreV1Api(api).create_namespace({"metadata": {"name": missing}})
    try:
        installed = helm("install", release, str(CHART), "--namespace", namespace, *values, env=env)
        assert installed.returncode == 0, installed.stderr
        assert helm("uninstall", release, "--namespace", namespace, "--wait", env=env).returncode == 0
    finally:
        kube.delete_namespace(missing)
