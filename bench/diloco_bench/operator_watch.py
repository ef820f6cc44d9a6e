"""What `diloco bench operator` sees of the cluster: watches in threads, the units whose pods are
all Ready ("reality"), the job's ``status.readyUnits``, and the timelines of both counts."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timeline:
    """(seconds since create, count) each time a count changed."""

    points: list[tuple[float, int]] = field(default_factory=list)

    def add(self, t: float, count: int) -> None:
        if not self.points or self.points[-1][1] != count:
            self.points.append((t, count))

    def first_at_least(self, k: int, after: float = 0.0) -> float | None:
        return next((t for t, c in self.points if c >= k and t >= after), None)

    def first_below(self, k: int, after: float) -> float | None:
        return next((t for t, c in self.points if c < k and t >= after), None)

    def backwards(self, until: float) -> int:
        """Decreases of the count up to ``until``."""
        pts = [c for t, c in self.points if t <= until]
        return sum(1 for a, b in itertools.pairwise(pts) if b < a)


def lags(reality: Timeline, status: Timeline, n: int) -> list[float]:
    """For each k in 1..n reached by both: when the status first showed k minus when reality had k."""
    out = []
    for k in range(1, n + 1):
        r, s = reality.first_at_least(k), status.first_at_least(k)
        if r is not None and s is not None:
            out.append(s - r)
    return out


class Watcher:
    """A watch in a thread, feeding each event to ``on_event`` with the time since ``t0``."""

    def __init__(
        self,
        list_fn: Callable[..., Any],
        on_event: Callable[[float, dict[str, Any], str], None],
        t0: float,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        from kubernetes import watch

        self._watch = watch.Watch()
        self._thread = threading.Thread(
            target=self._run, args=(list_fn, on_event, t0, args, kwargs), daemon=True
        )
        self.error: Exception | None = None
        self.restarts = 0
        self._stopped = False

    def _run(
        self,
        list_fn: Callable[..., Any],
        on_event: Callable[[float, dict[str, Any], str], None],
        t0: float,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        while not self._stopped:  # a stream that ends or breaks is opened again (a fresh listing)
            try:
                # The objects as the apiserver sends them (JSON, camelCase): the client's typed
                # models cost milliseconds per pod, and a watch that falls behind on a busy machine
                # would make reality look later than it was.
                for ev in self._watch.stream(
                    list_fn, *args, timeout_seconds=3600, deserialize=False, **kwargs
                ):
                    on_event(time.monotonic() - t0, ev["object"], ev["type"])
            except Exception as exc:  # kept for the report, and the watch restarts
                self.error = exc
                self.restarts += 1
                time.sleep(0.5)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()


class PodReality:
    """Units whose pods are all Ready, from the benchmark's own pod watch."""

    def __init__(self, pods_per_unit: int) -> None:
        self.pods_per_unit = pods_per_unit
        self.ready: dict[str, tuple[str, bool]] = {}  # pod -> (unit, ready and not deleting)
        self.timeline = Timeline()
        self.lock = threading.Lock()

    def on_event(self, t: float, pod: dict[str, Any], kind: str) -> None:
        meta = pod["metadata"]
        unit = (meta.get("labels") or {}).get("diloco.dev/unit", "")
        conditions = (pod.get("status") or {}).get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        with self.lock:
            if kind == "DELETED":
                self.ready.pop(meta["name"], None)
            else:
                self.ready[meta["name"]] = (unit, ready and not meta.get("deletionTimestamp"))
            per_unit: dict[str, int] = {}
            for u, ok in self.ready.values():
                per_unit[u] = per_unit.get(u, 0) + int(ok)
            self.timeline.add(t, sum(1 for n in per_unit.values() if n >= self.pods_per_unit))


class JobStatus:
    """The job's ``status.readyUnits`` from the benchmark's job watch, and how many events carried it."""

    def __init__(self) -> None:
        self.timeline = Timeline()
        self.updates = 0

    def on_event(self, t: float, job: dict[str, Any], kind: str) -> None:
        ready = (job.get("status") or {}).get("readyUnits")
        if ready is not None:
            self.updates += 1
            self.timeline.add(t, int(ready))
