"""The ASGI application (:func:`create_app`) and its server (:func:`serve`).

Routes, the OpenAPI description, and the path of one ``POST``: the checks of
:mod:`~ntp_opt.app.service.limits`, admission and the body read, then the
computation in a worker (:mod:`~ntp_opt.app.service.workers`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ntp_opt import __version__
from ntp_opt.app.service.bodies import (
    BODIES,
    ErrorResponse,
    EvaluateResponse,
    ExportResponse,
    ReplanResponse,
    SolveResponse,
    ValidateResponse,
)
from ntp_opt.app.service.errors import error_response
from ntp_opt.app.service.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_TIME_LIMIT,
    MAX_CONNECTIONS,
    Guard,
    Limits,
    busy,
    read_body,
    reservation,
    too_big,
    unsupported_media,
)
from ntp_opt.app.service.workers import WorkerPool, forkserver_context
from ntp_opt.model.files import InstanceFile, PlanFile
from ntp_opt.solve import PLANNERS

log = logging.getLogger("ntp_opt.service")


def create_app(
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_time_limit: float = DEFAULT_MAX_TIME_LIMIT,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    limits: Limits | None = None,
) -> FastAPI:
    """The ASGI application of ``ntp-opt serve``.

    Parameters
    ----------
    max_body_bytes
        Largest request body; larger ones get 413.
    max_time_limit
        Largest time limit of a solve, in seconds; larger requests are capped.
    max_concurrent
        Worker processes computing at once.
    limits
        Every limit (:class:`Limits`); overrides the three above when given.

    Returns
    -------
    fastapi.FastAPI
        Its ``state.pool.kill_all()`` stops every worker (done on SIGTERM by
        :func:`serve`).
    """
    if limits is None:
        limits = Limits(
            max_body_bytes=max_body_bytes,
            max_time_limit=max_time_limit,
            max_concurrent=max_concurrent,
        )
    app = FastAPI(
        title="ntp-opt",
        version=__version__,
        description=(
            "Plan LLM training with nonuniform tensor parallelism on a GPU cluster with "
            "failed, slow or risky GPUs. Bodies use the JSON formats ntp-opt/instance@1 "
            "and ntp-opt/plan@1."
        ),
        responses={
            400: {"model": ErrorResponse, "description": "malformed JSON or Host header"},
            408: {"model": ErrorResponse, "description": "body not received in time"},
            415: {"model": ErrorResponse, "description": "Content-Type not application/json"},
            413: {"model": ErrorResponse, "description": "body or memory need too large"},
            422: {"model": ErrorResponse, "description": "invalid input; problems name fields"},
            503: {"model": ErrorResponse, "description": "busy (Retry-After) or deadline"},
        },
    )
    app.add_middleware(Guard, limits=limits)
    service = _Service(app, limits)
    app.state.pool = service.pool
    app.state.limits = limits
    app.openapi = service.openapi  # type: ignore[method-assign]
    app.get("/health")(service.health)
    app.post("/solve", response_model=SolveResponse, openapi_extra=_body_doc("SolveRequest"))(
        service.solve_endpoint
    )
    app.post("/validate", response_model=ValidateResponse, openapi_extra=_body_doc("PlanRequest"))(
        service.validate_endpoint
    )
    app.post("/evaluate", response_model=EvaluateResponse, openapi_extra=_body_doc("PlanRequest"))(
        service.evaluate_endpoint
    )
    app.post(
        "/export/megatron-ntp",
        response_model=ExportResponse,
        openapi_extra=_body_doc("ExportRequest"),
    )(service.export_endpoint)
    app.post("/replan", response_model=ReplanResponse, openapi_extra=_body_doc("ReplanRequest"))(
        service.replan_endpoint
    )
    return app


def _body_doc(name: str) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of an endpoint whose body is component ``name``."""
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


