"""JSON files for instances and plans (MODEL.md section 7).

Both formats are pydantic models; their JSON Schemas are published in
``ntp_opt/schemas/`` (``ntp-opt schema instance|plan`` prints them). Loading
validates everything and raises :class:`InputError` naming the file and the
field path; unknown fields are errors. Files ending in ``.gz`` are
gzip-compressed. Saving writes to a temporary file and renames it, so an
interrupted save never leaves a truncated file behind.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from collections.abc import Hashable
from pathlib import Path
from typing import Annotated, Any, Literal

import networkx as nx
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from .instance import Instance
from .job import Job
from .plan import Plan, Replica, Stage
from .safeio import atomic_open
from .topology import DEFAULT_TDP_W, TopologyError

INSTANCE_FORMAT = "ntp-opt/instance@1"
PLAN_FORMAT = "ntp-opt/plan@1"
#: Largest number of cluster nodes a file may declare.
MAX_NODES = 4_000_000
#: Largest file accepted, in bytes (uncompressed size is checked as well).
MAX_FILE_BYTES = 2 * 1024**3
_CHUNK = 1 << 22

NodeId = StrictStr | StrictInt
Finite = Annotated[float, Field(allow_inf_nan=False)]


class InputError(ValueError):
    """Bad input file or data; the message names the source and the field."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [
            f"{source}: {field}: {msg}" if field else f"{source}: {msg}" for field, msg in problems
        ]
        if len(lines) > 10:
            lines = [*lines[:10], f"{source}: ... and {len(lines) - 10} more problems"]
        super().__init__("\n".join(lines))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuNode(_Strict):
    """A GPU (``kind: gpu``)."""

    id: NodeId
    kind: Literal["gpu"]
    state: Literal["healthy", "failed"] = "healthy"
    speed: Finite = Field(default=1.0, gt=0.0, le=1000.0)
    p_fail: Finite = Field(default=0.0, ge=0.0, le=1.0)
    tdp_w: Finite = Field(default=DEFAULT_TDP_W, gt=0.0, le=1e6)


class TrayNode(_Strict):
    """A compute tray / host (``kind: tray``)."""

    id: NodeId
    kind: Literal["tray"]
    p_fail: Finite = Field(default=0.0, ge=0.0, le=1.0)


class DomainNode(_Strict):
    """An NVLink scale-up domain (``kind: domain``)."""

    id: NodeId
    kind: Literal["domain"]
    size: int = Field(ge=1, le=100_000)


class RackNode(_Strict):
    """A rack, the power unit (``kind: rack``)."""

    id: NodeId
    kind: Literal["rack"]
    power_budget_w: Finite | None = Field(default=None, ge=0.0)


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
    power_budget_w: Finite | None = Field(default=None, ge=0.0)


class ClusterData(_Strict):
    """NetworkX node-link data (``node_link_data(G, edges="edges")``)."""

    directed: Literal[False] = False
    multigraph: Literal[False] = False
    graph: GraphAttrs = Field(default_factory=GraphAttrs)
    nodes: list[Node] = Field(max_length=MAX_NODES)
    edges: list[Link] = Field(default_factory=list, max_length=4 * MAX_NODES)


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

    tp: int
    local_batch: int
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


