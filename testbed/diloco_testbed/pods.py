"""Pods as the tests and ``make cluster`` watch them: waiting for a phase, reading logs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from .waiting import wait_for


def wait_pod_phase(core: k8s.CoreV1Api, ns: str, name: str, phases: Iterable[str], timeout: float) -> Any:
    """The pod ``ns/name`` once its phase is one of ``phases``; its state is in the timeout's message."""
    wanted = tuple(phases)

    def probe() -> Any:
        pod = core.read_namespaced_pod(name, ns)
        return pod if pod.status.phase in wanted else None

    return wait_for(
        probe,
        timeout=timeout,
        what=f"pod {ns}/{name} in {wanted}",
        interval=1,
        describe=lambda: _describe_pod(core, ns, name),
    )


def _describe_pod(core: k8s.CoreV1Api, ns: str, name: str) -> str:
    try:
        pod = core.read_namespaced_pod(name, ns)
    except ApiException as exc:
        return f"cannot read the pod: {exc.status}"
    statuses = [(c.name, c.state.to_dict() if c.state else None) for c in pod.status.container_statuses or []]
    return f"phase {pod.status.phase}, conditions {pod.status.conditions}, containers {statuses}"


def pod_logs(core: k8s.CoreV1Api, ns: str, name: str, container: str | None = None) -> str:
    """The pod's logs, or a line saying why there are none."""
    try:
        response = core.read_namespaced_pod_log(name, ns, container=container, _preload_content=False)
        return bytes(response.data).decode(errors="replace")
    except ApiException as exc:
        return f"(no logs: {exc.status} {exc.reason})"
