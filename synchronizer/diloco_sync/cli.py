"""``diloco synchronizer``: start the service from flags and ``DILOCO_*`` environment variables.

Every flag ``--some-name`` can also be given as ``DILOCO_SOME_NAME``; a flag wins over the variable.
The job secret should come from the environment (``DILOCO_JOB_SECRET``), not the command line; so
should the S3 secret key (``DILOCO_STORAGE_SECRET_KEY``). Without explicit S3 keys, boto3 finds
credentials itself (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, a role). Connection
limits (``--header-timeout-s``, ``--body-timeout-s``, ``--keep-alive-timeout-s``,
``--max-connections``) apply below the application (``diloco_sync.connections``); repeated warnings
are rate-limited (``diloco_sync.logs``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from diloco_core.flags import (
    SettingsError,
    add_flags,
    derive_flags,
    option_or_env,
    read,
    read_document,
    validate,
)
from diloco_core.heap import limit_heap

from .logs import configure_logging
from .settings import SyncSettings

if TYPE_CHECKING:
    import uvicorn

UsageError = SettingsError  # a setting is missing or invalid; the message says what to change
# every field of the service's settings, the job's id, and every algorithm setting of the job
FLAGS = derive_flags(SyncSettings, {"": None, "job": ("job_id",), "job.diloco": None, "job.tracking": None})


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="diloco synchronizer", description=__doc__)
    add_flags(ap, FLAGS)
    ap.add_argument("--data-dir", help="folder of the embedded filesystem store (default ./diloco-sync-data)")
    ap.add_argument("--job-config", help="a JobConfig (diloco_core.config): JSON text, or a JSON/YAML file")
    ap.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO)")
    return ap


def parse_settings(argv: list[str], environ: Mapping[str, str] | None = None) -> SyncSettings:
    """Flags + environment (+ ``--job-config``) → settings; raises ``SettingsError`` with what to change."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    given = read(FLAGS, args, environ)
    if not given.has(("job_secret",)):
        raise SettingsError("missing job secret: set DILOCO_JOB_SECRET (or --job-secret)")
    if not given.has(("storage_url",)):
        data_dir = Path(option_or_env(args, environ, "data-dir") or "diloco-sync-data").resolve()
        given.set(("storage_url",), f"file://{data_dir}", "--data-dir")
    job_config = option_or_env(args, environ, "job-config")
    base = {"job": read_document(job_config, "--job-config / DILOCO_JOB_CONFIG")} if job_config else {}
    return validate(SyncSettings, given, base=base, base_source="--job-config")


def _log_level(argv: list[str]) -> str:
    """``--log-level``, else ``DILOCO_LOG_LEVEL``, else INFO (the settings parsed it already)."""
    if "--log-level" in argv:
        return argv[argv.index("--log-level") + 1].upper()
    return (os.environ.get("DILOCO_LOG_LEVEL") or "INFO").upper()


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv)
    except SettingsError as exc:
        print(f"diloco synchronizer: {exc}", file=sys.stderr)
        return 2
    level = _log_level(argv)
    configure_logging(level)
    limit_heap(reuse_large=True)  # before any worker thread makes an arena
    import uvicorn

    from .app import create_app
    from .certificate import ServerCertificate
    from .connections import (
        ConnectionLimits,
        effective_max_connections,
        guarded_protocol,
        open_files_limit,
    )

    try:
        tls = None
        if settings.tls_cert and settings.tls_key:  # both or neither: SyncSettings checks it
            tls = ServerCertificate(settings.tls_cert, settings.tls_key)
    except ValueError as exc:
        print(f"diloco synchronizer: --tls-cert / --tls-key: {exc}", file=sys.stderr)
        return 2

    safe = settings.model_dump(exclude={"job_secret", "storage_secret_key"})
    logger = logging.getLogger("diloco_sync")
    logger.info("settings: %s", json.dumps(safe, default=str))
    max_connections = effective_max_connections(settings.max_connections, open_files_limit())
    if max_connections < settings.max_connections:
        logger.warning(
            "at most %d open connections (not %d): the process may open %d files",
            max_connections,
            settings.max_connections,
            open_files_limit(),
        )
    limits = ConnectionLimits(
        settings.header_timeout_s, settings.body_timeout_s, max_connections, settings.min_body_rate
    )
    failures: list[str] = []
    server: uvicorn.Server | None = None

    def fail(reason: str) -> None:
        """Loading failed for good, or another job took the storage prefix: stop serving, exit
        non-zero with the reason (the log's last line, a container's termination message)."""
        failures.append(reason)
        if server is not None:
            server.should_exit = True

    try:
        app = create_app(settings, on_fatal=fail)
    except Exception as exc:
        print(f"diloco synchronizer: cannot start: {exc}", file=sys.stderr)
        return 1
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=level.lower(),
        log_config=None,  # uvicorn's loggers propagate to the handler configure_logging set up
        access_log=level == "DEBUG",
        timeout_graceful_shutdown=5,
        http=guarded_protocol(limits, tls, app.state.wire),  # type: ignore[arg-type]  # a protocol factory works
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works
        server_header=False,  # every answer's head is on a learner's link; the software is nobody's business
    )
    if tls is not None:
        logger.info("serving HTTPS with the certificate %s", settings.tls_cert)
    server = uvicorn.Server(config)
    _serve(server)
    if failures:
        print(f"diloco synchronizer: {failures[0]}", file=sys.stderr)
        return 1
    if not server.started:
        return 3  # uvicorn could not start (it logged why), as uvicorn.run exits
    return 0


def _serve(server: uvicorn.Server) -> None:
    """Run the server until SIGTERM/SIGINT; a stop by signal is a clean exit (code 0).

    uvicorn handles the signals while it runs and afterwards re-raises the one it caught to the
    handler that was there before it: that is this one, so the process is not killed by it."""

    def stop(_signum: int, _frame: FrameType | None) -> None:
        server.should_exit = True  # also before uvicorn installed its own handlers

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