class _Service:
    """The endpoints of one application and their state: its limits and its worker pool."""

    def __init__(self, app: FastAPI, limits: Limits):
        self.app = app
        self.limits = limits
        self.pool = WorkerPool(limits)

    def openapi(self) -> dict[str, Any]:
        """The OpenAPI schema, with the file formats and request bodies as components."""
        app = self.app
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            models: list[type[BaseModel]] = [InstanceFile, PlanFile, *BODIES.values()]
            _, top = models_json_schema(
                [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
            )
            components.update(top.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    async def run(self, endpoint: str, request: Request, timeout: float | None = None) -> Response:
        """Admit the request, read its body and compute ``endpoint`` in a worker process."""
        limits, pool = self.limits, self.pool
        refused = unsupported_media(request)
        if refused is not None:
            return refused
        cap = limits.endpoint_body_bytes
        reserve = reservation(request, cap)
        if reserve is None:
            return too_big(cap)
        if not pool.admit(reserve):
            return busy(limits)
        try:
            body = await read_body(request, cap, limits.body_timeout)
            if isinstance(body, Response):
                return body
            answer = await pool.compute(endpoint, body, timeout or limits.request_timeout)
            del body
            if answer is None:
                return error_response(
                    503, "busy: no worker free in time; retry later", headers={"Retry-After": "5"}
                )
            status, payload = answer
            if status >= 500:
                log.error("%s: %s", request.url.path, payload[:500].decode(errors="replace"))
            return Response(content=payload, status_code=status, media_type="application/json")
        finally:
            pool.release(reserve)

    async def health(self) -> dict[str, Any]:
        """Liveness: version, planner names and the server's limits."""
        limits, pool = self.limits, self.pool
        return {
            "status": "ok",
            "version": __version__,
            "planners": list(PLANNERS),
            "max_body_bytes": limits.max_body_bytes,
            "endpoint_body_bytes": limits.endpoint_body_bytes,
            "max_time_limit": limits.max_time_limit,
            "max_concurrent": limits.max_concurrent,
            "max_requests": limits.max_requests,
            "memory_bytes": limits.memory_bytes,
            "body_timeout": limits.body_timeout,
            "request_timeout": limits.request_timeout,
            "solve_grace": limits.solve_grace,
            "requests_in_progress": pool.requests,
            "workers_running": len(pool.children),
        }

    async def solve_endpoint(self, request: Request) -> Response:
        """Plan the instance with a planner; the plan passed the validator."""
        # the worker is killed at the largest time limit plus a grace; the
        # planner itself returns at the requested one
        limits = self.limits
        return await self.run("solve", request, limits.max_time_limit + limits.solve_grace)

    async def validate_endpoint(self, request: Request) -> Response:
        """Every rule of the model the plan breaks (empty when feasible)."""
        return await self.run("validate", request)

    async def evaluate_endpoint(self, request: Request) -> Response:
        """The validator's recomputed goodput, power and rule violations."""
        return await self.run("evaluate", request)

    async def export_endpoint(self, request: Request) -> Response:
        """Megatron-LM NTP configuration and rank table of a plan (422 if not expressible)."""
        return await self.run("export", request)

    async def replan_endpoint(self, request: Request) -> Response:
        """Re-plan a running plan after failures, repairs or stragglers (few GPUs move)."""
        return await self.run("replan", request)


class _KillPoolOnExit:
    """Mixed into ``uvicorn.Server``: on SIGTERM or SIGINT, kill the workers first."""

    pool_app: Any = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        """Kill every worker (unblocking the requests waiting on one), then exit as uvicorn does."""
        self.pool_app.state.pool.kill_all()  # unblocks every request waiting on a worker
        super().handle_exit(sig, frame)  # type: ignore[misc]


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_time_limit: float = DEFAULT_MAX_TIME_LIMIT,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    limits: Limits | None = None,
    log_level: str = "info",
) -> None:
    """Run the service with uvicorn until SIGTERM or SIGINT (loopback by default).

    Parameters
    ----------
    host, port
        Where to listen; ``127.0.0.1`` keeps it local to the machine.
    max_body_bytes, max_time_limit, max_concurrent, limits
        As for :func:`create_app`.
    log_level
        uvicorn's log level.
    """
    import uvicorn

    if limits is None:
        limits = Limits(
            max_body_bytes=max_body_bytes,
            max_time_limit=max_time_limit,
            max_concurrent=max_concurrent,
        )
    if (
        host not in limits.allowed_hosts
        and host not in ("0.0.0.0", "::")
        and ("*" not in limits.allowed_hosts)
    ):
        limits = Limits(**{**limits.__dict__, "allowed_hosts": (*limits.allowed_hosts, host)})
    app = create_app(limits=limits)
    forkserver_context()
    from multiprocessing import forkserver

    forkserver.ensure_running()  # imports the package once, before the first request

    server_type = type("_Server", (_KillPoolOnExit, uvicorn.Server), {})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=3,
        # open connections (slow or idle ones included) beyond this get 503
        limit_concurrency=MAX_CONNECTIONS,
    )
    server = server_type(config)
    server.pool_app = app
    server.run()
