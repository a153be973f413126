"""A small HTTP/JSON service for schedulers: ``ntp-opt serve``.

Endpoints take and return the JSON formats of :mod:`ntp_opt.files`
(``ntp-opt/instance@1``, ``ntp-opt/plan@1``); the OpenAPI description is at
``/openapi.json`` (browsable at ``/docs``). See ``docs/service.md``.

* ``GET /health`` -- liveness, version, planner names, limits.
* ``POST /solve`` -- instance + planner + time limit -> plan, status, bound, gap.
* ``POST /validate`` -- instance + plan -> feasible, violations.
* ``POST /evaluate`` -- instance + plan -> recomputed metrics and violations.
* ``POST /export/megatron-ntp`` -- instance + plan -> Megatron-LM NTP config and rank table.
* ``POST /replan`` -- instance + running plan + events -> new plan, GPUs moved, bound.

Limits: request bodies above ``max_body_bytes`` get 413 (checked on the
``Content-Length`` header and again while reading, for chunked bodies); the
``time_limit`` of a solve is capped at ``max_time_limit`` (the response says
which was used); at most ``max_concurrent`` solves run at once, others get
503. Bad input gets 400 (malformed JSON) or 422 (schema, topology or
semantic problems), each problem naming its field; an unexpected failure
gets 500 with a generic message and no traceback. FastAPI and uvicorn are
optional dependencies: ``pip install 'ntp-opt[serve]'``.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import __version__
from .files import (
    InputError,
    InstanceFile,
    PlanFile,
    instance_from_dict,
    instance_to_dict,
    plan_from_dict,
)
from .files import plan_to_dict as _plan_to_dict
from .instance import Instance
from .megatron import MegatronError
from .plan import Plan
from .solve import PLANNERS, solve
from .validate import PlanError, Violation, evaluate

log = logging.getLogger("ntp_opt.service")

#: Defaults of :func:`create_app` (and of ``ntp-opt serve``).
DEFAULT_MAX_BODY_BYTES = 64 * 1024**2
DEFAULT_MAX_TIME_LIMIT = 60.0
DEFAULT_TIME_LIMIT = 10.0
DEFAULT_MAX_CONCURRENT = 2

Planner = Literal[PLANNERS]  # type: ignore[valid-type]

# Instances and plans are taken as plain JSON objects and validated once, by
# ntp_opt.files (as files are), which names the field of every problem; the
# OpenAPI description still shows their full schemas (see _openapi below).
InstanceJSON = Annotated[
    dict[str, Any],
    WithJsonSchema(
        {
            "allOf": [{"$ref": "#/components/schemas/InstanceFile"}],
            "description": "an ntp-opt/instance@1 document",
        }
    ),
]
PlanJSON = Annotated[
    dict[str, Any],
    WithJsonSchema(
        {
            "allOf": [{"$ref": "#/components/schemas/PlanFile"}],
            "description": "an ntp-opt/plan@1 document",
        }
    ),
]


# --- request and response bodies -------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SolveRequest(_Body):
    """``POST /solve``."""

    instance: InstanceJSON
    solver: Planner = Field(default="optimal", description="planner name")
    time_limit: float | None = Field(
        default=None,
        gt=0.0,
        allow_inf_nan=False,
        description="seconds for exact planners (default 10; capped by the server)",
    )
    seed: int = Field(default=0, ge=0, le=2**31 - 1)


class PlanRequest(_Body):
    """``POST /validate`` and ``POST /evaluate``."""

    instance: InstanceJSON
    plan: PlanJSON


class ExportRequest(_Body):
    """``POST /export/megatron-ntp``."""

    instance: InstanceJSON
    plan: PlanJSON
    reorder: bool = Field(default=False, description="move reduced replicas first")
    uniform_batch: bool = Field(
        default=True, description="accepted for compatibility: one local batch is always required"
    )
    equal_batch: bool = Field(default=False, description="give every replica the same batch first")
    placeholder_hosts: list[str] = Field(
        default_factory=list, description="hosts that may run the inactive (placeholder) ranks"
    )
    placeholder_gpus: int | None = Field(default=None, ge=1, le=1024)


class EventData(_Body):
    """One event of ``POST /replan`` (see :class:`ntp_opt.replan.ClusterEvent`)."""

    kind: Literal["fail", "repair", "speed"]
    nodes: list[str | int] = Field(min_length=1, description="GPU or tray ids")
    speed: float | None = Field(
        default=None, gt=0.0, le=1.0, allow_inf_nan=False, description="speed events only"
    )


class ReplanRequest(_Body):
    """``POST /replan``: the instance the plan was made for, the plan, the events."""

    instance: InstanceJSON
    plan: PlanJSON
    events: list[EventData] = Field(default_factory=list)
    tolerance: float = Field(
        default=1e-3,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="relative goodput traded to avoid migration",
    )
    mode: Literal["auto", "local", "global"] = "auto"
    return_instance: bool = Field(
        default=False, description="also return the instance after the events"
    )


class ReplanResponse(BaseModel):
    """What ``POST /replan`` returns (see :class:`ntp_opt.replan.Replanned`)."""

    choice: str = Field(description="local, swap or global: which plan was kept")
    moved: int = Field(description="GPUs whose replica or stage changed")
    plan: dict[str, Any] = Field(description="ntp-opt/plan@1, for the instance after the events")
    goodput: float
    relative_goodput: float
    bound: float
    gap: float
    runtime_s: float
    tried: dict[str, dict[str, float]] = Field(description="goodput and moves of each plan tried")
    instance: dict[str, Any] | None = Field(
        default=None, description="ntp-opt/instance@1 after the events, if asked for"
    )


class ViolationData(BaseModel):
    """One broken rule (see :class:`ntp_opt.validate.Violation`)."""

    rule: str
    message: str
    replica: int | None = None
    stage: int | None = None
    node: str | int | None = None


class SolveResponse(BaseModel):
    """What ``POST /solve`` returns (see :class:`ntp_opt.solve.Result`)."""

    status: str
    limit: str
    plan: dict[str, Any] | None = Field(description="ntp-opt/plan@1, or null without a plan")
    objective: float | None
    relative_objective: float | None
    bound: float | None
    gap: float | None
    runtime_s: float
    solver: str
    time_limit: float = Field(description="the time limit used (after the server's cap)")
    reason: str | None


class ValidateResponse(BaseModel):
    """What ``POST /validate`` returns."""

    feasible: bool
    violations: list[ViolationData]


class EvaluateResponse(ValidateResponse):
    """What ``POST /evaluate`` returns: the validator's recomputed figures."""

    goodput: float
    relative_goodput: float
    step_time_s: float | None
    total_batch: int
    replicas: int
    reduced_replicas: int
    gpus_used: int
    site_power_w: float


