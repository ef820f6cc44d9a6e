"""The operator's own Prometheus metrics, in a registry of their own."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from diloco_operator.status.units import UNIT_STATES


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "diloco_operator_reconciles_total",
            "Reconciliations by trigger and result",
            ["trigger", "result"],
            registry=self.registry,
        )
        self.children = Counter(
            "diloco_operator_children_total",
            "Children created, restored or deleted",
            ["action"],
            registry=self.registry,
        )
        self.chaos_kills = Counter(
            "diloco_operator_chaos_kills_total",
            "Learner pods killed by built-in chaos",
            registry=self.registry,
        )
        self.jobs = Gauge(
            "diloco_operator_job_phase",
            "1 for the phase each job is in",
            ["namespace", "job", "phase"],
            registry=self.registry,
        )
        self.units = Gauge(
            "diloco_operator_learner_units",
            "Learner units of each job by state (ready, not_ready, lost)",
            ["namespace", "job", "state"],
            registry=self.registry,
        )

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def set_phase(self, namespace: str, job: str, phase: str) -> None:
        for p in ("Pending", "Running", "Degraded", "Suspended", "Succeeded", "Failed"):
            self.jobs.labels(namespace, job, p).set(1.0 if p == phase else 0.0)

    def set_units(self, namespace: str, job: str, counts: Mapping[str, int]) -> None:
        """``counts`` by state, as ``status.unit_state_counts`` gives them (every state, zeros too)."""
        for state, n in counts.items():
            self.units.labels(namespace, job, state).set(float(n))

    def forget(self, namespace: str, job: str) -> None:
        for p in ("Pending", "Running", "Degraded", "Suspended", "Succeeded", "Failed"):
            with contextlib.suppress(KeyError):
                self.jobs.remove(namespace, job, p)
        for state in UNIT_STATES.values():
            with contextlib.suppress(KeyError):
                self.units.remove(namespace, job, state)
