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

Memory and time are bounded (:class:`Limits`): the server process never parses
a request body. Every ``POST`` first takes one of ``max_requests`` request
slots and reserves room for its body in a byte budget -- before a byte of the
body is read; without room it gets 503 with ``Retry-After``. The body is read
with a size cap (413) and a deadline (408, connection closed), then handed to
a fresh worker process (forked from a ``forkserver`` that has the package
imported), at most ``max_concurrent`` at once. The worker parses, validates
and computes under an address-space limit (``RLIMIT_DATA``; a request that
needs more gets 413) and is killed at its deadline (the solve's time limit
plus a grace, or ``request_timeout``); SIGTERM kills every worker and the
server exits within seconds. The ``Host`` header must name an allowed host
(loopback names by default), against DNS rebinding. Bad input gets 400
(malformed JSON, a key given twice), 415 (a body not sent as
``Content-Type: application/json``) or 422 (schema, NaN/Infinity, topology or semantic
problems), each problem naming its field. FastAPI and uvicorn are optional
dependencies: ``pip install 'ntp-opt[serve]'``.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import re
import resource
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic.json_schema import models_json_schema
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from ntp_opt import __version__
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    DuplicateKeyError,
    InputError,
    InstanceFile,
    PlanFile,
    instance_from_dict,
    instance_to_dict,
    plan_from_dict,
    unique_object,
)
from ntp_opt.model.files import plan_to_dict as _plan_to_dict
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.model.topology.attrs import SPEED_MIN
from ntp_opt.planners.megatron import MegatronError
from ntp_opt.rules.validate import PlanError, Violation, evaluate
from ntp_opt.solve import PLANNERS, solve

log = logging.getLogger("ntp_opt.service")

#: Defaults of :func:`create_app` (and of ``ntp-opt serve``).
DEFAULT_MAX_BODY_BYTES = 64 * 1024**2
DEFAULT_MAX_TIME_LIMIT = 60.0
DEFAULT_TIME_LIMIT = 10.0
DEFAULT_MAX_CONCURRENT = 2
DEFAULT_MAX_REQUESTS = 8
DEFAULT_MEMORY_BYTES = 1024 * 1024**2
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_REQUEST_TIMEOUT = 120.0
DEFAULT_ALLOWED_HOSTS = ("127.0.0.1", "localhost", "::1")
#: Open connections uvicorn serves at once (each costs little: bodies are
#: only read after admission); more get a plain 503.
MAX_CONNECTIONS = 512
#: Extra seconds a solve's worker gets beyond its time limit before it is killed.
SOLVE_GRACE_S = 10.0
#: Memory a worker may use per byte of body it parses (a real instance needs
#: about 8; the per-endpoint body cap is the worker's memory over this).
BYTES_PER_BODY_BYTE = 8

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
        default=None,
        ge=SPEED_MIN,
        le=1.0,
        allow_inf_nan=False,
        description="speed events only",
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


