"""``diloco worker``: start a learner from flags and environment variables."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

from diloco_core.heap import limit_heap

from .health import Health, HealthServer
from .settings import SettingsError, WhenDone, data_shard, parse_settings
from .startup import StartupClock

log = logging.getLogger("diloco_worker")


def _install_sigterm(stop: threading.Event, grace_s: float) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            return
        log.info("signal %d: finishing the step, checkpointing and leaving", signum)
        stop.set()
        # a safety net: the orderly shutdown is bounded, but a stuck network call must not hold the pod
        watchdog = threading.Timer(grace_s, lambda: os._exit(1))
        watchdog.daemon = True
        watchdog.start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def waits_when_done(when_done: WhenDone, *, stopped: bool) -> bool:
    """Whether a learner that finished training stays up: only with ``wait``, and not when asked to stop."""
    return when_done == "wait" and not stopped


def wait_until_stopped(stop: threading.Event, health: Health, beat_every_s: float = 5.0) -> None:
    """Stay up, healthy and ready, until stopped: under a StatefulSet (restartPolicy Always) an exit
    would be restarted. The operator scales the unit down once the whole job is done."""
    log.info("training finished; waiting to be stopped")
    health.beat("finished")
    while not stop.wait(beat_every_s):
        health.beat("finished")


def main(argv: list[str]) -> int:
    startup = StartupClock.of_this_process()
    limit_heap()  # before any thread makes an arena
    try:
        settings = parse_settings(argv)
        index, count = data_shard(settings)  # the units file is read once, here
        settings = settings.model_copy(update={"learner_index": index, "num_learners": count})
    except SettingsError as exc:
        print(f"diloco worker: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=os.environ.get("DILOCO_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s [learner={settings.learner_id}] %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    health = Health(settings.health_stale_s)
    server = None
    if settings.health_port is not None:
        try:
            server = HealthServer(health, settings.health_host, settings.health_port).start()
        except OSError as exc:
            print(
                f"diloco worker: cannot serve the health endpoint on "
                f"{settings.health_host}:{settings.health_port} (--health-port / DILOCO_HEALTH_PORT): {exc}",
                file=sys.stderr,
            )
            return 2
        log.info("health endpoint on %s:%d (/healthz, /readyz)", settings.health_host, server.port)
    from .handshake import FatalSyncError
    from .learner import run_learner  # torch loads only once the settings are known to be valid

    startup.mark("imports")

    stop = threading.Event()
    _install_sigterm(stop, settings.shutdown_timeout_s + 30.0)
    log.info("settings: %s", settings.model_dump_json(exclude={"token"}))
    try:
        code = run_learner(settings, os.environ, stop, health, startup)
        if code == 0 and waits_when_done(settings.when_done, stopped=stop.is_set()):
            wait_until_stopped(stop, health)
        return code
    except FatalSyncError as exc:
        log.error("%s", exc)
        return 3
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
