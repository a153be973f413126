"""Cluster records (node-link JSON) straight into arrays, with vectorised checks.

An instance file's ``cluster.nodes`` and ``cluster.edges`` are lists of small
records; at 131k-1M GPUs, validating each through pydantic and building a
NetworkX graph costs far more than parsing the file. :func:`compile_records`
checks them column by column (types, ranges, unknown fields, duplicate ids,
containment, domain sizes) and builds :class:`ClusterArrays` directly, equal
to what :func:`ntp_opt.model.instance.compile_cluster` gives for the graph of
the same records. It only *accepts*: on anything it cannot prove valid it
returns ``None``, and the caller takes the reference path (pydantic per
record, the graph, :func:`ntp_opt.model.topology.check_topology`), whose
error messages name the file, the node and the field.

:meth:`CompiledRecords.graph` builds the graph the reference path builds, for
:attr:`ntp_opt.model.instance.Instance.cluster` to compute on first read.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from ntp_opt.model.instance import ClusterArrays
from ntp_opt.model.topology.attrs import SPEED_MAX, SPEED_MIN

if TYPE_CHECKING:
    import networkx as nx

#: Fields whose validated value is a float (an integer in the file becomes one).
FLOAT_FIELDS = frozenset(
    {"speed", "p_fail", "tdp_w", "max_power_w", "power_budget_w", "bandwidth_gbps"}
)

_GPU, _TRAY, _DOMAIN, _RACK, _SWITCH = range(5)
_KIND_CODE = {"gpu": _GPU, "tray": _TRAY, "domain": _DOMAIN, "rack": _RACK, "switch": _SWITCH}
_ALLOWED_KEYS = (
    frozenset(
        {"id", "kind", "state", "speed", "p_fail", "tdp_w", "max_power_w", "uuid", "host", "index"}
    ),
    frozenset({"id", "kind", "p_fail", "host"}),
    frozenset({"id", "kind", "size"}),
    frozenset({"id", "kind", "power_budget_w", "budget_source"}),
    frozenset({"id", "kind", "tier"}),
)
_REQUIRED_KEYS = (
    frozenset({"id", "kind"}),
    frozenset({"id", "kind"}),
    frozenset({"id", "kind", "size"}),
    frozenset({"id", "kind"}),
    frozenset({"id", "kind"}),
)
# Containment edges by (smaller kind code, larger kind code): gpu-tray, tray-domain,
# tray-rack, domain-switch, switch-switch.
_PAIRS = np.array(
    [_GPU * 5 + _TRAY, _TRAY * 5 + _DOMAIN, _TRAY * 5 + _RACK, _DOMAIN * 5 + _SWITCH, _SWITCH * 6]
)
_NUMBER_TYPES = frozenset({float, int})
_ID_TYPES = frozenset({str, int})
_NONE = type(None)
_ABSENT = object()


class _Unproven(Exception):
    """The records may be invalid: the reference path decides (and names the problem)."""


def _need(ok: bool | np.bool_) -> None:
    if not ok:
        raise _Unproven


def _column(
    group: Sequence[dict[str, Any]],
    key: str,
    default: Any,
    everywhere: frozenset[str] = frozenset(),
) -> list[Any]:
    """``key``'s value in every record (``default`` where absent); ``everywhere``: keys
    every record has (read without a Python call per record)."""
    if key in everywhere:
        return list(map(itemgetter(key), group))
    return [n.get(key, default) for n in group]


def _floats(
    values: list[Any], lo: float, hi: float = np.inf, *, lo_open: bool = False, null: float | None
) -> np.ndarray:
    """``values`` as floats, proven finite and in range; ``None`` becomes ``null`` if allowed."""
    types = set(map(type, values))
    absent = None
    if _NONE in types:
        _need(null is not None)
        types.discard(_NONE)
        absent = np.array([v is None for v in values], dtype=bool)
        values = [null if v is None else v for v in values]
    _need(types <= _NUMBER_TYPES)
    arr = np.array(values, dtype=float)
    real = arr if absent is None else arr[~absent]
    _need(bool(np.isfinite(real).all()))
    _need(bool((real > lo).all() if lo_open else (real >= lo).all()))
    _need(bool((real <= hi).all()))
    return arr


def _strings(values: list[Any], max_len: int) -> None:
    """Proven ``None`` or strings of 1..``max_len`` characters."""
    strs = [v for v in values if v is not None]
    _need(set(map(type, strs)) <= {str})
    if strs:
        lengths = list(map(len, strs))
        _need(min(lengths) >= 1 and max(lengths) <= max_len)


def _ints(values: list[Any], lo: int, hi: int, *, null: bool) -> np.ndarray:
    """Proven integers (not bools) in ``[lo, hi]`` (or ``None`` if ``null``)."""
    types = set(map(type, values))
    if null:
        types.discard(_NONE)
        values = [v for v in values if v is not None]
    _need(types <= {int})
    if not values:
        return np.zeros(0, dtype=np.int64)
    _need(lo <= min(values) and max(values) <= hi)
    return np.array(values, dtype=np.int64)


def _pick(items: Sequence[Any], idx: np.ndarray) -> list[Any]:
    if idx.size < 2:
        return [items[i] for i in idx.tolist()]
    return list(itemgetter(*idx.tolist())(items))


def _group_keys(
    records: Sequence[dict[str, Any]],
    allowed: frozenset[str],
    required: frozenset[str],
    uniform: bool = True,
) -> tuple[frozenset[str], frozenset[str]]:
    """The keys some and every record has, proven allowed and including ``required``.

    When every record has as many keys as the first (and ``uniform``), the
    first's keys are returned as every record's: the caller reads each of them from every
    record with :func:`operator.itemgetter` (:func:`_column`), which raises
    ``KeyError`` for a record without one, so that equal counts then prove
    equal key sets (no per-record key tuple needed).
    """
    if uniform and records and len(set(map(len, records))) == 1:
        some = every = frozenset(records[0])
    else:
        distinct = set(map(tuple, records))
        some = frozenset(chain.from_iterable(distinct))
        every = frozenset.intersection(*map(frozenset, distinct)) if distinct else some
    _need(some <= allowed and required <= every)
    return some, every


@dataclass(frozen=True, eq=False)
class CompiledRecords:
    """What :func:`compile_records` proved and built: the arrays, and the edges in brief.

    The edges are kept as node positions (and bandwidths), so that the parsed
    edge records can be dropped: the graph needs only the node records.
    ``n_keys`` is the number of keys in all the records (nodes and edges).
    """

    arrays: ClusterArrays
    ids: list[Hashable]
    edge_source: np.ndarray
    edge_target: np.ndarray
    bandwidths: list[Any] | None
    n_keys: int = 0

    def graph(self, graph_attrs: dict[str, Any], nodes: Sequence[dict[str, Any]]) -> nx.Graph:
        """The cluster graph the reference path builds from the same records.

        Equal to it node by node and edge by edge, in the file's order, with
        the attributes in the file's order, integers of float fields as
        floats and a switch's default ``tier`` (so that saving it again writes
        the same file).

        Parameters
        ----------
        graph_attrs
            The validated ``cluster.graph`` attributes.
        nodes
            The node records that were compiled.

        Returns
        -------
        networkx.Graph
            A new (unfrozen) graph.
        """
        import networkx as nx  # on first use: loading and planning need no graph

        graph = nx.Graph()
        graph.graph.update(graph_attrs)
        rows: list[tuple[Hashable, dict[str, Any]]] = []
        for node in nodes:
            attrs = {k: _value(k, v) for k, v in node.items() if k != "id"}
            if attrs["kind"] == "switch":
                attrs.setdefault("tier", "leaf")
            rows.append((node["id"], attrs))
        graph.add_nodes_from(rows)
        ids = self.ids
        ends = zip(self.edge_source.tolist(), self.edge_target.tolist(), strict=True)
        if self.bandwidths is None:
            graph.add_edges_from((ids[u], ids[v]) for u, v in ends)
        else:
            graph.add_edges_from(
                (
                    ids[u],
                    ids[v],
                    {} if b is _ABSENT else {"bandwidth_gbps": _value("bandwidth_gbps", b)},
                )
                for (u, v), b in zip(ends, self.bandwidths, strict=True)
            )
        return graph


def compile_records(
    nodes: Any, edges: Any, site_budget: float | None, min_domain: int = 1
) -> CompiledRecords | None:
    """The compiled cluster of node-link records, or ``None`` if they may be invalid.

    Parameters
    ----------
    nodes
        ``cluster.nodes`` of an instance file (parsed JSON).
    edges
        ``cluster.edges``.
    site_budget
        The validated ``cluster.graph.power_budget_w`` (``None``: the sum of the
        GPUs' ``tdp_w``).
    min_domain
        Smallest domain size accepted (the job's ``tp``: smaller domains are an
        error of the instance).

    Returns
    -------
    CompiledRecords or None
        Its ``arrays`` are what :func:`ntp_opt.model.instance.compile_cluster`
        gives for the graph the reference path builds from the same records
        (:meth:`CompiledRecords.graph`), if every record
        and the topology are proven valid (the schema of ``InstanceFile``'s
        cluster and :func:`ntp_opt.model.topology.check_topology`); ``None``
        otherwise (duplicate edges, whose graph merges them, included).
    """
    for uniform in (True, False):
        try:
            return _compile(nodes, edges, site_budget, min_domain, uniform)
        except KeyError:
            continue  # maybe records of equal key counts but other keys: count them
        except (_Unproven, TypeError, ValueError, OverflowError, AttributeError):
            return None
    return None


@dataclass(frozen=True, eq=False)
class _Nodes:
    """The node records sorted by kind: what the column and edge checks share."""

    code: np.ndarray  # kind code per node
    ids: list[Hashable]
    id_types: set[type]
    index: dict[Hashable, int]  # node id -> position
    order: list[np.ndarray]  # positions of each kind's nodes
    groups: list[list[dict[str, Any]]]  # each kind's records
    keys: list[tuple[frozenset[str], frozenset[str]]]  # each kind's (some, every) keys
    local: np.ndarray  # position of each node among its kind's
    n_keys: int  # keys in the node records


def _sort_nodes(nodes: list[Any], uniform: bool) -> _Nodes:
    """Kind codes, ids and per-kind groups of the node records, proven distinct and allowed."""
    # Records that are not objects need no scan of their own: every node record is read
    # by ``itemgetter("kind")`` and every edge record by ``itemgetter("source")``, which
    # raise TypeError on a list, a string, a number or null.
    n_nodes = len(nodes)
    code = np.fromiter(
        map(_KIND_CODE.__getitem__, map(itemgetter("kind"), nodes)), dtype=np.int8, count=n_nodes
    )
    ids = list(map(itemgetter("id"), nodes))
    id_types = set(map(type, ids))
    _need(id_types <= _ID_TYPES)
    index = dict(zip(ids, range(n_nodes), strict=True))
    _need(len(index) == n_nodes)  # duplicate ids
    order = [np.flatnonzero(code == k) for k in range(5)]
    groups = [_pick(nodes, idx) for idx in order]
    keys = [
        _group_keys(g, _ALLOWED_KEYS[k], _REQUIRED_KEYS[k], uniform) for k, g in enumerate(groups)
    ]
    # keys in the records: every record of a group has its ``every`` keys when it has no others
    n_keys = sum(
        len(g) * len(every) if some == every else sum(map(len, g))
        for g, (some, every) in zip(groups, keys, strict=True)
    )
    local = np.empty(n_nodes, dtype=np.int64)
    for idx in order:
        local[idx] = np.arange(idx.size)
    return _Nodes(code, ids, id_types, index, order, groups, keys, local, n_keys)


def _gpu_columns(nodes: _Nodes) -> tuple[np.ndarray, ...]:
    """``healthy, speed, p_fail, tdp, max_power`` of the GPU records, proven valid."""
    gpus, (gk, gall) = nodes.groups[_GPU], nodes.keys[_GPU]
    n = len(gpus)
    if "state" in gk:
        states = _column(gpus, "state", "healthy", gall)
        failed = states.count("failed")
        _need(states.count("healthy") + failed == n)
        healthy = np.ones(n, dtype=bool)
        at = -1
        for _ in range(failed):  # list.index scans at C speed; failures are few
            at = states.index("failed", at + 1)
            healthy[at] = False
    else:
        healthy = np.ones(n, dtype=bool)
    speed = _number_column(gpus, nodes.keys[_GPU], "speed", 1.0, SPEED_MIN, SPEED_MAX)
    p_fail = _number_column(gpus, nodes.keys[_GPU], "p_fail", 0.0, 0.0, 1.0)
    tdp = _number_column(gpus, nodes.keys[_GPU], "tdp_w", 1000.0, 1.0, 1e6)
    if "max_power_w" in gk:
        max_power = _floats(_column(gpus, "max_power_w", None, gall), 1.0, 1e6, null=np.inf)
        _need(bool((max_power >= tdp).all()))
    else:
        max_power = np.full(n, np.inf)
    for key, cap in (("uuid", 200), ("host", 255)):
        if key in gk:
            _strings(_column(gpus, key, None, gall), cap)
    if "index" in gk:
        _ints(_column(gpus, "index", None, gall), 0, 1_000_000, null=True)
    return healthy, speed, p_fail, tdp, max_power


def _other_columns(nodes: _Nodes, min_domain: int) -> tuple[np.ndarray, ...]:
    """``tray_p_fail, domain sizes, rack budgets, leaf`` (per node) of the other records."""
    groups, keys = nodes.groups, nodes.keys
    trays = groups[_TRAY]
    tray_p = _number_column(trays, keys[_TRAY], "p_fail", 0.0, 0.0, 1.0)
    if "host" in keys[_TRAY][0]:
        _strings(_column(trays, "host", None, keys[_TRAY][1]), 255)
    sizes = _ints(_column(groups[_DOMAIN], "size", None, keys[_DOMAIN][1]), 1, 100_000, null=False)
    _need(bool((sizes >= min_domain).all()))
    racks, (rk, rall) = groups[_RACK], keys[_RACK]
    budgets = (
        _floats(_column(racks, "power_budget_w", None, rall), 0.0, 1e12, null=np.nan)
        if "power_budget_w" in rk
        else np.full(len(racks), np.nan)
    )
    if "budget_source" in rk:
        _strings(_column(racks, "budget_source", None, rall), 1000)
    leaf = np.zeros(len(nodes.ids), dtype=bool)
    tiers = _column(groups[_SWITCH], "tier", "leaf", keys[_SWITCH][1])
    _need(set(tiers) <= {"leaf", "spine"})
    leaf[nodes.order[_SWITCH]] = [t == "leaf" for t in tiers]
    return tray_p, sizes, budgets, leaf


def _edge_ends(
    edges: list[Any], nodes: _Nodes
) -> tuple[np.ndarray, np.ndarray, list[Any] | None, int]:
    """``source, target`` (node positions), the bandwidths and the keys of the edge records."""
    m = len(edges)
    # Every edge has its two ends (read below); an edge with a third key must have
    # the bandwidth as that key: as many bandwidths as 3-key edges and none larger.
    lengths = np.fromiter(map(len, edges), dtype=np.int64, count=m)
    _need(bool((lengths <= 3).all()))
    with_bw = np.flatnonzero(lengths == 3)  # KeyError below unless the third key is the bandwidth
    n_bw = int(with_bw.size)
    present = list(map(itemgetter("bandwidth_gbps"), _pick(edges, with_bw)))
    plain_ids = nodes.id_types == {str}
    ends = []
    for end in ("source", "target"):
        col = list(map(itemgetter(end), edges))
        # a value found in ``index`` equals a node id: of the same type if every id
        # is a string (a string equals strings only), else the types are checked
        _need(plain_ids or set(map(type, col)) <= _ID_TYPES)
        ends.append(np.fromiter(map(nodes.index.__getitem__, col), dtype=np.int64, count=m))
    src, tgt = ends
    bandwidths: list[Any] | None = None
    if n_bw:
        _floats(present, 0.0, lo_open=True, null=np.nan)
        bandwidths = [_ABSENT] * m if n_bw < m else present
        if n_bw < m:
            for at, b in zip(with_bw.tolist(), present, strict=True):
                bandwidths[at] = b
    return src, tgt, bandwidths, int(lengths.sum())


def _containment(
    nodes: _Nodes, src: np.ndarray, tgt: np.ndarray, leaf: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``gpu_tray, tray_domain, tray_rack`` from the edges, proven a valid containment."""
    n_nodes, code, local = len(nodes.ids), nodes.code, nodes.local
    _need(bool((src != tgt).all()))
    lo, hi = np.minimum(src, tgt), np.maximum(src, tgt)
    pairs = np.sort(lo * n_nodes + hi)
    _need(bool((pairs[1:] != pairs[:-1]).all()))  # a repeated edge merges in a graph
    ks, kt = code[src].astype(np.int64), code[tgt].astype(np.int64)
    kmin, kmax = np.minimum(ks, kt), np.maximum(ks, kt)
    pair = kmin * 5 + kmax
    _need(bool(np.isin(pair, _PAIRS).all()))
    lower = np.where(ks <= kt, src, tgt)  # the end of the smaller kind
    upper = np.where(ks <= kt, tgt, src)
    uplink = pair == _DOMAIN * 5 + _SWITCH
    _need(bool(leaf[upper[uplink]].all()))  # domains attach to leaf switches

    n = len(nodes.groups[_GPU])
    n_trays = len(nodes.groups[_TRAY])
    gt = pair == _GPU * 5 + _TRAY
    gpu_end, tray_of_gpu = local[lower[gt]], local[upper[gt]]
    _need(bool((np.bincount(gpu_end, minlength=n) == 1).all()))
    gpu_tray = np.empty(n, dtype=np.int64)
    gpu_tray[gpu_end] = tray_of_gpu
    tray_gpus = np.bincount(tray_of_gpu, minlength=n_trays)
    _need(bool((tray_gpus >= 1).all()))
    tray_domain = np.empty(n_trays, dtype=np.int64)
    tray_rack = np.empty(n_trays, dtype=np.int64)
    for kind, target in ((_DOMAIN, tray_domain), (_RACK, tray_rack)):
        sel = pair == _TRAY * 5 + kind
        t = local[lower[sel]]
        _need(bool((np.bincount(t, minlength=n_trays) == 1).all()))
        target[t] = local[upper[sel]]
    n_domains = len(nodes.groups[_DOMAIN])
    domain_count = np.bincount(tray_domain, weights=tray_gpus, minlength=n_domains)
    _need(bool((domain_count == sizes).all()))  # also: every domain has a tray
    return gpu_tray, tray_domain, tray_rack


def _compile(
    nodes: Any, edges: Any, site_budget: float | None, min_domain: int, uniform: bool
) -> CompiledRecords:
    _need(type(nodes) is list and type(edges) is list)
    sorted_nodes = _sort_nodes(nodes, uniform)
    healthy, speed, p_fail, tdp, max_power = _gpu_columns(sorted_nodes)
    tray_p, sizes, budgets, leaf = _other_columns(sorted_nodes, min_domain)
    src, tgt, bandwidths, edge_keys = _edge_ends(edges, sorted_nodes)
    gpu_tray, tray_domain, tray_rack = _containment(sorted_nodes, src, tgt, leaf, sizes)
    n = len(healthy)
    n_domains = len(sizes)
    gpu_domain = tray_domain[gpu_tray] if n else np.empty(0, dtype=np.int64)
    gpu_rack = tray_rack[gpu_tray] if n else np.empty(0, dtype=np.int64)
    by_domain = np.argsort(gpu_domain, kind="stable")
    bounds = np.searchsorted(gpu_domain[by_domain], np.arange(n_domains + 1))
    domain_gpus = tuple(by_domain[bounds[i] : bounds[i + 1]] for i in range(n_domains))
    rack_tdp = np.bincount(gpu_rack, weights=tdp, minlength=len(budgets))
    rack_budget = np.where(np.isnan(budgets), rack_tdp, budgets).astype(float)
    site = float(tdp.sum()) if site_budget is None else float(site_budget)
    ids, order = sorted_nodes.ids, sorted_nodes.order
    gpu_ids = tuple(_pick(ids, order[_GPU]))
    domain_ids = tuple(_pick(ids, order[_DOMAIN]))
    rack_ids = tuple(_pick(ids, order[_RACK]))
    arrays = ClusterArrays(
        gpu_ids=gpu_ids,
        gpu_index=dict(zip(gpu_ids, range(n), strict=True)),
        gpu_tray=gpu_tray,
        gpu_domain=gpu_domain,
        gpu_rack=gpu_rack,
        healthy=healthy,
        speed=speed,
        p_fail=p_fail,
        tdp=tdp,
        max_power=max_power,
        tray_ids=tuple(_pick(ids, order[_TRAY])),
        tray_p_fail=tray_p,
        domain_ids=domain_ids,
        domain_index={d: i for i, d in enumerate(domain_ids)},
        domain_gpus=domain_gpus,
        rack_ids=rack_ids,
        rack_index={r: i for i, r in enumerate(rack_ids)},
        rack_budget=rack_budget,
        site_budget=site,
    )
    small = np.int32 if len(ids) < 2**31 else np.int64
    n_keys = sorted_nodes.n_keys + edge_keys
    return CompiledRecords(arrays, ids, src.astype(small), tgt.astype(small), bandwidths, n_keys)


def _number_column(
    group: Sequence[dict[str, Any]],
    keys: tuple[frozenset[str], frozenset[str]],
    key: str,
    default: float,
    lo: float,
    hi: float,
) -> np.ndarray:
    """A required-number column (``default`` where absent), proven finite and in range."""
    if key not in keys[0]:
        return np.full(len(group), default)
    return _floats(_column(group, key, default, keys[1]), lo, hi, null=None)


def _value(key: str, value: Any) -> Any:
    return float(value) if type(value) is int and key in FLOAT_FIELDS else value
