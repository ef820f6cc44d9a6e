"""kopf peering, made visible: which peering object this operator joins, created when it is missing.

kopf keeps an operator paused while the peering object it is told to join does not exist, and says
so only at debug level: an operator started by hand with another peering name than the chart's
operator, or before anyone created the object, would sit idle in silence. So the operator creates
the object (tiny: it holds the members' liveness only) when it is missing and logs which one it
joins; kopf itself logs "Pausing operations" and "Resuming operations" as members come and go.
"""

from __future__ import annotations

import logging
from typing import Any

from kubernetes.client.exceptions import ApiException

from diloco_operator.kube import Kube, api_error

log = logging.getLogger(__name__)

PEERING_API = "kopf.dev/v1"


def peering_objects(name: str, namespaces: list[str]) -> list[dict[str, Any]]:
    """The object(s) an operator of peering ``name`` joins: one ClusterKopfPeering when it watches
    every namespace, else a KopfPeering in each namespace it watches."""
    if not namespaces:
        return [{"apiVersion": PEERING_API, "kind": "ClusterKopfPeering", "metadata": {"name": name}}]
    return [
        {"apiVersion": PEERING_API, "kind": "KopfPeering", "metadata": {"name": name, "namespace": ns}}
        for ns in namespaces
    ]


def describe(obj: dict[str, Any]) -> str:
    ns = obj["metadata"].get("namespace")
    return f"{obj['kind']} '{obj['metadata']['name']}'" + (f" in namespace {ns}" if ns else "")


def ensure_peering(kube: Kube, name: str, namespaces: list[str], priority: int) -> list[str]:
    """Create the peering object(s) that do not exist yet; log which this operator joins and how.

    Returns the descriptions of the objects created. A refusal is logged, not raised: the operator
    then stays paused until someone creates the object, and the log says so.
    """
    created = []
    for obj in peering_objects(name, namespaces):
        what = describe(obj)
        try:
            if kube.create(obj) is not None:
                created.append(what)
                log.info("created the peering object %s", what)
        except ApiException as exc:
            log.error(
                "cannot create the peering object %s (%s): kopf keeps this operator paused until it "
                "exists; create it (operator/peering.yaml) or run with --standalone",
                what,
                api_error(exc),
            )
    joined = ", ".join(describe(o) for o in peering_objects(name, namespaces))
    log.info(
        "peering: this operator joins %s with priority %d; only the live member with the highest "
        "priority handles jobs (members of equal priority all pause); --peering and --priority change "
        "it, --standalone turns peering off",
        joined,
        priority,
    )
    return created
