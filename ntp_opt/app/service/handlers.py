"""What a worker computes: one ``POST`` body parsed, checked and answered (:func:`handle`).

The body's JSON is parsed with every non-finite number, out-of-range integer
and repeated key refused (400 or 422, naming the field), validated against the
endpoint's request model, and the instance and plan against the file formats
(:mod:`ntp_opt.model.files`); then the planner, validator, exporter or
re-planner runs. Runs in the worker process, never in the server.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from ntp_opt.app.service.bodies import (
    EvaluateResponse,
    ExportRequest,
    ExportResponse,
    PlanRequest,
    ReplanRequest,
    ReplanResponse,
    SolveRequest,
    SolveResponse,
    ValidateResponse,
    ViolationData,
)
from ntp_opt.app.service.errors import Reject, error_body
from ntp_opt.app.service.limits import DEFAULT_TIME_LIMIT
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    DuplicateKeyError,
    InputError,
    instance_from_dict,
    instance_to_dict,
    plan_from_dict,
    plan_to_dict,
    unique_object,
)
from ntp_opt.model.files.safe_json import field_path
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.megatron import MegatronError
from ntp_opt.rules.validate import PlanError, Violation, evaluate
from ntp_opt.solve import solve


def _prefixed(name: str, problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(f"{name}.{f}" if f else name, m) for f, m in problems]


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
        raise Reject(400, "malformed JSON", [("body", f"duplicate key {key!r}")]) from None
    except RecursionError:
        raise Reject(400, "malformed JSON", [("body", "nested too deeply")]) from None
    except UnicodeDecodeError as err:
        raise Reject(400, "malformed JSON", [("body", f"not UTF-8: {err.reason}")]) from None
    except json.JSONDecodeError as err:
        raise Reject(
            400, "malformed JSON", [("body", f"malformed JSON at character {err.pos}: {err.msg}")]
        ) from None
    except ValueError as err:  # e.g. an integer literal too long to convert
        raise Reject(400, "malformed JSON", [("body", str(err))]) from None
    problems = _number_problems(data)
    if problems:
        raise Reject(422, "invalid request", sorted(problems))
    return data


def _number_problems(data: Any) -> list[tuple[str, str]]:
    """The non-finite numbers and out-of-range integers of ``data`` (the first 20 found)."""
    problems: list[tuple[str, str]] = []
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack and len(problems) < 20:
        node, path = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, (*path, k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(node))
        elif isinstance(node, _NotFinite):
            problems.append((field_path(path) or "body", f"{node.text} is not a finite number"))
        elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > _MAX_INT:
            problems.append((field_path(path) or "body", "integer out of range"))
    return problems


def _model(cls: type[BaseModel], data: Any) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        problems = [(field_path(tuple(e["loc"])) or "body", str(e["msg"])) for e in err.errors()]
        raise Reject(422, "invalid request", problems) from None


def _instance(data: dict[str, Any]) -> Instance:
    try:
        return instance_from_dict(data, "instance")
    except InputError as err:
        raise Reject(422, "invalid instance", _prefixed("instance", err.problems)) from None


def _plan(data: dict[str, Any]) -> Plan:
    try:
        return plan_from_dict(data, "plan")
    except InputError as err:
        raise Reject(422, "invalid plan", _prefixed("plan", err.problems)) from None


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
        plan = plan_to_dict(res.plan.with_metrics(**res.evaluation.as_metrics()))
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
        raise Reject(422, str(err).split(":")[0], problems) from None
    except ValueError as err:
        raise Reject(422, str(err)) from None
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
        raise Reject(422, "the running plan is not feasible for the instance", problems) from None
    except ValueError as err:
        raise Reject(422, "invalid events", [("events", str(err))]) from None
    return ReplanResponse(
        choice=out.choice,
        moved=out.moved,
        plan=plan_to_dict(out.plan),
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
    except Reject as err:
        return err.status, json.dumps(error_body(err.error, err.problems)).encode()
    except InputError as err:
        return 422, json.dumps(error_body("invalid input", err.problems)).encode()
    except (ValueError, ArithmeticError) as err:
        # a value the model cannot work with (the message says which)
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        where = "instance"
        named = re.match(r"(job\.[a-z_]+): (.*)", msg)
        if named:
            where, msg = f"instance.{named[1]}", named[2]
        return 422, json.dumps(error_body("invalid input", [(where, msg)])).encode()
