"""The request and response bodies of the endpoints (pydantic models).

Instances and plans are taken as plain JSON objects (:data:`InstanceJSON`,
:data:`PlanJSON`) and validated once, in the worker, by
:mod:`ntp_opt.model.files`, which names the field of every problem; the
OpenAPI description still shows their full schemas.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from ntp_opt.model.topology.attrs import SPEED_MIN
from ntp_opt.solve import PLANNERS

Planner = Literal[PLANNERS]  # type: ignore[valid-type]

# The OpenAPI description shows the full schemas of the formats (the components
# InstanceFile and PlanFile, added by ntp_opt.app.service.app).
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
    """One event of ``POST /replan`` (see :class:`ntp_opt.workflows.replan.ClusterEvent`)."""

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
    """What ``POST /replan`` returns (see :class:`ntp_opt.workflows.replan.Replanned`)."""

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
    """One broken rule (see :class:`ntp_opt.rules.validate.Violation`)."""

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


#: The request bodies of the endpoints, published as OpenAPI components.
BODIES: dict[str, type[BaseModel]] = {
    "SolveRequest": SolveRequest,
    "PlanRequest": PlanRequest,
    "ExportRequest": ExportRequest,
    "ReplanRequest": ReplanRequest,
}
