"""What every container the operator starts has: non-root security contexts, HTTP probes and
default resource requests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco_operator.schema.spec import LearnerUnit

RUN_AS_USER = 10001


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def http_probe(path: str, port: str, period: int, failures: int, scheme: str = "HTTP") -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port, **({"scheme": scheme} if scheme != "HTTP" else {})},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


# Requests of a pod whose spec names none, so that it is never BestEffort (the first evicted under
# node pressure) and the scheduler counts it. A learner holds a model, its optimizer state and a
# data pipeline: one core and 2Gi is the floor of a small model; the synchronizer holds one copy
# of the parameters per fragment in memory and spends its CPU on the codec: half a core and 1Gi.
LEARNER_DEFAULT_REQUESTS = {"cpu": "1", "memory": "2Gi"}
SYNC_DEFAULT_REQUESTS = {"cpu": "500m", "memory": "1Gi"}


def with_default_requests(resources: Mapping[str, Any], defaults: Mapping[str, str]) -> dict[str, Any]:
    """``resources`` with a default request for each resource it neither requests nor limits.

    A resource with a limit only is left alone: Kubernetes requests the limit then, and a default
    request above a smaller limit would be refused.
    """
    out: dict[str, Any] = {k: dict(v) for k, v in resources.items()}
    named = set(out.get("requests") or {}) | set(out.get("limits") or {})
    missing = {k: v for k, v in defaults.items() if k not in named}
    if missing:
        out["requests"] = {**missing, **(out.get("requests") or {})}
    return out


def unit_resources(unit: LearnerUnit) -> dict[str, Any]:
    """The unit's resources (default requests added, see above), ``gpus`` as ``nvidia.com/gpu``."""
    resources = with_default_requests(unit.resources, LEARNER_DEFAULT_REQUESTS)
    if unit.gpus:
        for part in ("requests", "limits"):
            resources.setdefault(part, {})["nvidia.com/gpu"] = unit.gpus
    return resources
