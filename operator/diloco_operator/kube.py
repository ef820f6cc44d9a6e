"""Thin I/O: read, apply (server-side apply), list and delete plain-dict objects.

Every object is a dict with ``apiVersion``, ``kind`` and ``metadata``; the only knowledge of the
API here is the table of resource paths of the kinds the operator manages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

FIELD_MANAGER = "diloco-operator"
# A LIST that answers with the objects' metadata only.
PARTIAL_METADATA = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"

_PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Secret"): "secrets",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("kueue.x-k8s.io/v1beta2", "Workload"): "workloads",
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"): "localqueues",
    ("scheduling.k8s.io/v1", "PriorityClass"): "priorityclasses",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("batch/v1", "Job"): "jobs",
    ("diloco.dev/v1alpha1", "DiLoCoJob"): "dilocojobs",
    ("events.k8s.io/v1", "Event"): "events",
    ("kopf.dev/v1", "KopfPeering"): "kopfpeerings",
    ("kopf.dev/v1", "ClusterKopfPeering"): "clusterkopfpeerings",
}


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    """The collection's path; ``namespace`` empty: a cluster-scoped kind."""
    plural = _PLURALS[(api_version, kind)]
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


def object_path(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{collection_path(obj['apiVersion'], obj['kind'], meta.get('namespace', ''))}/{meta['name']}"


class Kube:
    """The handful of calls the operator makes, on plain dicts."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api = api_client

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Accept": accept, "Content-Type": content_type}
        resp = self.api.call_api(
            path,
            method,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _return_http_data_only=True,
            _request_timeout=30,
        )
        data = resp.data
        return json.loads(data) if data else {}

    def job_versions(self, namespaces: list[str]) -> dict[str, str]:
        """uid -> resourceVersion of every DiLoCoJob in ``namespaces`` (all when empty), metadata only.

        The same ``list`` permission as the operator's watch; only the objects' metadata comes back.
        """
        paths = [f"/apis/diloco.dev/v1alpha1/namespaces/{ns}/dilocojobs" for ns in namespaces] or [
            "/apis/diloco.dev/v1alpha1/dilocojobs"
        ]
        versions: dict[str, str] = {}
        for path in paths:
            for item in (
                self._call("GET", path, accept=PARTIAL_METADATA).get("items") or []
            ):  # null when empty
                meta = item.get("metadata") or {}
                versions[str(meta.get("uid"))] = str(meta.get("resourceVersion"))
        return versions

    def get_cluster(self, path: str) -> dict[str, Any] | None:
        """GET a cluster-scoped or fully spelled path; None when it does not exist."""
        try:
            return self._call("GET", path)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get_cluster(f"{collection_path(api_version, kind, namespace)}/{name}")

    def list(
        self, api_version: str, kind: str, namespace: str, selector: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(selector.items())))]
        items = self._call("GET", collection_path(api_version, kind, namespace), query=query).get("items", [])
        for item in items:  # list items carry no apiVersion/kind
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return list(items)

    def apply(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply, forcing our fields back (a hand edit of them is undone).

        ``dry_run``: the apiserver validates and admits the object as it would be applied, and
        stores nothing.
        """
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        return self._call(
            "PATCH",
            object_path(obj),
            query=query,
            body=dict(obj),
            content_type="application/apply-patch+yaml",
        )

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> bool:
        """JSON merge patch of the status subresource; False when the object is gone."""
        path = f"{collection_path(api_version, kind, namespace)}/{name}/status"
        try:
            self._call(
                "PATCH", path, body={"status": dict(patch)}, content_type="application/merge-patch+json"
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def patch_json(self, obj: Mapping[str, Any], operations: Sequence[Mapping[str, Any]]) -> bool:
        """JSON patch (RFC 6902) of an object; False when it is gone or a ``test`` operation failed
        (it changed meanwhile)."""
        try:
            self._call(
                "PATCH",
                object_path(obj),
                body=[dict(op) for op in operations],
                content_type="application/json-patch+json",
            )
        except ApiException as exc:
            if exc.status in (404, 409, 422):
                return False
            raise
        return True

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create; None when it already exists."""
        meta = obj["metadata"]
        try:
            return self._call(
                "POST",
                collection_path(obj["apiVersion"], obj["kind"], meta.get("namespace", "")),
                query=[("fieldManager", FIELD_MANAGER)],
                body=dict(obj),
            )
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        *,
        grace: int | None = None,
        uid: str | None = None,
    ) -> bool:
        """Delete (children in the background); False when it was already gone.

        With ``uid``, only that object: one that was replaced meanwhile (same name, new uid) stays.
        """
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        path = f"{collection_path(api_version, kind, namespace)}/{name}"
        try:
            self._call("DELETE", path, body=body)
        except ApiException as exc:
            if exc.status == 404 or (exc.status == 409 and uid is not None):
                return False
            raise
        return True


def api_error(exc: Exception) -> str:
    """One line for an API failure: the status code and the apiserver's message when it sent one."""
    if not isinstance(exc, ApiException):
        return f"{type(exc).__name__}: {exc}"
    try:
        message = json.loads(exc.body or b"{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {exc.status}: {message or exc.reason}"


# Fields whose values are resource quantities, which the apiserver stores in its canonical form
# ("0.5" as "500m", "1.5Gi" as "1536Mi", 1073741824 as "1Gi"): compared by value, not by spelling.
QUANTITY_MAPS = frozenset({"requests", "limits"})  # resources.requests/limits: resource -> quantity
QUANTITY_FIELDS = frozenset({"sizeLimit"})  # an emptyDir's


def same_quantity(desired: Any, actual: Any) -> bool:
    """Whether two quantities have the same value (unparseable ones: the same spelling)."""
    scalars = (int, float, str)
    if isinstance(desired, bool) or not isinstance(desired, scalars) or not isinstance(actual, scalars):
        return bool(desired == actual)
    try:
        return bool(parse_quantity(desired) == parse_quantity(actual))
    except ValueError:
        return str(desired) == str(actual)


def is_subset(desired: Any, actual: Any, *, quantity: bool = False) -> bool:
    """Whether every field we set is present in ``actual`` with the same value.

    Fields the apiserver adds (defaults, status, managed fields) are ignored; lists must match in
    length so that a removed item (an env variable, a toleration) counts as drift. ``quantity``:
    ``desired`` is a resource quantity, compared by value, or a mapping of them (``QUANTITY_MAPS``,
    ``QUANTITY_FIELDS``).
    """
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            _field_is_subset(k, v, actual.get(k), quantities=quantity) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(desired) == len(actual)
            and all(is_subset(d, a) for d, a in zip(desired, actual, strict=True))
        )
    if quantity:
        return same_quantity(desired, actual)
    if isinstance(desired, int | float) and isinstance(actual, str):
        return str(desired) == actual  # quantities such as nvidia.com/gpu: 1 come back as "1"
    return bool(desired == actual)


def _field_is_subset(key: str, desired: Any, actual: Any, *, quantities: bool) -> bool:
    """One field of a mapping; ``quantities``: the mapping's values are quantities (``QUANTITY_MAPS``)."""
    if isinstance(desired, Mapping):
        return is_subset(desired, actual, quantity=key in QUANTITY_MAPS)
    return is_subset(desired, actual, quantity=quantities or key in QUANTITY_FIELDS)