def _loc(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif (
            p in {"gpu", "tray", "domain", "rack", "switch"} and parts and parts[-1].startswith("[")
        ):
            continue  # discriminator tag inserted by pydantic
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


def _problems(err: ValidationError) -> list[tuple[str, str]]:
    return [(_loc(tuple(e["loc"])), e["msg"]) for e in err.errors(include_url=False)]


def _read_json(path: Path) -> Any:
    source = str(path)
    try:
        size = path.stat().st_size
    except OSError as err:
        raise InputError(source, [("", f"cannot read file: {err.strerror}")]) from None
    if size > MAX_FILE_BYTES:
        raise InputError(source, [("", f"file is {size} bytes, more than {MAX_FILE_BYTES}")])
    # Read in chunks, counting node declarations ("kind" keys) on the way, so that a
    # file declaring far more than MAX_NODES nodes (or a gzip bomb) is refused after
    # reading about MAX_NODES nodes' worth of bytes, before any JSON parsing.
    chunks: list[bytes] = []
    total = kinds = 0
    tail = b""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                total += len(chunk)
                if total > MAX_FILE_BYTES:
                    raise InputError(
                        source, [("", f"uncompressed data exceeds {MAX_FILE_BYTES} bytes")]
                    )
                window = tail + chunk
                kinds += window.count(b'"kind"') - tail.count(b'"kind"')
                if kinds > MAX_NODES:
                    raise InputError(
                        source,
                        [("cluster.nodes", f"declares more than {MAX_NODES} nodes (kind fields)")],
                    )
                tail = window[-5:]
                chunks.append(chunk)
    except (OSError, EOFError, zlib.error) as err:
        raise InputError(source, [("", f"cannot read file: {err}")]) from None
    raw = b"".join(chunks)
    del chunks

    seen: list[str] = []

    def constant(token: str) -> float:
        seen.append(token)  # NaN, Infinity, -Infinity: refused below, naming the field
        return float(token.replace("Infinity", "inf"))

    try:
        data = json.loads(raw, parse_constant=constant)
    except UnicodeDecodeError as err:
        raise InputError(source, [("", f"not UTF-8 text: {err.reason}")]) from None
    except json.JSONDecodeError as err:
        raise InputError(
            source, [("", f"malformed JSON at line {err.lineno} column {err.colno}: {err.msg}")]
        ) from None
    except (ValueError, RecursionError) as err:
        raise InputError(source, [("", f"malformed JSON: {err}")]) from None
    if seen:
        try:
            where = _nonfinite(data)
        except RecursionError:
            where = []
        problems = [(_loc(loc), f"{_token(x)} is not valid JSON") for loc, x in where]
        raise InputError(source, problems or [("", f"{seen[0]} is not valid JSON")])
    return data


def _token(x: float) -> str:
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _nonfinite(
    data: Any, loc: tuple[int | str, ...] = ()
) -> list[tuple[tuple[int | str, ...], float]]:
    """Paths and values of the non-finite floats in parsed JSON."""
    if isinstance(data, float) and not math.isfinite(data):
        return [(loc, data)]
    out: list[tuple[tuple[int | str, ...], float]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _nonfinite(v, (*loc, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _nonfinite(v, (*loc, i))
    return out


def _write_json(data: Any, path: Path) -> None:
    """Write through :func:`ntp_opt.safeio.atomic_open` (temp file, fsync, rename)."""
    path = Path(path)
    text = json.dumps(data, indent=None if path.suffix == ".gz" else 1, allow_nan=False)
    with atomic_open(path) as fh:
        if path.suffix == ".gz":
            with gzip.GzipFile(fileobj=fh, mode="wb", mtime=0) as gz:
                gz.write(text.encode())
        else:
            fh.write(text.encode() + b"\n")


# --- instances ---------------------------------------------------------------


def _check_format(data: Any, expected: str, source: str) -> None:
    if not isinstance(data, dict):
        raise InputError(source, [("", f"expected a JSON object, got {type(data).__name__}")])
    fmt = data.get("format")
    if fmt != expected:
        raise InputError(source, [("format", f"expected {expected!r}, got {fmt!r}")])


def instance_from_dict(data: Any, source: str = "<instance>") -> Instance:
    """Build an :class:`Instance` from parsed JSON, validating everything.

    Parameters
    ----------
    data
        Parsed instance JSON.
    source
        Name used in error messages (usually the file name).

    Returns
    -------
    Instance

    Raises
    ------
    InputError
        On any schema or topology problem, naming ``source`` and the field.
    """
    _check_format(data, INSTANCE_FORMAT, source)
    try:
        model = InstanceFile.model_validate(data)
    except ValidationError as err:
        raise InputError(source, _problems(err)) from None
    graph = nx.Graph()
    graph.graph.update(
        {k: getattr(model.cluster.graph, k) for k in data["cluster"].get("graph", {})}
    )
    seen: set[Hashable] = set()
    dups: list[tuple[str, str]] = []
    node_rows = []
    # Attributes keep the order of the file (so that load + save is the identity)
    # and the validated values.
    raw_nodes = data["cluster"]["nodes"]
    for i, node in enumerate(model.cluster.nodes):
        if node.id in seen:
            dups.append((f"cluster.nodes[{i}].id", f"duplicate node id {node.id!r}"))
        seen.add(node.id)
        attrs = {k: getattr(node, k) for k in raw_nodes[i] if k != "id"}
        if isinstance(node, SwitchNode):  # the schema's default tier, which the topology needs
            attrs.setdefault("tier", node.tier)
        node_rows.append((node.id, attrs))
    graph.add_nodes_from(node_rows)
    for i, link in enumerate(model.cluster.edges):
        for end in ("source", "target"):
            if getattr(link, end) not in seen:
                dups.append((f"cluster.edges[{i}].{end}", f"unknown node {getattr(link, end)!r}"))
    raw_edges = data["cluster"].get("edges", [])
    graph.add_edges_from(
        (
            link.source,
            link.target,
            {k: getattr(link, k) for k in raw_edges[i] if k not in ("source", "target")},
        )
        for i, link in enumerate(model.cluster.edges)
    )
    if dups:
        raise InputError(source, dups)
    try:
        meta = dict(model.meta)
        if model.description is not None:
            meta["description"] = model.description
        return Instance(model.name, graph, model.job, meta, copy_graph=False)
    except TopologyError as err:
        raise InputError(source, [("cluster", p) for p in err.problems]) from None


def instance_to_dict(instance: Instance) -> dict[str, Any]:
    """The JSON form of ``instance`` (format ``ntp-opt/instance@1``)."""
    meta = dict(instance.meta)
    description = meta.pop("description", None)
    for node in instance.cluster.nodes:
        if isinstance(node, bool) or not isinstance(node, str | int):
            raise ValueError(f"node id {node!r} is not a string or an integer; JSON needs one")
    cluster = nx.node_link_data(instance.cluster, edges="edges")
    data: dict[str, Any] = {"format": INSTANCE_FORMAT, "name": instance.name}
    if description is not None:
        data["description"] = description
    data["meta"] = meta
    data["job"] = instance.job.model_dump(mode="json")
    data["cluster"] = cluster
    return data


def load_instance(path: str | os.PathLike[str]) -> Instance:
    """Load and validate an instance file (``.json`` or ``.json.gz``).

    Raises
    ------
    InputError
        Naming the file and the field path of every problem.
    """
    p = Path(path)
    return instance_from_dict(_read_json(p), str(p))


def save_instance(instance: Instance, path: str | os.PathLike[str]) -> None:
    """Write ``instance`` to ``path`` atomically (gzip if it ends in ``.gz``)."""
    _write_json(instance_to_dict(instance), Path(path))


# --- plans -------------------------------------------------------------------


def plan_from_dict(data: Any, source: str = "<plan>") -> Plan:
    """Build a :class:`Plan` from parsed JSON (schema checks only).

    The model's rules (healthy GPUs, budgets, ...) are the validator's job:
    see :func:`ntp_opt.validate.validate`.
    """
    _check_format(data, PLAN_FORMAT, source)
    try:
        model = PlanFile.model_validate(data)
    except ValidationError as err:
        raise InputError(source, _problems(err)) from None
    replicas = tuple(
        Replica(
            tp=r.tp,
            local_batch=r.local_batch,
            stages=tuple(Stage(s.domain, tuple(s.gpus), s.power) for s in r.stages),
        )
        for r in model.replicas
    )
    return Plan(model.instance, replicas, model.metrics.model_dump(exclude_unset=True))


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The JSON form of ``plan`` (format ``ntp-opt/plan@1``).

    Raises
    ------
    ValueError
        If the plan's metrics lack ``goodput`` or ``relative_goodput`` (use
        :func:`ntp_opt.validate.evaluate` to compute them).
    """
    metrics = {
        k: v for k, v in plan.metrics.items() if not (isinstance(v, float) and not math.isfinite(v))
    }
    missing = [k for k in ("goodput", "relative_goodput") if k not in metrics]
    if missing:
        raise ValueError(f"plan metrics lack {missing}; evaluate the plan first")
    return {
        "format": PLAN_FORMAT,
        "instance": plan.instance,
        "replicas": [
            {
                "tp": r.tp,
                "local_batch": r.local_batch,
                "stages": [
                    {"domain": s.domain, "gpus": list(s.gpus), "power": s.power} for s in r.stages
                ],
            }
            for r in plan.replicas
        ],
        "metrics": metrics,
    }


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Load a plan file; schema errors raise :class:`InputError`."""
    p = Path(path)
    return plan_from_dict(_read_json(p), str(p))


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write ``plan`` to ``path`` atomically."""
    _write_json(plan_to_dict(plan), Path(path))


def json_schema(kind: Literal["instance", "plan"]) -> dict[str, Any]:
    """The published JSON Schema of an instance or plan file."""
    model = InstanceFile if kind == "instance" else PlanFile
    schema = model.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
