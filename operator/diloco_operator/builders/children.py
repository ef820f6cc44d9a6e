"""The full desired state of a job: every child except the Secret, in apply order."""

from __future__ import annotations

from typing import Any

from diloco_operator.builders.config import build_config_map, config_hash
from diloco_operator.builders.credentials import build_revocations_config_map
from diloco_operator.builders.export import build_export_job
from diloco_operator.builders.learners import build_unit
from diloco_operator.builders.names import JobRef, sync_port_name
from diloco_operator.builders.network import NO_EXTRA_PEERS, SyncIngress, build_sync_network_policy
from diloco_operator.builders.synchronizer import build_sync_deployment, build_sync_service
from diloco_operator.builders.tokens import revocations_text
from diloco_operator.schema.spec import DiLoCoJobSpec


def build_children(
    job: JobRef,
    spec: DiLoCoJobSpec,
    *,
    learners_stopped: bool = False,
    down_units: frozenset[str] = frozenset(),
    ingress: SyncIngress | None = NO_EXTRA_PEERS,
) -> list[dict[str, Any]]:
    """Every child the job should have except the Secrets (which hold generated values).

    ``learners_stopped`` (job finished) scales all learner units to zero and adds the export Job
    (unless ``export.enabled`` is false); ``suspend`` in the spec scales the synchronizer too;
    ``down_units`` (chaos repair) scales those units to zero. ``ingress`` None: the synchronizer
    gets no NetworkPolicy of its own (otherwise one that admits only its learners and ``ingress``).
    """
    config_map = build_config_map(job, spec)
    digest = config_hash(config_map)
    children: list[dict[str, Any]] = [config_map]
    if spec.synchronizer.external is None:
        children.append(build_revocations_config_map(job, revocations_text(job, spec)))
        if ingress is not None:
            children.append(build_sync_network_policy(job, ingress))
        for shard in range(spec.synchronizer.shards):
            children.append(build_sync_deployment(job, spec, shard, digest))
            children.append(build_sync_service(job, shard, sync_port_name(spec)))
    for unit in spec.learner_units:
        stopped = spec.suspend or learners_stopped or unit.name in down_units
        children.extend(build_unit(job, spec, unit, digest, stopped=stopped))
    if learners_stopped and spec.export.enabled and not spec.suspend:
        children.append(build_export_job(job, spec))
    return children