class ExportResponse(BaseModel):
    """What ``POST /export/megatron-ntp`` returns."""

    config: dict[str, Any]
    ranks: list[dict[str, Any]]
    rank_file: str
    files: dict[str, str] = Field(default_factory=dict, description="file name -> content")


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body."""

    error: str
    problems: list[dict[str, str]] = Field(default_factory=list)


# --- helpers -----------------------------------------------------------------


class _Reject(Exception):
    """A request the service refuses, with its status and problems."""

    def __init__(self, status: int, error: str, problems: list[tuple[str, str]] | None = None):
        super().__init__(error)
        self.status = status
        self.error = error
        self.problems = problems or []


def _error(status: int, error: str, problems: list[tuple[str, str]] | None = None) -> JSONResponse:
    body = {"error": error, "problems": [{"field": f, "message": m} for f, m in problems or []]}
    return JSONResponse(status_code=status, content=body)


def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in {"gpu", "tray", "domain", "rack", "switch"} and parts and parts[-1][0] == "[":
            continue  # discriminator tag inserted by pydantic
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


def _prefixed(name: str, problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(f"{name}.{f}" if f else name, m) for f, m in problems]


def _instance(data: dict[str, Any]) -> Instance:
    try:
        return instance_from_dict(data, "instance")
    except InputError as err:
        raise _Reject(422, "invalid instance", _prefixed("instance", err.problems)) from None


def _plan(data: dict[str, Any]) -> Plan:
    try:
        return plan_from_dict(data, "plan")
    except InputError as err:
        raise _Reject(422, "invalid plan", _prefixed("plan", err.problems)) from None


def _violations(vs: tuple[Violation, ...] | list[Violation]) -> list[ViolationData]:
    return [
        ViolationData(
            rule=v.rule,
            message=v.message,
            replica=v.replica,
            stage=v.stage,
            node=v.node if isinstance(v.node, str | int) or v.node is None else str(v.node),
        )
        for v in vs
    ]


class BodyLimit:
    """ASGI middleware: 413 for a request body larger than ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                await _error(400, "malformed Content-Length header")(scope, receive, send)
                return
            if too_big:
                await self._refuse(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body larger than {self.max_bytes} bytes (the server's --max-body-mb)"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _error(413, self._message())(scope, receive, send)


# --- the application ---------------------------------------------------------


def create_app(
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_time_limit: float = DEFAULT_MAX_TIME_LIMIT,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
) -> FastAPI:
    """The ASGI application of ``ntp-opt serve``.

    Parameters
    ----------
    max_body_bytes
        Largest request body; larger ones get 413.
    max_time_limit
        Largest time limit of a solve, in seconds; larger requests are capped.
    max_concurrent
        Solves running at once; more get 503.

    Returns
    -------
    fastapi.FastAPI
    """
    if max_body_bytes < 1 or not (math.isfinite(max_time_limit) and max_time_limit > 0):
        raise ValueError("max_body_bytes and max_time_limit must be positive")
    if max_concurrent < 1:
        raise ValueError("max_concurrent must be at least 1")
    app = FastAPI(
        title="ntp-opt",
        version=__version__,
        description=(
            "Plan LLM training with nonuniform tensor parallelism on a GPU cluster with "
            "failed, slow or risky GPUs. Bodies use the JSON formats ntp-opt/instance@1 "
            "and ntp-opt/plan@1."
        ),
        responses={
            400: {"model": ErrorResponse, "description": "malformed JSON"},
            413: {"model": ErrorResponse, "description": "request body too large"},
            422: {"model": ErrorResponse, "description": "invalid input; problems name fields"},
        },
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (InstanceFile, PlanFile):
                sub = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(sub.pop("$defs", {}))
                components[model.__name__] = sub
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = _openapi  # type: ignore[method-assign]
    slots = threading.BoundedSemaphore(max_concurrent)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        bad = [e for e in errors if e.get("type") == "json_invalid"]
        if bad:
            problems = []
            for e in bad:
                where = e["loc"][1] if len(e["loc"]) > 1 else "?"
                why = (e.get("ctx") or {}).get("error", e["msg"])
                problems.append(("body", f"malformed JSON at character {where}: {why}"))
            return _error(400, "malformed JSON", problems)
        problems = [(_loc(tuple(e["loc"])[1:]) or "body", str(e["msg"])) for e in errors]
        return _error(422, "invalid request", problems)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(_Reject)
    async def _reject(request: Request, exc: _Reject) -> JSONResponse:
        return _error(exc.status, exc.error, exc.problems)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return _error(500, f"internal error ({type(exc).__name__}); see the server log")

    @app.get("/health")
    def health() -> dict[str, Any]:
        """Liveness: version, planner names and the server's limits."""
        return {
            "status": "ok",
            "version": __version__,
            "planners": list(PLANNERS),
            "max_body_bytes": max_body_bytes,
            "max_time_limit": max_time_limit,
            "max_concurrent": max_concurrent,
        }

    @app.post("/solve", response_model=SolveResponse)
    def solve_endpoint(req: SolveRequest) -> SolveResponse:
        """Plan the instance with a planner; the plan passed the validator."""
        instance = _instance(req.instance)
        limit = min(req.time_limit or DEFAULT_TIME_LIMIT, max_time_limit)
        if not slots.acquire(blocking=False):
            raise _Reject(503, f"busy: {max_concurrent} solves already running; retry later")
        try:
            res = solve(instance, req.solver, time_limit=limit, seed=req.seed, threads=1)
        finally:
            slots.release()
        plan = None
        if res.plan is not None and res.evaluation is not None:
            plan = _plan_to_dict(res.plan.with_metrics(**res.evaluation.as_metrics()))
        return SolveResponse(
            status=str(res.status),
            limit=str(res.limit),
            plan=plan,
            objective=res.objective,
            relative_objective=res.relative_objective,
            bound=res.bound,
            gap=res.gap,
            runtime_s=res.runtime_s,
            solver=res.solver,
            time_limit=limit,
            reason=res.reason,
        )

    @app.post("/validate", response_model=ValidateResponse)
    def validate_endpoint(req: PlanRequest) -> ValidateResponse:
        """Every rule of the model the plan breaks (empty when feasible)."""
        ev = evaluate(_instance(req.instance), _plan(req.plan))
        return ValidateResponse(feasible=ev.feasible, violations=_violations(ev.violations))

    @app.post("/evaluate", response_model=EvaluateResponse)
    def evaluate_endpoint(req: PlanRequest) -> EvaluateResponse:
        """The validator's recomputed goodput, power and rule violations."""
        ev = evaluate(_instance(req.instance), _plan(req.plan))
        return EvaluateResponse(
            feasible=ev.feasible,
            violations=_violations(ev.violations),
            goodput=ev.goodput,
            relative_goodput=ev.relative_goodput,
            step_time_s=ev.step_time if math.isfinite(ev.step_time) else None,
            total_batch=ev.total_batch,
            replicas=ev.n_replicas,
            reduced_replicas=ev.n_reduced,
            gpus_used=ev.gpus_used,
            site_power_w=ev.site_power_w,
        )

    @app.post("/export/megatron-ntp", response_model=ExportResponse)
    def export_endpoint(req: ExportRequest) -> ExportResponse:
        """Megatron-LM NTP configuration and rank table of a plan (422 if not expressible)."""
        from .export import RANKS_NAME, equal_batch, megatron_export

        instance, plan = _instance(req.instance), _plan(req.plan)
        try:
            if req.equal_batch:
                plan = equal_batch(instance, plan)
            ex = megatron_export(
                instance,
                plan,
                reorder=req.reorder,
                placeholder_hosts=req.placeholder_hosts,
                placeholder_gpus=req.placeholder_gpus,
            )
        except (PlanError, MegatronError) as err:
            problems = [(v.rule, v.message) for v in err.violations]
            raise _Reject(422, str(err).split(":")[0], problems) from None
        except ValueError as err:
            raise _Reject(422, str(err)) from None
        config = {**ex.extras, "nonuniform_tp": ex.config_json()}
        return ExportResponse(
            config=config,
            ranks=[r.as_dict() for r in ex.rows],
            rank_file=ex.files[RANKS_NAME],
            files=ex.files,
        )

    @app.post("/replan", response_model=ReplanResponse)
    def replan_endpoint(req: ReplanRequest) -> ReplanResponse:
        """Re-plan a running plan after failures, repairs or stragglers (few GPUs move)."""
        from .replan import ClusterEvent, replan

        instance, plan = _instance(req.instance), _plan(req.plan)
        events = [ClusterEvent(e.kind, tuple(e.nodes), e.speed) for e in req.events]
        if not slots.acquire(blocking=False):
            raise _Reject(503, f"busy: {max_concurrent} solves already running; retry later")
        try:
            out = replan(instance, plan, events, tolerance=req.tolerance, mode=req.mode)
        except PlanError as err:
            problems = [(f"plan: {v.rule}", v.message) for v in err.violations]
            raise _Reject(
                422, "the running plan is not feasible for the instance", problems
            ) from None
        except ValueError as err:
            raise _Reject(422, "invalid events", [("events", str(err))]) from None
        finally:
            slots.release()
        return ReplanResponse(
            choice=out.choice,
            moved=out.moved,
            plan=_plan_to_dict(out.plan),
            goodput=out.goodput,
            relative_goodput=out.relative_goodput,
            bound=out.bound,
            gap=out.gap,
            runtime_s=out.runtime_s,
            tried={k: {kk: float(vv) for kk, vv in v.items()} for k, v in out.details.items()},
            instance=instance_to_dict(out.instance) if req.return_instance else None,
        )

    return app


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_time_limit: float = DEFAULT_MAX_TIME_LIMIT,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    log_level: str = "info",
) -> None:
    """Run the service with uvicorn until interrupted (loopback by default).

    Parameters
    ----------
    host, port
        Where to listen; ``127.0.0.1`` keeps it local to the machine.
    max_body_bytes, max_time_limit, max_concurrent
        As for :func:`create_app`.
    log_level
        uvicorn's log level.
    """
    import uvicorn

    app = create_app(
        max_body_bytes=max_body_bytes,
        max_time_limit=max_time_limit,
        max_concurrent=max_concurrent,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)