# --- limits ------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What the service may spend (see ``docs/service.md``).

    Attributes
    ----------
    max_body_bytes
        Largest request body of any endpoint (413 above).
    max_time_limit
        Cap on a solve's time limit, seconds.
    max_concurrent
        Worker processes computing at once (requests wait for one).
    max_requests
        Requests admitted at once (reading, waiting or computing); more get 503.
    memory_bytes
        Memory budget for requests: a quarter holds request bodies in the
        server, the rest is split between the ``max_concurrent`` workers.
    body_timeout
        Seconds to receive a whole body (408 and the connection closed after).
    request_timeout
        Seconds a non-solve request may compute (and any request may wait
        for a worker) before its worker is killed (503).
    solve_grace
        Seconds a solve's worker may run past ``max_time_limit`` (reading,
        validating and answering) before it is killed (503).
    allowed_hosts
        ``Host`` header names accepted (port ignored); ``"*"`` accepts any.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_time_limit: float = DEFAULT_MAX_TIME_LIMIT
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    max_requests: int = DEFAULT_MAX_REQUESTS
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    solve_grace: float = SOLVE_GRACE_S
    allowed_hosts: tuple[str, ...] = DEFAULT_ALLOWED_HOSTS

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.memory_bytes < 1:
            raise ValueError("max_body_bytes and memory_bytes must be positive")
        for name in ("max_time_limit", "body_timeout", "request_timeout", "solve_grace"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite")
        if self.max_concurrent < 1 or self.max_requests < 1:
            raise ValueError("max_concurrent and max_requests must be at least 1")

    @property
    def body_budget(self) -> int:
        """Bytes of request bodies the server process holds at once."""
        return self.memory_bytes // 4

    @property
    def worker_bytes(self) -> int:
        """Memory one worker may allocate above what it inherits."""
        return (self.memory_bytes - self.body_budget) // self.max_concurrent

    @property
    def endpoint_body_bytes(self) -> int:
        """Largest body of a ``POST`` endpoint: the smallest of the caps."""
        return max(
            1,
            min(
                self.max_body_bytes,
                self.worker_bytes // BYTES_PER_BODY_BYTE,
                self.body_budget // 2,
            ),
        )


# --- errors ------------------------------------------------------------------


class _Reject(Exception):
    """A request the service refuses, with its status and problems."""

    def __init__(self, status: int, error: str, problems: list[tuple[str, str]] | None = None):
        super().__init__(error)
        self.status = status
        self.error = error
        self.problems = problems or []


#: Characters of an error message or field name in an error body (echoes are cut).
MAX_MESSAGE = 500


def _error_body(error: str, problems: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """An error body; every text printable (a dashboard shows it) and cut at :data:`MAX_MESSAGE`."""
    return {
        "error": echo(error, MAX_MESSAGE),
        "problems": [
            {"field": echo(f, MAX_MESSAGE), "message": echo(m, MAX_MESSAGE)}
            for f, m in problems or []
        ],
    }


def _error(
    status: int,
    error: str,
    problems: list[tuple[str, str]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(status_code=status, content=_error_body(error, problems), headers=headers)


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


# --- the worker side: parse, check, compute ------------------------------------


class _NotFinite:
    """A JSON number that is not a finite float (``NaN``, ``Infinity``, ``1e999``)."""

    def __init__(self, text: str):
        self.text = text


def _parse_float(text: str) -> float | _NotFinite:
    value = float(text)
    return value if math.isfinite(value) else _NotFinite(text)


#: Integers beyond this are refused (no field of the formats needs more).
_MAX_INT = 2**63 - 1


def _parse_body(body: bytes) -> Any:
    """JSON with every non-finite number and out-of-range integer named by its path."""
    try:
        data = json.loads(
            body,
            parse_constant=_NotFinite,
            parse_float=_parse_float,
            object_pairs_hook=unique_object,
        )
    except DuplicateKeyError as err:  # which one counts is not for the server to guess
        key = echo(err.args[0], 100)
        raise _Reject(400, "malformed JSON", [("body", f"duplicate key {key!r}")]) from None
    except RecursionError:
        raise _Reject(400, "malformed JSON", [("body", "nested too deeply")]) from None
    except UnicodeDecodeError as err:
        raise _Reject(400, "malformed JSON", [("body", f"not UTF-8: {err.reason}")]) from None
    except json.JSONDecodeError as err:
        raise _Reject(
            400, "malformed JSON", [("body", f"malformed JSON at character {err.pos}: {err.msg}")]
        ) from None
    except ValueError as err:  # e.g. an integer literal too long to convert
        raise _Reject(400, "malformed JSON", [("body", str(err))]) from None
    problems: list[tuple[str, str]] = []
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack and len(problems) < 20:
        node, path = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, (*path, k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(node))
        elif isinstance(node, _NotFinite):
            problems.append((_loc(path) or "body", f"{node.text} is not a finite number"))
        elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > _MAX_INT:
            problems.append((_loc(path) or "body", "integer out of range"))
    if problems:
        raise _Reject(422, "invalid request", sorted(problems))
    return data


def _model(cls: type[BaseModel], data: Any) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        problems = [(_loc(tuple(e["loc"])) or "body", str(e["msg"])) for e in err.errors()]
        raise _Reject(422, "invalid request", problems) from None


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


def _do_solve(req: SolveRequest, max_time_limit: float) -> BaseModel:
    instance = _instance(req.instance)
    limit = min(req.time_limit or DEFAULT_TIME_LIMIT, max_time_limit)
    res = solve(instance, req.solver, time_limit=limit, seed=req.seed, threads=1)
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


def _do_validate(req: PlanRequest) -> BaseModel:
    ev = evaluate(_instance(req.instance), _plan(req.plan))
    return ValidateResponse(feasible=ev.feasible, violations=_violations(ev.violations))


def _do_evaluate(req: PlanRequest) -> BaseModel:
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


def _do_export(req: ExportRequest) -> BaseModel:
    from ntp_opt.app.export import RANKS_NAME, equal_batch, megatron_export

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


def _do_replan(req: ReplanRequest) -> BaseModel:
    from ntp_opt.workflows.replan import ClusterEvent, replan

    instance, plan = _instance(req.instance), _plan(req.plan)
    events = [ClusterEvent(e.kind, tuple(e.nodes), e.speed) for e in req.events]
    try:
        out = replan(instance, plan, events, tolerance=req.tolerance, mode=req.mode)
    except PlanError as err:
        problems = [(f"plan: {v.rule}", v.message) for v in err.violations]
        raise _Reject(422, "the running plan is not feasible for the instance", problems) from None
    except ValueError as err:
        raise _Reject(422, "invalid events", [("events", str(err))]) from None
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


#: Endpoint name -> (request model, handler taking the request and the options).
_ENDPOINTS: dict[str, tuple[type[BaseModel], Callable[[Any, float], BaseModel]]] = {
    "solve": (SolveRequest, _do_solve),
    "validate": (PlanRequest, lambda r, _: _do_validate(r)),
    "evaluate": (PlanRequest, lambda r, _: _do_evaluate(r)),
    "export": (ExportRequest, lambda r, _: _do_export(r)),
    "replan": (ReplanRequest, lambda r, _: _do_replan(r)),
}


def handle(endpoint: str, body: bytes, max_time_limit: float) -> tuple[int, bytes]:
    """Answer one ``POST`` body: ``(HTTP status, JSON bytes)``; what a worker runs.

    Parameters
    ----------
    endpoint
        ``"solve"``, ``"validate"``, ``"evaluate"``, ``"export"`` or ``"replan"``.
    body
        The raw request body.
    max_time_limit
        Cap on a solve's time limit.

    Returns
    -------
    (int, bytes)
        200 and the response, or 4xx and an error body naming the fields.
    """
    model, run = _ENDPOINTS[endpoint]
    try:
        req = _model(model, _parse_body(body))
        del body
        result = run(req, max_time_limit)
        return 200, result.model_dump_json().encode()
    except _Reject as err:
        return err.status, json.dumps(_error_body(err.error, err.problems)).encode()
    except InputError as err:
        return 422, json.dumps(_error_body("invalid input", err.problems)).encode()
    except (ValueError, ArithmeticError) as err:
        # a value the model cannot work with (the message says which)
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        where = "instance"
        named = re.match(r"(job\.[a-z_]+): (.*)", msg)
        if named:
            where, msg = f"instance.{named[1]}", named[2]
        return 422, json.dumps(_error_body("invalid input", [(where, msg)])).encode()


def _data_limit(extra: int) -> None:
    """Cap this process's data segment at what it has now plus ``extra`` bytes."""
    vm_data = 0
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmData:"):
                    vm_data = int(line.split()[1]) * 1024
    except OSError:
        return
    if vm_data:
        limit = vm_data + extra
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _worker(
    endpoint: str, body: bytes, max_time_limit: float, memory: int, conn: Connection
) -> None:
    """Entry point of a worker process: one request, then exit."""
    try:
        os.nice(10)  # the server's event loop (/health, admission) goes first
        _data_limit(memory)
        try:
            status, payload = handle(endpoint, body, max_time_limit)
        except MemoryError:
            body = b""
            status, payload = 413, json.dumps(_error_body(_MEMORY_MESSAGE)).encode()
        except RecursionError:
            status, payload = 422, json.dumps(_error_body("input nested too deeply")).encode()
        conn.send((status, payload))
    except BaseException:  # a bug: the traceback goes to the server log only
        traceback.print_exc(file=sys.stderr)
        try:
            conn.send((500, json.dumps(_error_body("internal error; see the server log")).encode()))
        except Exception:
            pass
    finally:
        conn.close()


_MEMORY_MESSAGE = (
    "the request needs more memory than a worker's budget (the server's --max-memory-mb)"
)


# --- the server side: admission, bodies, workers ----------------------------------


_CONTEXT: Any = None


def _context() -> Any:
    """The ``forkserver`` context, with this module preloaded (fast, thread-safe forks)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        _CONTEXT = ctx
    return _CONTEXT


@dataclass
class _Pool:
    """Admission (request slots, body bytes) and worker processes of one app."""

    limits: Limits
    requests: int = 0
    body_bytes: int = 0
    closing: bool = False
    children: set[Any] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    workers: anyio.Semaphore | None = None

    def admit(self, reserve: int) -> bool:
        with self.lock:
            if self.closing or self.requests >= self.limits.max_requests:
                return False
            if self.body_bytes + reserve > self.limits.body_budget:
                return False
            self.requests += 1
            self.body_bytes += reserve
            return True

    def release(self, reserve: int) -> None:
        with self.lock:
            self.requests -= 1
            self.body_bytes -= reserve

    def kill_all(self) -> None:
        """Stop admitting and kill every worker (on shutdown)."""
        with self.lock:
            self.closing = True
            children = list(self.children)
        for proc in children:
            try:
                proc.kill()
            except Exception:
                pass

    def run(self, endpoint: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        """Run one request in a fresh worker; blocking (called in a thread)."""
        ctx = _context()
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker,
            args=(endpoint, body, self.limits.max_time_limit, self.limits.worker_bytes, send),
            daemon=True,
        )
        if self.closing:
            return 503, json.dumps(_error_body("the server is shutting down")).encode()
        try:
            proc.start()
        except OSError as err:  # out of processes or memory: a server-side limit
            log.error("could not start a worker: %s", err)
            send.close()
            recv.close()
            return 503, json.dumps(_error_body("no worker could be started; retry later")).encode()
        with self.lock:
            self.children.add(proc)
            if self.closing:  # shutdown began while it started
                proc.kill()
        send.close()
        del body
        try:
            if not recv.poll(timeout):
                return 503, json.dumps(
                    _error_body(f"stopped at the request deadline ({timeout:.0f} s); retry later")
                ).encode()
            try:
                status, payload = recv.recv()
            except (EOFError, OSError):
                proc.join(5)
                if self.closing:
                    return 503, json.dumps(_error_body("the server is shutting down")).encode()
                if proc.exitcode == -9:  # the kernel's OOM killer
                    return 413, json.dumps(_error_body(_MEMORY_MESSAGE)).encode()
                return 500, json.dumps(
                    _error_body(f"worker exited with {proc.exitcode}; see the server log")
                ).encode()
            return int(status), bytes(payload)
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join()
            recv.close()
            with self.lock:
                self.children.discard(proc)
            proc.close()


def _host_allowed(scope: Scope, allowed: tuple[str, ...]) -> bool:
    if "*" in allowed:
        return True
    host = ""
    for k, v in scope.get("headers") or []:
        if k == b"host":
            host = v.decode("latin-1").strip().lower()
            break
    if host.startswith("["):  # [::1]:8000
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host in allowed


class Guard:
    """ASGI middleware: ``Host`` allowlist (400) and the ``Content-Length`` cap (413)."""

    def __init__(self, app: ASGIApp, limits: Limits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not _host_allowed(scope, self.limits.allowed_hosts):
            msg = "Host header not allowed (the server's --allow-host)"
            await _error(400, "bad Host header", [("Host", msg)])(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.limits.max_body_bytes
            except ValueError:
                await _error(400, "malformed Content-Length header")(scope, receive, send)
                return
            if too_big:
                await _too_big(self.limits.max_body_bytes)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _too_big(cap: int) -> JSONResponse:
    return _error(
        413,
        f"request body larger than {cap} bytes (the server's --max-body-mb and --max-memory-mb)",
        headers={"Connection": "close"},
    )


#: Kept for callers of the previous version.
BodyLimit = Guard


async def _read_body(request: Request, cap: int, timeout: float) -> bytes | Response:
    buf = bytearray()
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > cap:
                    return _too_big(cap)
    except TimeoutError:
        return _error(
            408,
            f"request body not received within {timeout:g} s (the server's --body-timeout)",
            headers={"Connection": "close"},
        )
    except ClientDisconnect:
        return _error(400, "client disconnected", headers={"Connection": "close"})
    return bytes(buf)


# --- the application ---------------------------------------------------------


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


#: The request bodies of the endpoints, published as OpenAPI components.
_BODIES: dict[str, type[BaseModel]] = {
    "SolveRequest": SolveRequest,
    "PlanRequest": PlanRequest,
    "ExportRequest": ExportRequest,
    "ReplanRequest": ReplanRequest,
}


def _body_doc(name: str) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of an endpoint whose body is component ``name``."""
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


class _Service:
    """The endpoints of one application and their state: its limits and its worker pool."""

    def __init__(self, app: FastAPI, limits: Limits):
        self.app = app
        self.limits = limits
        self.pool = _Pool(limits)

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
            models: list[type[BaseModel]] = [InstanceFile, PlanFile, *_BODIES.values()]
            _, top = models_json_schema(
                [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
            )
            components.update(top.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    async def run(self, endpoint: str, request: Request, timeout: float | None = None) -> Response:
        """Admit the request, read its body and compute ``endpoint`` in a worker process."""
        limits, pool = self.limits, self.pool
        media = request.headers.get("content-type")
        if (media or "").split(";")[0].strip().lower() != "application/json":
            # a web page may POST text/plain, forms or a typeless body to a local
            # port without asking first (no CORS preflight); JSON needs the header
            got = "none" if media is None else repr(echo(media, 100))
            return _error(
                415,
                "the body must be JSON sent as Content-Type: application/json",
                [("Content-Type", f"expected application/json, got {got}")],
            )
        cap = limits.endpoint_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            return _too_big(cap)
        reserve = min(int(declared), cap) if declared and declared.isdigit() else cap
        if not pool.admit(reserve):
            return _error(
                503,
                f"busy: {limits.max_requests} requests or {limits.body_budget} bytes of bodies "
                "in progress; retry later",
                # no "Connection: close": a client that sends its whole body
                # before reading (no Expect: 100-continue) would see a broken
                # pipe instead of this answer; uvicorn discards the body
                headers={"Retry-After": "1"},
            )
        try:
            body = await _read_body(request, cap, limits.body_timeout)
            if isinstance(body, Response):
                return body
            wait = timeout or limits.request_timeout
            if pool.workers is None:
                pool.workers = anyio.Semaphore(limits.max_concurrent)
            try:
                with anyio.fail_after(limits.request_timeout):
                    await pool.workers.acquire()
            except TimeoutError:
                return _error(
                    503, "busy: no worker free in time; retry later", headers={"Retry-After": "5"}
                )
            try:
                status, payload = await anyio.to_thread.run_sync(
                    pool.run, endpoint, body, wait, abandon_on_cancel=True
                )
            finally:
                pool.workers.release()
            del body
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
    _context()
    from multiprocessing import forkserver

    forkserver.ensure_running()  # imports the package once, before the first request

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.pool.kill_all()  # unblocks every request waiting on a worker
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=3,
        # open connections (slow or idle ones included) beyond this get 503
        limit_concurrency=MAX_CONNECTIONS,
    )
    _Server(config).run()
