"""``diloco synchronizer``: start the service from flags and ``DILOCO_*`` environment variables.

Every flag ``--some-name`` can also be given as ``DILOCO_SOME_NAME``; a flag wins over the variable.
The job secret should come from the environment (``DILOCO_JOB_SECRET``), not the command line; so
should the S3 secret key (``DILOCO_STORAGE_SECRET_KEY``). Without explicit S3 keys, boto3 finds
credentials itself (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, a role).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import yaml
from diloco_core.config import DiLoCoSettings, JobConfig
from pydantic import ValidationError

from .settings import SyncSettings

if TYPE_CHECKING:
    import uvicorn

ENV_PREFIX = "DILOCO_"
# flag → DiLoCoSettings field (the algorithm's knobs, when no --job-config file is given)
_DILOCO_FLAGS: dict[str, type] = {
    "inner_steps": int,
    "fragments": int,
    "overlap": int,
    "quorum": int,
    "grace_gamma": float,
    "grace_cap_steps": float,
    "outer_lr": float,
    "outer_momentum": float,
    "delayed_nesterov": int,
    "codec": str,
    "merge_rule": str,
    "staleness_power": float,
    "max_staleness": int,
    "heartbeat_timeout_s": float,
}


class UsageError(Exception):
    """A setting is missing or invalid; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="diloco synchronizer", description=__doc__)
    add = ap.add_argument
    add("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 in a container)")
    add("--port", type=int, help="port to listen on (default 8470)")
    add("--storage", help="file:///path or s3://bucket/prefix (default: file:// of --data-dir)")
    add("--data-dir", help="folder of the embedded filesystem store (default ./diloco-sync-data)")
    add("--storage-endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL)")
    add("--storage-region", help="S3 region (default: AWS_REGION)")
    add("--storage-access-key", help="S3 access key id (default: AWS_ACCESS_KEY_ID)")
    add("--storage-secret-key", help="S3 secret key (prefer DILOCO_STORAGE_SECRET_KEY)")
    add("--job-secret", help="the job secret (prefer DILOCO_JOB_SECRET)")
    add("--job-id", help="job id (default: from --job-config, else 'local')")
    add("--job-config", help="YAML or JSON file with a JobConfig (diloco_core.config)")
    add("--plan", dest="plan_path", help="fragment plan JSON (default: adopt the first learner's plan)")
    for name, kind in _DILOCO_FLAGS.items():
        add(f"--{name.replace('_', '-')}", type=kind, help=f"DiLoCo setting {name}")
    add("--no-token-weighting", action="store_true", default=None, help="weight learners equally")
    add("--shard-index", type=int, help="this replica's shard (fragment p belongs to shard p %% num_shards)")
    add("--num-shards", type=int, help="number of synchronizer replicas")
    add("--shard-urls", help="comma-separated base URLs of all shards, in shard order")
    add("--tls-cert", help="TLS certificate file (PEM)")
    add("--tls-key", help="TLS private key file (PEM)")
    add("--max-body-bytes", type=int, help="largest accepted payload (init, contributions)")
    add("--max-json-body-bytes", type=int, help="largest accepted JSON body (register, heartbeat)")
    add("--memory-budget-bytes", type=int, help="contribution bytes held in memory while storage is down")
    add("--keep-versions", type=int, help="fragment versions kept in storage")
    add("--heartbeat-interval-s", type=float, help="heartbeat interval told to learners")
    add("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO)")
    return ap


def _with_env(args: argparse.Namespace) -> dict[str, Any]:
    """Flag values, falling back to DILOCO_<NAME> variables, converted like the flag would be."""
    parser = build_parser()
    kinds = {a.dest: a.type for a in parser._actions if a.dest != "help"}
    values: dict[str, Any] = {}
    for dest, kind in kinds.items():
        value = getattr(args, dest, None)
        if value is None:
            env = os.environ.get(ENV_PREFIX + dest.upper())
            if env is not None and env != "":
                try:
                    value = kind(env) if callable(kind) else env
                except ValueError as exc:
                    raise UsageError(f"{ENV_PREFIX}{dest.upper()}={env!r}: {exc}") from exc
                if dest == "no_token_weighting":
                    value = env.lower() in ("1", "true", "yes")
        values[dest] = value
    return values


def _job_config(v: dict[str, Any]) -> JobConfig:
    base: dict[str, Any] = {}
    if v["job_config"]:
        path = Path(v["job_config"])
        if not path.is_file():
            raise UsageError(f"--job-config {path}: no such file")
        text = path.read_text(encoding="utf-8")
        base = json.loads(text) if path.suffix == ".json" else (yaml.safe_load(text) or {})
    diloco = dict(base.get("diloco", {}))
    diloco.update({k: v[k] for k in _DILOCO_FLAGS if v[k] is not None})
    if v["no_token_weighting"]:
        diloco["token_weighting"] = False
    base["diloco"] = DiLoCoSettings.model_validate(diloco).model_dump()
    if v["job_id"]:
        base["job_id"] = v["job_id"]
    return JobConfig.model_validate(base)


def parse_settings(argv: list[str]) -> SyncSettings:
    """Flags + environment → settings; raises ``UsageError`` with what to change."""
    v = _with_env(build_parser().parse_args(argv))
    if not v["job_secret"]:
        raise UsageError("missing job secret: set DILOCO_JOB_SECRET (or --job-secret)")
    storage = v["storage"] or f"file://{Path(v['data_dir'] or 'diloco-sync-data').resolve()}"
    fields = {
        "host": v["host"], "port": v["port"], "storage_url": storage,
        "storage_endpoint_url": v["storage_endpoint_url"], "storage_region": v["storage_region"],
        "storage_access_key": v["storage_access_key"], "storage_secret_key": v["storage_secret_key"],
        "job_secret": v["job_secret"], "plan_path": v["plan_path"], "shard_index": v["shard_index"],
        "num_shards": v["num_shards"], "tls_cert": v["tls_cert"], "tls_key": v["tls_key"],
        "max_body_bytes": v["max_body_bytes"], "max_json_body_bytes": v["max_json_body_bytes"],
        "memory_budget_bytes": v["memory_budget_bytes"],
        "keep_versions": v["keep_versions"], "heartbeat_interval_s": v["heartbeat_interval_s"],
    }  # fmt: skip
    settings = {k: val for k, val in fields.items() if val is not None}
    if v["shard_urls"]:
        settings["shard_urls"] = tuple(u.strip() for u in v["shard_urls"].split(",") if u.strip())
    try:
        return SyncSettings(job=_job_config(v), **settings)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise UsageError(f"invalid settings: {problems}") from exc


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv)
    except UsageError as exc:
        print(f"diloco synchronizer: {exc}", file=sys.stderr)
        return 2
    level = (os.environ.get(ENV_PREFIX + "LOG_LEVEL") or "INFO").upper()
    if "--log-level" in argv:
        level = argv[argv.index("--log-level") + 1].upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from .app import create_app

    safe = settings.model_dump(exclude={"job_secret", "storage_secret_key"})
    logging.getLogger("diloco_sync").info("settings: %s", json.dumps(safe, default=str))
    failures: list[str] = []
    server: uvicorn.Server | None = None

    def fail(reason: str) -> None:
        """Loading the state failed for good: stop serving, exit non-zero with the reason."""
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
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
        log_level=level.lower(),
        access_log=level == "DEBUG",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    _serve(server)
    if failures:
        print(f"diloco synchronizer: cannot start: {failures[0]}", file=sys.stderr)
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
