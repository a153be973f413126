"""Instances and plans from and to their JSON form, and files (load and save).

Loading validates everything (:mod:`ntp_opt.model.files.schema`) and raises
:class:`~ntp_opt.model.files.safe_json.InputError` naming the file and the
field path. An instance's cluster records take the column checks of
:func:`ntp_opt.model.records.compile_records` when they prove them valid, and
pydantic record by record (:func:`instance_from_dict_reference`) otherwise.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ntp_opt.model.files import caps
from ntp_opt.model.files.dump import write_json
from ntp_opt.model.files.safe_json import (
    InputError,
    keys_and_finite,
    loads_plain,
    parse_checked,
    plain_text,
    read_bytes,
    read_json,
    validation_problems,
)
from ntp_opt.model.files.schema import (
    INSTANCE_FORMAT,
    PLAN_FORMAT,
    SCHEMA_MAX_NODES,
    ClusterData,
    InstanceFile,
    PlanFile,
    SwitchNode,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.model.records import compile_records
from ntp_opt.model.topology import TopologyError

if TYPE_CHECKING:
    import networkx as nx


# --- instances ---------------------------------------------------------------


def check_format(data: Any, expected: str, source: str) -> None:
    """Raise :class:`InputError` unless ``data`` is an object whose ``format`` is ``expected``."""
    if not isinstance(data, dict):
        raise InputError(source, [("", f"expected a JSON object, got {type(data).__name__}")])
    fmt = data.get("format")
    if fmt != expected:
        raise InputError(source, [("format", f"expected {expected!r}, got {fmt!r}")])


def _check_counts(data: dict[str, Any], source: str) -> None:
    """Refuse more than ``caps.MAX_NODES`` nodes (4x as many edges) before building objects."""
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        return
    for key, cap in (("nodes", caps.MAX_NODES), ("edges", 4 * caps.MAX_NODES)):
        items = cluster.get(key)
        if isinstance(items, list) and len(items) > cap:
            raise InputError(
                source, [(f"cluster.{key}", f"declares more than {cap} {key} ({len(items)})")]
            )


_DIGITS = re.compile(r"[0-9]{1,9}")


def _strict_ready(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the two JSON forms strict validation cannot take as they are.

    ``job.tp_allowed`` (a JSON array) becomes a tuple and the keys of
    ``job.tp_efficiency`` (JSON object keys are strings) that are plain decimal
    integers become ints; any other key is left a string and refused. The rest
    is validated strictly: ``true`` or ``"1.0"`` is not a number, ``"4"`` not
    an integer, as the published schema says.
    """
    job = data.get("job")
    if not isinstance(job, dict):
        return data
    job = dict(job)
    if isinstance(job.get("tp_allowed"), list):
        job["tp_allowed"] = tuple(job["tp_allowed"])
    eff = job.get("tp_efficiency")
    if isinstance(eff, dict):
        job["tp_efficiency"] = {
            int(k) if isinstance(k, str) and _DIGITS.fullmatch(k) else k: v for k, v in eff.items()
        }
    return {**data, "job": job}


