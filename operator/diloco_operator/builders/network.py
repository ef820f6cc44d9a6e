"""Pure builder of the NetworkPolicy that guards a job's synchronizer pods.

The policy lives in the job's namespace and is owned by the job, so it exists wherever the job runs
(the operator watching one namespace or all). It admits ingress on the synchronizer port only from
the job's own learner pods and from the operator's namespace (status polling). NetworkPolicies add
up: peers that a cluster admits besides these (other regions' addresses behind a load balancer,
an ingress controller, Prometheus) come from another policy that selects the same pods, such as
the chart's ``networkPolicy`` one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco_operator.builders import env
from diloco_operator.builders.names import COMPONENT_LABEL, JOB_LABEL, JobRef, metadata, sync_name

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class SyncIngress:
    """Who besides the job's own learners may reach its synchronizer pods.

    ``operator_namespace``: the namespace the operator runs in (None: an operator outside the
    cluster, whose traffic reaches the pods through the apiserver's port-forward, not the pod
    network)."""

    operator_namespace: str | None = None


# The default of ``build_children``: the job's learners alone.
NO_EXTRA_PEERS = SyncIngress()


def component_selector(job: str, component: str) -> dict[str, str]:
    return {JOB_LABEL: job, COMPONENT_LABEL: component}


def build_sync_network_policy(job: JobRef, ingress: SyncIngress) -> dict[str, Any]:
    """Ingress to every synchronizer shard of ``job``: the synchronizer port, from the job's
    learners and the operator's namespace. Egress stays open: storage may be anywhere."""
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": component_selector(job.name, "learner")}}]
    if ingress.operator_namespace:
        peers.append(
            {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ingress.operator_namespace}}}
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, sync_name(job.name), "synchronizer"),
        "spec": {
            "podSelector": {"matchLabels": component_selector(job.name, "synchronizer")},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": env.SYNC_PORT}], "from": peers}],
        },
    }
