"""The FastAPI application: lifespan (load the state in the background, then start the round loop
and the storage watcher: see ``startup``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

import anyio.to_thread
from diloco_core.request_proof import challenge
from diloco_core.storage import open_store
from diloco_core.tracking import open_tracking
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from .api import is_binary_route, is_learner_route, router
from .auth import AuthenticateFirst, TokenCheck, authenticated_or_none
from .body import JsonBodyLimit
from .dealer import Dealer
from .errors import ApiError, api_error_handler, http_error_handler, validation_error_handler
from .learner_limits import PerLearnerLimits, default_max_requests
from .persistence import StateStore
from .revocations import Revocations
from .service import SyncService
from .settings import SyncSettings
from .startup import Startup, build_round_parts

log = logging.getLogger(__name__)


def build_service(settings: SyncSettings) -> SyncService:
    secret = settings.storage_secret_key
    store = open_store(
        settings.storage_url,
        endpoint_url=settings.storage_endpoint_url,
        region=settings.storage_region,
        access_key=settings.storage_access_key,
        secret_key=secret.get_secret_value() if secret is not None else None,
    )
    return SyncService(
        settings, StateStore(store, settings.shard_index, settings.job.job_id, owner=settings.owner)
    )


def create_app(
    settings: SyncSettings,
    service: SyncService | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """The application; ``on_fatal(reason)`` is called when loading the state fails for good (wrong
    credentials, storage of another job: ``cannot start: ...``) or when another job takes the
    storage prefix while it runs (``stopped: ...``): the caller stops the server and exits non-zero.
    ``app.state.wire`` is where the server's connections count their bytes at the socket
    (``connections.guarded_protocol``), which the service reports."""
    service = service or build_service(settings)
    tracking = open_tracking(
        settings.job.tracking,
        run=f"synchronizer-{settings.shard_index}",
        group=settings.job.job_id,
        config=settings.job.model_dump(mode="json", include={"diloco"}),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        desk, runner = build_round_parts(service, tracking)
        startup = Startup(service, desk, runner, on_fatal)
        app.state.service, app.state.desk, app.state.startup = service, desk, startup
        app.state.dealer = Dealer(service.store, service.guard, settings.shard_index)
        startup.begin()  # the server answers while the state loads (storage may be down)
        try:
            yield
        finally:
            await startup.stop()
            if tracking is not None:
                await anyio.to_thread.run_sync(tracking.close)

    app = FastAPI(
        title="DiLoCo synchronizer",
        version="1",
        description="Merges learners' outer gradients per fragment and serves the global parameters.",
        lifespan=lifespan,
    )
    app.state.wire = service.wire
    _add_error_handlers(app)
    tokens = TokenCheck(
        settings.job_secret.get_secret_value(), Revocations(settings.revocations_file).min_generation
    )
    _add_middleware(app, settings, tokens)
    app.include_router(router)
    _add_index_page(app)
    _add_probe_routes(app, tokens)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Refusals (the API's own, invalid requests, the framework's) answered in the protocol's ``ErrorBody``."""
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)


def _add_middleware(app: FastAPI, settings: SyncSettings, tokens: TokenCheck) -> None:
    """The cap on JSON bodies, the per-learner limits and, in front of both, the token check."""
    app.add_middleware(
        JsonBodyLimit, limit=settings.max_json_body_bytes, exempt=is_binary_route, takes_body=is_learner_route
    )
    app.add_middleware(
        PerLearnerLimits,
        max_requests=settings.max_requests_per_learner or default_max_requests(settings.job.diloco.fragments),
        max_uploads=settings.max_uploads_per_learner,
        is_upload=is_binary_route,
    )
    # added last, so it runs first: nothing about a learner route's request is read before this
    app.add_middleware(AuthenticateFirst, check=tokens, protects=is_learner_route)


def _add_index_page(app: FastAPI) -> None:
    page = resources.files("diloco_sync").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)


def _add_probe_routes(app: FastAPI, tokens: TokenCheck) -> None:
    """Liveness, readiness and metrics, for the kubelet and Prometheus."""

    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> PlainTextResponse:
        """Liveness: the process serves requests."""
        return PlainTextResponse("ok")

    @app.get("/readyz", responses={503: {"description": "state not loaded or storage unavailable"}})
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: state loaded and object storage reachable; ``reason`` says why not. Where the
        storage is and which object failed (``storage_error``) is told to learners only (their
        token, as on the learner routes): an unauthenticated caller learns that storage is down. A
        caller whose proof did not authenticate is told the instance to sign for, as a 401 tells it."""
        svc: SyncService = request.app.state.service
        startup: Startup = request.app.state.startup
        detailed = authenticated_or_none(tokens, request.scope) is not None
        reason = startup.not_ready_reason(detailed=detailed)
        body = {
            "ready": reason is None,
            "loaded": startup.loaded,
            "storage_ok": svc.guard.ok,
            "storage_error": svc.guard.last_error if detailed else None,
            "reason": reason,
        }
        signed = not detailed and "authorization" in request.headers
        headers = {"WWW-Authenticate": challenge(tokens.instance)} if signed else None
        return JSONResponse(body, status_code=200 if reason is None else 503, headers=headers)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        """Prometheus metrics."""
        svc: SyncService = request.app.state.service
        svc.refresh_gauges()
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with validation failures documented as the 400 ErrorBody they really are."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None and "400" not in responses:
                    responses["400"] = {
                        "description": "Bad request",
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
                        },
                    }
        app.openapi_schema = schema
    return app.openapi_schema