def instance_from_dict(data: Any, source: str = "<instance>") -> Instance:
    """Build an :class:`Instance` from parsed JSON, validating everything.

    The cluster's records are checked column by column and compiled straight
    into :attr:`Instance.arrays`; the NetworkX graph (:attr:`Instance.cluster`)
    is built from them when first read, so the instance keeps references to
    ``data``'s node records until then (do not change them). Data the column
    checks cannot prove valid (a wrong format or node count included) takes
    :func:`instance_from_dict_reference`, whose errors name the node and the field.

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
    fast = _from_columns(data, source)
    return fast[0] if fast is not None else instance_from_dict_reference(data, source)


def _from_columns(data: Any, source: str) -> tuple[Instance, int] | None:
    """:func:`_instance_from_columns` of data whose format and counts pass, else ``None``.

    ``None`` leaves the verdict to :func:`instance_from_dict_reference`, which
    checks the format and the counts first, as here.
    """
    try:
        check_format(data, INSTANCE_FORMAT, source)
        _check_counts(data, source)
    except InputError:
        return None
    return _instance_from_columns(data)


def _instance_from_columns(data: dict[str, Any]) -> tuple[Instance, int] | None:
    """The instance and the number of keys in its records, or ``None`` unless every
    check passes on the columns."""
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        return None
    nodes, edges = cluster.get("nodes"), cluster.get("edges", [])
    if type(nodes) is not list or type(edges) is not list:
        return None
    if len(nodes) > SCHEMA_MAX_NODES or len(edges) > 4 * SCHEMA_MAX_NODES:
        return None
    head = {**data, "cluster": {**cluster, "nodes": [], "edges": []}}
    try:  # everything but the records, through the schema
        model = InstanceFile.model_validate(_strict_ready(head), strict=True)
    except ValidationError:
        return None
    site = model.cluster.graph
    compiled = compile_records(nodes, edges, site.power_budget_w, model.job.tp)
    if compiled is None:
        return None
    graph_attrs = {k: getattr(site, k) for k in cluster.get("graph", {})}
    # The graph, if ever read, is built from the node records and the compiled
    # edges: the instance keeps no reference to the edge records.
    instance = Instance.from_arrays(
        model.name,
        compiled.arrays,
        model.job,
        _meta(model),
        lambda: compiled.graph(graph_attrs, nodes),
    )
    return instance, compiled.n_keys


def _meta(model: InstanceFile) -> dict[str, Any]:
    meta = dict(model.meta)
    if model.description is not None:
        meta["description"] = model.description
    return meta


def instance_from_dict_reference(data: Any, source: str = "<instance>") -> Instance:
    """:func:`instance_from_dict` the reference way: pydantic per record, the graph first.

    Every node and edge is validated by the schema's models, the graph is
    built and checked (:func:`ntp_opt.model.topology.check_topology`), then
    compiled. Slower by far on large clusters; it gives the error messages of
    :func:`instance_from_dict` and is the oracle of its column checks.

    Parameters
    ----------
    data
        Parsed instance JSON.
    source
        Name used in error messages.

    Returns
    -------
    Instance
        With its graph built.

    Raises
    ------
    InputError
        On any schema or topology problem, naming ``source`` and the field.
    """
    check_format(data, INSTANCE_FORMAT, source)
    _check_counts(data, source)
    return _instance_from_models(data, source)


def _instance_from_models(data: dict[str, Any], source: str) -> Instance:
    try:
        model = InstanceFile.model_validate(_strict_ready(data), strict=True)
    except ValidationError as err:
        raise InputError(source, validation_problems(err)) from None
    import networkx as nx  # here, not at import: the column path builds no graph

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
        return Instance(model.name, graph, model.job, _meta(model), copy_graph=False)
    except TopologyError as err:
        raise InputError(source, [("cluster", p) for p in err.problems]) from None


def check_cluster(graph: nx.Graph, source: str = "<cluster>") -> None:
    """Check a cluster graph against the instance file schema (strict), as a load would.

    Used by ``ntp-opt gen`` so that it never writes a file no command can load.

    Raises
    ------
    InputError
        Naming ``source`` and the field (``cluster.nodes[5].tdp_w``).
    """
    if graph.number_of_nodes() > caps.MAX_NODES:
        raise InputError(source, [("cluster.nodes", f"more than {caps.MAX_NODES} nodes")])
    import networkx as nx

    data = nx.node_link_data(graph, edges="edges")
    try:
        nodes, edges = data["nodes"], data["edges"]
        ClusterData.model_validate({**data, "nodes": [], "edges": []}, strict=True)
        if compile_records(nodes, edges, None) is not None:
            return  # the records proven valid column by column (topology included)
        ClusterData.model_validate(data, strict=True)
    except ValidationError as err:
        raise InputError(
            source, [(f"cluster.{f}", m) for f, m in validation_problems(err)]
        ) from None


def instance_to_dict(instance: Instance) -> dict[str, Any]:
    """The JSON form of ``instance`` (format ``ntp-opt/instance@1``)."""
    meta = dict(instance.meta)
    description = meta.pop("description", None)
    for node in instance.cluster.nodes:
        if isinstance(node, bool) or not isinstance(node, str | int):
            raise ValueError(f"node id {node!r} is not a string or an integer; JSON needs one")
    import networkx as nx

    cluster = nx.node_link_data(instance.cluster, edges="edges")
    data: dict[str, Any] = {"format": INSTANCE_FORMAT, "name": instance.name}
    if description is not None:
        data["description"] = description
    data["meta"] = meta
    job = instance.job.model_dump(mode="json")
    if job["micro_batch"] == 1:  # the default: files written before the field stay byte-equal
        del job["micro_batch"]
    data["job"] = job
    data["cluster"] = cluster
    return data


def load_instance(path: str | os.PathLike[str]) -> Instance:
    """Load and validate an instance file (``.json`` or ``.json.gz``).

    The fast way when it applies: the file parsed without per-value hooks,
    its cluster compiled by the column checks (:func:`instance_from_dict`),
    then the parse proven equal to the checked one (no repeated key, no
    overflowed number). Otherwise the checked
    parse (of the file read again) and :func:`instance_from_dict`, whose
    errors name the field.

    Raises
    ------
    InputError
        Naming the file and the field path of every problem.
    """
    p = Path(path)
    source = str(p)
    raw = read_bytes(p)
    text = plain_text(raw)
    if text is None:
        return instance_from_dict(parse_checked(raw, source), source)
    del raw
    colons = text.count(":")  # ':' never occurs inside a multi-byte UTF-8 character
    data = loads_plain(text)
    del text  # peak memory: the checked path below reads the file again
    fast = _from_columns(data, source)
    if fast is not None and _same_as_checked(colons, data, fast[1]):
        return fast[0]
    del data, fast
    return instance_from_dict(parse_checked(read_bytes(p), source), source)


def _same_as_checked(colons: int, data: dict[str, Any], record_keys: int) -> bool:
    """Whether the checked parse gives ``data`` too, for records the column checks accepted.

    ``colons``: the ``:`` characters of the text ``data`` was parsed from;
    ``record_keys``: the keys in its cluster's records (counted by the checks).

    Their values are proven scalars and finite, so only the rest of the file
    is walked for floats, and the keys are counted as
    :func:`~ntp_opt.model.files.safe_json.parse_json` counts them.
    """
    cluster = data["cluster"]
    rest = {**data, "cluster": {**cluster, "nodes": [], "edges": []}}
    keys, finite = keys_and_finite(rest)
    return finite and colons == keys + record_keys


def save_instance(
    instance: Instance,
    path: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Write ``instance`` to ``path`` atomically (gzip if it ends in ``.gz``).

    ``inputs``: files the command read; writing onto one of them is refused
    (:class:`ntp_opt.model.safeio.UnsafeTargetError`).
    """
    write_json(instance_to_dict(instance), Path(path), inputs)


# --- plans -------------------------------------------------------------------


def plan_from_dict(data: Any, source: str = "<plan>") -> Plan:
    """Build a :class:`Plan` from parsed JSON (schema checks only).

    The model's rules (healthy GPUs, budgets, ...) are the validator's job:
    see :func:`ntp_opt.rules.validate.validate`.
    """
    check_format(data, PLAN_FORMAT, source)
    try:
        model = PlanFile.model_validate(data, strict=True)
    except ValidationError as err:
        raise InputError(source, validation_problems(err)) from None
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
        :func:`ntp_opt.rules.validate.evaluate` to compute them).
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
    return plan_from_dict(read_json(p), str(p))


def save_plan(
    plan: Plan, path: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]] = ()
) -> None:
    """Write ``plan`` to ``path`` atomically (never onto one of ``inputs``)."""
    write_json(plan_to_dict(plan), Path(path), inputs)
