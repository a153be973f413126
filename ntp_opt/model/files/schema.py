"""The two file formats as pydantic models, and their published JSON Schemas.

``ntp-opt/instance@1`` (:class:`InstanceFile`) and ``ntp-opt/plan@1``
(:class:`PlanFile`); ``ntp_opt/schemas/`` holds :func:`json_schema` of each
(``ntp-opt schema instance|plan`` prints them). Unknown fields are errors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from ntp_opt.model.files import caps
from ntp_opt.model.job import Job
from ntp_opt.model.topology import DEFAULT_TDP_W
from ntp_opt.model.topology.attrs import SPEED_MAX, SPEED_MIN

INSTANCE_FORMAT = "ntp-opt/instance@1"
PLAN_FORMAT = "ntp-opt/plan@1"
#: The schema's cap on the cluster's nodes (4x as many edges), fixed when the
#: models are defined: lowering :data:`ntp_opt.model.files.caps.MAX_NODES`
#: later leaves it as it was.
SCHEMA_MAX_NODES = caps.MAX_NODES

NodeId = StrictStr | StrictInt
Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuNode(_Strict):
    """A GPU (``kind: gpu``)."""

    id: NodeId
    kind: Literal["gpu"]
    state: Literal["healthy", "failed"] = "healthy"
    speed: Finite = Field(default=1.0, ge=SPEED_MIN, le=SPEED_MAX)
    p_fail: Finite = Field(default=0.0, ge=0.0, le=1.0)
    tdp_w: Finite = Field(default=DEFAULT_TDP_W, ge=1.0, le=1e6)
    max_power_w: Finite | None = Field(
        default=None,
        ge=1.0,
        le=1e6,
        description=(
            "Largest power limit the board accepts, in watts (must be >= tdp_w). "
            "Absent: tdp_w * (1 + job.max_boost), i.e. only the job's boost cap applies."
        ),
    )
    uuid: str | None = Field(
        default=None, min_length=1, max_length=200, description="Device UUID (nvidia-smi)."
    )
    host: str | None = Field(
        default=None, min_length=1, max_length=255, description="Hostname the GPU is on."
    )
    index: StrictInt | None = Field(
        default=None, ge=0, le=1_000_000, description="Device index on its host."
    )

    @field_validator("max_power_w")
    @classmethod
    def _max_power_at_least_tdp(cls, v: float | None, info: ValidationInfo) -> float | None:
        tdp = info.data.get("tdp_w")
        if v is not None and tdp is not None and v < tdp:
            raise ValueError(
                f"{v:g} is below tdp_w {tdp:g} (a board accepts at least its nominal limit)"
            )
        return v


class TrayNode(_Strict):
    """A compute tray / host (``kind: tray``)."""

    id: NodeId
    kind: Literal["tray"]
    p_fail: Finite = Field(default=0.0, ge=0.0, le=1.0)
    host: str | None = Field(
        default=None, min_length=1, max_length=255, description="Hostname (scheduler's name)."
    )


class DomainNode(_Strict):
    """An NVLink scale-up domain (``kind: domain``)."""

    id: NodeId
    kind: Literal["domain"]
    size: int = Field(ge=1, le=100_000)


class RackNode(_Strict):
    """A rack, the power unit (``kind: rack``)."""

    id: NodeId
    kind: Literal["rack"]
    power_budget_w: Finite | None = Field(default=None, ge=0.0, le=1e12)
    budget_source: str | None = Field(
        default=None,
        min_length=1,
        max_length=1000,
        description="Where power_budget_w came from (written by ntp-opt import; shown by info).",
    )


class SwitchNode(_Strict):
    """A scale-out switch (``kind: switch``)."""

    id: NodeId
    kind: Literal["switch"]
    tier: Literal["leaf", "spine"] = "leaf"


Node = Annotated[
    GpuNode | TrayNode | DomainNode | RackNode | SwitchNode, Field(discriminator="kind")
]


class Link(_Strict):
    """An edge of the cluster graph."""

    source: NodeId
    target: NodeId
    bandwidth_gbps: Finite | None = Field(default=None, gt=0.0)


class GraphAttrs(_Strict):
    """Attributes of the cluster graph itself."""

    name: str | None = None
    power_budget_w: Finite | None = Field(default=None, ge=0.0, le=1e12)


class ClusterData(_Strict):
    """NetworkX node-link data (``node_link_data(G, edges="edges")``)."""

    directed: Literal[False] = False
    multigraph: Literal[False] = False
    graph: GraphAttrs = Field(default_factory=GraphAttrs)
    nodes: list[Node] = Field(max_length=SCHEMA_MAX_NODES)
    edges: list[Link] = Field(default_factory=list, max_length=4 * SCHEMA_MAX_NODES)


class InstanceFile(_Strict):
    """An instance file, format ``ntp-opt/instance@1``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"$id": "https://ntp-opt.invalid/schemas/instance@1.schema.json"},
    )

    format: Literal["ntp-opt/instance@1"]
    name: str = Field(min_length=1, max_length=200)
    description: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)
    cluster: ClusterData
    job: Job


class StageData(_Strict):
    """One stage of a replica."""

    domain: NodeId
    gpus: list[NodeId]
    power: Finite = 1.0


class ReplicaData(_Strict):
    """One replica of a plan."""

    tp: int = Field(ge=1, le=1_000_000)
    local_batch: int = Field(ge=0, le=1_000_000_000_000)
    stages: list[StageData]


class MetricsData(BaseModel):
    """Figures reported with a plan; other scalar fields are allowed."""

    model_config = ConfigDict(extra="allow")

    goodput: Finite = Field(ge=0.0)
    relative_goodput: Finite = Field(ge=0.0)
    bound: Finite | None = None


class PlanFile(_Strict):
    """A plan file, format ``ntp-opt/plan@1``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"$id": "https://ntp-opt.invalid/schemas/plan@1.schema.json"},
    )

    format: Literal["ntp-opt/plan@1"]
    instance: str
    replicas: list[ReplicaData]
    metrics: MetricsData


def json_schema(kind: Literal["instance", "plan"]) -> dict[str, Any]:
    """The published JSON Schema of an instance or plan file."""
    model = InstanceFile if kind == "instance" else PlanFile
    schema = model.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
