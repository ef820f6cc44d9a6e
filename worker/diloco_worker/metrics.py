"""The optional JSONL metrics file: one JSON object per logged step."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: str | Path, **fixed: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fixed = fixed
        self._extra: dict[str, Any] = {}
        self._once: dict[str, Any] = {}
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
        with self.path.open("a") as f:
            f.write(line + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file (for reports and tests)."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
