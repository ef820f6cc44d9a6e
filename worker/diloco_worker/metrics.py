"""A learner's per-step records: JSON lines in the optional metrics file, scalars to experiment tracking."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diloco_core.tracking import Tracking

# the record fields tracked as they are (what ``tracked_scalars`` adds is derived)
TRACKED = (
    "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "eta_s", "tokens",
    "bytes_sent", "wire_sent", "wire_received",
)  # fmt: skip


def tracked_scalars(record: Mapping[str, Any], previous: Mapping[str, Any] | None) -> dict[str, float]:
    """A record's numbers for tracking: the fields of ``TRACKED``, the oldest global version the learner
    holds, and the share of wall time the training thread was blocked since the ``previous`` record."""
    out = {
        k: float(record[k])
        for k in TRACKED
        if isinstance(record.get(k), int | float) and not isinstance(record.get(k), bool)
    }
    versions = record.get("versions")
    if isinstance(versions, Mapping) and versions:
        out["global_version"] = float(min(versions.values()))
    if previous is not None and "blocked_s" in record and "blocked_s" in previous:
        elapsed = float(record["time"]) - float(previous["time"])
        if elapsed > 0:
            out["blocked_pct"] = (
                100.0 * max(0.0, float(record["blocked_s"]) - float(previous["blocked_s"])) / elapsed
            )
    return out


class MetricsLog:
    """Records to the metrics file (``path``) and to ``tracking``, either or both."""

    def __init__(self, path: str | Path | None, *, tracking: Tracking | None = None, **fixed: Any) -> None:
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tracking = tracking
        self._fixed = fixed
        self._extra: dict[str, Any] = {}
        self._once: dict[str, Any] = {}
        self._previous: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def set(self, **values: Any) -> None:
        """Values added to every following record (bytes sent, versions, ...)."""
        with self._lock:
            self._extra.update(values)

    def note(self, **values: Any) -> None:
        """Values added to the next record only (the start-up figures, on the first step's record)."""
        with self._lock:
            self._once.update(values)

    def write(self, **record: Any) -> None:
        with self._lock:
            fields = {"time": time.time(), **self._fixed, **self._extra, **self._once, **record}
            self._once = {}
            line = json.dumps(fields, sort_keys=True)
            previous, self._previous = self._previous, fields
        if self.tracking is not None and "step" in fields:
            self.tracking.log(
                int(fields["step"]), tracked_scalars(fields, previous), wall_time=fields["time"]
            )
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")

    def close(self) -> None:
        if self.tracking is not None:
            self.tracking.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file (for reports and tests)."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
