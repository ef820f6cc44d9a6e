"""The learner's health endpoint for the pod's probes: ``/healthz`` (liveness) and ``/readyz``.

The training loop (and every long wait of the learner: start-up retries, a blocking sync) beats a
:class:`Health` record; ``/healthz`` answers 200 while the newest beat is fresh and 503 once the loop
has been quiet for longer than ``stale_after_s``. ``/readyz`` additionally needs the learner to have
started training. A stdlib HTTP server in a daemon thread serves both; it never touches the model.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]


def probe_answer(path: str, *, beat_age_s: float, stale_after_s: float, ready: bool, phase: str) -> Answer:
    """What a probe of ``path`` gets, from the age of the newest beat and whether training started."""
    route = path.split("?", 1)[0].rstrip("/") or "/"
    alive = beat_age_s <= stale_after_s
    body: dict[str, Any] = {
        "phase": phase,
        "last_beat_age_s": round(beat_age_s, 3),
        "stale_after_s": stale_after_s,
    }
    if route == "/healthz":
        return Answer(200 if alive else 503, body | {"alive": alive})
    if route == "/readyz":
        ok = alive and ready
        return Answer(200 if ok else 503, body | {"alive": alive, "ready": ok})
    return Answer(404, {"error": f"no such path {route!r}; try /healthz or /readyz"})


# a learner that finished training and waits to be stopped is where it should be: still ready
READY_PHASES = frozenset({"training", "blocked", "finished"})


class Health:
    """Beats from the learner, read by the probe handler (thread-safe)."""

    def __init__(self, stale_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.stale_after_s, self._clock = stale_after_s, clock
        self._lock = threading.Lock()
        self._last = clock()  # a process that just started counts as alive
        self._phase = "starting"

    def beat(self, phase: str | None = None) -> None:
        """The learner is making progress (``phase``: starting, training, blocked, leaving, finished)."""
        with self._lock:
            self._last = self._clock()
            if phase is not None:
                self._phase = phase

    @property
    def phase(self) -> str:
        with self._lock:
            return self._phase

    def answer(self, path: str) -> Answer:
        with self._lock:
            age, phase = self._clock() - self._last, self._phase
        ready = phase in READY_PHASES
        return probe_answer(
            path, beat_age_s=max(0.0, age), stale_after_s=self.stale_after_s, ready=ready, phase=phase
        )


class HealthServer:
    """``/healthz`` and ``/readyz`` on ``host:port`` (port 0: a free one) in a daemon thread."""

    def __init__(self, health: Health, host: str, port: int) -> None:
        state = health

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the stdlib names it
                answer = state.answer(self.path)
                data = json.dumps(answer.body).encode()
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return  # probes every few seconds would drown the learner's log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="diloco-health", daemon=True)

    @property
    def port(self) -> int:
        port: int = self._server.server_address[1]
        return port

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
