"""Prometheus metrics of one synchronizer (its own registry, so several apps can live in one process)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from diloco_core.wire import WireTally
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.contributions = Counter(
            "diloco_sync_contributions",
            "Contributions by result (accepted, duplicate, an error code, or excluded from a round or merged clipped "
            "to its norm limit by its checks)",
            ["result"],
            registry=r,
        )
        self.bytes_in = Counter("diloco_sync_bytes_in", "Payload bytes received", registry=r)
        self.bytes_out = Counter("diloco_sync_bytes_out", "Payload bytes served", registry=r)
        self.rounds = Counter("diloco_sync_rounds", "Completed rounds", ["fragment"], registry=r)
        self.round_participants = Histogram(
            "diloco_sync_round_participants",
            "Learners merged per round",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.merge_seconds = Histogram(
            "diloco_sync_merge_seconds",
            "Merge + outer step time per round",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_seconds = Histogram(
            "diloco_sync_commit_seconds", "Time to make a round durable", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.state_read_seconds = Histogram(
            "diloco_sync_state_read_seconds",
            "Time to read a fragment's parameters and outer state back from storage for its round "
            "(a version larger than --served-in-memory-bytes)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ingest_seconds = Histogram(
            "diloco_sync_ingest_seconds", "Contribution handling time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.fragment_version = Gauge(
            "diloco_sync_fragment_version", "Newest version", ["fragment"], registry=r
        )
        self.pending = Gauge(
            "diloco_sync_pending_contributions", "Contributions waiting", ["fragment"], registry=r
        )
        self.pending_bytes = Gauge(
            "diloco_sync_pending_bytes",
            "Bytes the contributions waiting for or in their rounds hold, with the bodies being received "
            "(bounded by --pending-memory-bytes)",
            registry=r,
        )
        self.learners_alive = Gauge("diloco_sync_learners_alive", "Learners alive", registry=r)
        self.learners_registered = Gauge("diloco_sync_learners_registered", "Learners registered", registry=r)
        self.storage_ok = Gauge("diloco_sync_storage_ok", "1 while the object store answers", registry=r)
        self.buffered_bytes = Gauge(
            "diloco_sync_buffered_bytes", "Contribution bytes held in memory only (storage down)", registry=r
        )
        self.storage_errors = Counter("diloco_sync_storage_errors", "Failed storage operations", registry=r)
        self.contribution_staleness = Histogram(
            "diloco_sync_contribution_staleness",
            "Versions between a merged contribution's base version and the version it was merged into",
            ["fragment"],
            buckets=_STALENESS_BUCKETS,
            registry=r,
        )
        self.learner_loss = Gauge(
            "diloco_sync_learner_loss", "Last held-out loss a learner reported", ["learner"], registry=r
        )
        self.learner_tokens = Counter(
            "diloco_sync_learner_tokens", "Tokens learners reported training on", ["learner"], registry=r
        )
        self.learner_wire_bytes = Gauge(
            "diloco_sync_learner_wire_bytes",
            "Bytes at the socket a learner reports its connections carried (heads, bodies, TLS), by direction "
            "(sent: from the learner)",
            ["learner", "direction"],
            registry=r,
        )
        self.storage_ok.set(1)

    def watch_wire(self, wire: WireTally) -> None:
        """Export the server's bytes at the socket (every connection, read when scraped)."""
        wire_bytes = Gauge(
            "diloco_sync_wire_bytes",
            "Bytes at the socket of every connection since start (heads, bodies, TLS), by direction "
            "(received: from the clients)",
            ["direction"],
            registry=self.registry,
        )
        wire_bytes.labels("received").set_function(lambda: wire.totals()[1])
        wire_bytes.labels("sent").set_function(lambda: wire.totals()[0])

    def forget_learner(self, learner_id: str) -> None:
        """A learner left: stop exporting its last loss (its token counter stays, as counters do)."""
        with contextlib.suppress(KeyError):  # it never reported a loss
            self.learner_loss.remove(learner_id)
        for direction in ("sent", "received"):
            with contextlib.suppress(KeyError):
                self.learner_wire_bytes.remove(learner_id, direction)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class Traffic:
    """Payload bytes received and served, for the status page; the Prometheus counters count them too."""

    metrics: Metrics
    bytes_in: int = 0
    bytes_out: int = 0

    def received(self, nbytes: int) -> None:
        self.bytes_in += nbytes
        self.metrics.bytes_in.inc(nbytes)

    def served(self, nbytes: int) -> None:
        self.bytes_out += nbytes
        self.metrics.bytes_out.inc(nbytes)
