"""Cluster topology model: builders, failure/straggler/risk helpers and consistency checks.

A cluster is an undirected :class:`networkx.Graph` whose nodes all carry a ``kind`` attribute:

==========  ===================================================================================
kind        attributes (defaults)
==========  ===================================================================================
``gpu``     ``state`` ("healthy" / "failed", default "healthy"), ``speed`` (relative
            throughput, 1.0; < 1 is a straggler), ``p_fail`` (probability of failing within the
            planning horizon, 0.0), ``tdp_w`` (``DEFAULT_TDP_W``), ``max_power_w`` (largest
            power limit the board accepts, >= ``tdp_w``; absent: ``tdp_w * (1 + max_boost)``
            of the job), optional ``uuid``, ``host`` (strings) and ``index`` (int >= 0)
``tray``    compute tray / host, the usual failure unit: ``p_fail`` (0.0), optional ``host``
``domain``  NVLink scale-up domain: ``size`` (number of GPUs in it, required)
``rack``    power unit: ``power_budget_w`` (default: sum of its GPUs' ``tdp_w``)
``switch``  scale-out fabric: ``tier`` ("leaf" or "spine")
==========  ===================================================================================

``G.graph["power_budget_w"]`` is the site power budget (default: sum of all GPUs' ``tdp_w``) and
``G.graph["name"]`` a human-readable name.

The only edges are containment edges: gpu-tray, tray-domain, tray-rack, domain-leaf switch and
switch-switch (leaf-spine). A domain may span several racks (NVL36x2) and a rack may hold several
domains (DGX / NVL8).

Node ids built by this module are strings: domains ``d{i}``, trays ``d{i}.t{j}``, GPUs
``d{i}.t{j}.g{k}``, racks ``r{i}``, leaf switches ``leaf{i}``, spine switches ``spine{i}``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Literal

import networkx as nx
import numpy as np

__all__ = [
    "BUILDERS",
    "DEFAULT_TDP_W",
    "NIC_GBPS_PER_GPU",
    "TopologyError",
    "add_stragglers",
    "build",
    "build_cluster",
    "check_topology",
    "dgx_h100",
    "domains",
    "fail_gpus",
    "fail_random",
    "fail_trays",
    "gb200_nvl72",
    "gpus",
    "nvl32",
    "nvl36x2",
    "racks",
    "repair_gpus",
    "set_p_fail",
    "set_speed",
    "trays",
]

DEFAULT_TDP_W: float = 1000.0
"""Default GPU thermal design power in watts."""

NIC_GBPS_PER_GPU: float = 400.0
"""Scale-out bandwidth per GPU (one 400 Gb/s NIC per GPU) used for domain-leaf edges."""

HEALTHY = "healthy"
FAILED = "failed"

_KINDS = ("gpu", "tray", "domain", "rack", "switch")
_KIND_ORDER = {k: i for i, k in enumerate(_KINDS)}
_MAX_PROBLEMS_SHOWN = 20
_MAX_DEFAULT_SPINES = 32


class TopologyError(ValueError):
    """A cluster graph violates the topology contract.

    Parameters
    ----------
    problems : list of str
        One human-readable message per problem found.

    Attributes
    ----------
    problems : list of str
        Every problem found, in a deterministic order.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems: list[str] = list(problems)
        super().__init__(self._format())

    def _format(self) -> str:
        n = len(self.problems)
        lines = [f"invalid cluster topology ({n} problem{'s' if n != 1 else ''}):"]
        lines += [f"  - {p}" for p in self.problems[:_MAX_PROBLEMS_SHOWN]]
        if n > _MAX_PROBLEMS_SHOWN:
            lines.append(f"  ... and {n - _MAX_PROBLEMS_SHOWN} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._format()

    def __reduce__(self) -> tuple[type[TopologyError], tuple[list[str]]]:
        return (type(self), (self.problems,))


# --------------------------------------------------------------------------------------------
# small validation helpers
# --------------------------------------------------------------------------------------------


def _is_real(x: object) -> bool:
    t = type(x)
    if t is float or t is int:
        return True
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _require_pos_int(name: str, value: object) -> int:
    if not _is_int(value) or int(value) <= 0:  # type: ignore[call-overload]
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def _require_pos_finite(name: str, value: object) -> float:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type,operator]
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------------


def build_cluster(
    num_domains: int,
    domain_size: int,
    gpus_per_tray: int,
    trays_per_rack: int,
    *,
    domains_per_leaf: int = 8,
    num_spines: int | None = None,
    tdp_w: float = DEFAULT_TDP_W,
    rack_power_factor: float = 1.0,
    name: str | None = None,
) -> nx.Graph:
    """Build a homogeneous cluster of identical NVLink domains.

    Parameters
    ----------
    num_domains : int
        Number of NVLink domains.
    domain_size : int
        GPUs per domain; must be a multiple of `gpus_per_tray`.
    gpus_per_tray : int
        GPUs per tray (host).
    trays_per_rack : int
        Trays per rack. Must either divide the number of trays per domain (a domain spans
        several racks) or be a multiple of it (a rack holds several whole domains). Racks are
        filled in global tray order (rack of tray = global tray index // `trays_per_rack`), so
        the last rack may be partially filled.
    domains_per_leaf : int, default 8
        Domains attached to each leaf switch (domain ``i`` goes to leaf ``i // domains_per_leaf``).
    num_spines : int, optional
        Number of spine switches; every leaf connects to every spine. Default
        ``min(32, max(1, ceil(num_leaves / 8)))`` (capped so that the leaf-spine mesh stays
        small: 2,048 DGX leaves would otherwise need 256 spines and 524,288 edges).
    tdp_w : float, default DEFAULT_TDP_W
        Thermal design power of every GPU in watts.
    rack_power_factor : float, default 1.0
        Rack budget = `rack_power_factor` * sum of the rack's GPU TDPs. The site budget is always
        the plain sum of all GPU TDPs.
    name : str, optional
        ``G.graph["name"]``; default ``"cluster-{num_domains}x{domain_size}"``.

    Returns
    -------
    networkx.Graph
        The cluster, all GPUs healthy with speed 1.0 and ``p_fail`` 0.0. Domain-leaf edges carry
        ``bandwidth_gbps = NIC_GBPS_PER_GPU * domain_size`` (one 400 Gb/s NIC per GPU); each
        leaf-spine edge carries the leaf's total downlink bandwidth divided by the number of
        spines (a non-blocking fabric).

    Raises
    ------
    ValueError
        If an argument is not a positive integer / positive finite number, or the tray, domain
        and rack sizes are incompatible.
    """
    num_domains = _require_pos_int("num_domains", num_domains)
    domain_size = _require_pos_int("domain_size", domain_size)
    gpus_per_tray = _require_pos_int("gpus_per_tray", gpus_per_tray)
    trays_per_rack = _require_pos_int("trays_per_rack", trays_per_rack)
    domains_per_leaf = _require_pos_int("domains_per_leaf", domains_per_leaf)
    if num_spines is not None:
        num_spines = _require_pos_int("num_spines", num_spines)
    tdp = _require_pos_finite("tdp_w", tdp_w)
    factor = _require_pos_finite("rack_power_factor", rack_power_factor)
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name must be a string or None, got {name!r}")
    if domain_size % gpus_per_tray:
        raise ValueError(
            f"domain_size ({domain_size}) must be a multiple of gpus_per_tray ({gpus_per_tray})"
        )
    trays_per_domain = domain_size // gpus_per_tray
    if trays_per_domain % trays_per_rack and trays_per_rack % trays_per_domain:
        raise ValueError(
            f"trays_per_rack ({trays_per_rack}) must divide or be a multiple of the number of "
            f"trays per domain ({trays_per_domain} = domain_size {domain_size} / gpus_per_tray "
            f"{gpus_per_tray})"
        )

    num_trays = num_domains * trays_per_domain
    num_racks = -(-num_trays // trays_per_rack)
    num_leaves = -(-num_domains // domains_per_leaf)
    if num_spines is None:
        num_spines = min(_MAX_DEFAULT_SPINES, max(1, -(-num_leaves // 8)))

    domain_bw = NIC_GBPS_PER_GPU * domain_size
    nodes: list[tuple[str, dict[str, Any]]] = []
    edges: list[tuple[str, str] | tuple[str, str, dict[str, Any]]] = []
    rack_ids = [f"r{r}" for r in range(num_racks)]
    leaf_ids = [f"leaf{s}" for s in range(num_leaves)]
    spine_ids = [f"spine{s}" for s in range(num_spines)]
    gpu_proto = {"kind": "gpu", "state": HEALTHY, "speed": 1.0, "p_fail": 0.0, "tdp_w": tdp}

    global_tray = 0
    for i in range(num_domains):
        d = f"d{i}"
        nodes.append((d, {"kind": "domain", "size": domain_size}))
        for j in range(trays_per_domain):
            t = f"{d}.t{j}"
            nodes.append((t, {"kind": "tray", "p_fail": 0.0}))
            edges.append((t, d))
            edges.append((t, rack_ids[global_tray // trays_per_rack]))
            global_tray += 1
            for k in range(gpus_per_tray):
                g = f"{t}.g{k}"
                nodes.append((g, dict(gpu_proto)))
                edges.append((g, t))
        edges.append((d, leaf_ids[i // domains_per_leaf], {"bandwidth_gbps": domain_bw}))

    for r, rid in enumerate(rack_ids):
        trays_in_rack = min(trays_per_rack, num_trays - r * trays_per_rack)
        budget = factor * trays_in_rack * gpus_per_tray * tdp
        nodes.append((rid, {"kind": "rack", "power_budget_w": budget}))
    for s, lid in enumerate(leaf_ids):
        nodes.append((lid, {"kind": "switch", "tier": "leaf"}))
        domains_on_leaf = min(domains_per_leaf, num_domains - s * domains_per_leaf)
        uplink_bw = domains_on_leaf * domain_bw / num_spines
        edges.extend((lid, sp, {"bandwidth_gbps": uplink_bw}) for sp in spine_ids)
    nodes.extend((sp, {"kind": "switch", "tier": "spine"}) for sp in spine_ids)

    G = nx.Graph()
    G.graph["name"] = name if name is not None else f"cluster-{num_domains}x{domain_size}"
    G.graph["power_budget_w"] = num_trays * gpus_per_tray * tdp
    G.add_nodes_from(nodes)
    G.add_edges_from(edges)
    return G


def _default_name(kw: dict[str, Any], prefix: str, num_gpus: int) -> None:
    if kw.get("name") is None:
        kw["name"] = f"{prefix}-{num_gpus}"


def dgx_h100(num_nodes: int, *, nodes_per_rack: int = 4, **kw: Any) -> nx.Graph:
    """Build a DGX H100 (NVL8) cluster.

    Each DGX node is one tray of 8 GPUs forming one NVLink domain of 8; ``nodes_per_rack`` DGX
    nodes share a rack. GPU TDP defaults to 700 W.

    Parameters
    ----------
    num_nodes : int
        Number of DGX nodes (= domains).
    nodes_per_rack : int, default 4
        DGX nodes per rack.
    **kw
        Passed to :func:`build_cluster` (``tdp_w``, ``rack_power_factor``, ``domains_per_leaf``,
        ``num_spines``, ``name``). Default name ``"dgx-h100-{num_gpus}"``.

    Returns
    -------
    networkx.Graph
        The cluster.
    """
    num_nodes = _require_pos_int("num_nodes", num_nodes)
    kw.setdefault("tdp_w", 700.0)
    _default_name(kw, "dgx-h100", 8 * num_nodes)
    return build_cluster(num_nodes, 8, 8, nodes_per_rack, **kw)


def nvl32(num_domains: int, *, gpus_per_tray: int = 4, **kw: Any) -> nx.Graph:
    """Build the paper's simulated B200 cluster: NVLink domains of 32 GPUs, one per rack.

    A domain is ``32 / gpus_per_tray`` trays (8 trays of 4 by default). GPU TDP defaults to
    1000 W.

    Parameters
    ----------
    num_domains : int
        Number of 32-GPU domains (= racks).
    gpus_per_tray : int, default 4
        GPUs per tray; must divide 32.
    **kw
        Passed to :func:`build_cluster`. Default name ``"nvl32-{num_gpus}"``.

    Returns
    -------
    networkx.Graph
        The cluster.
    """
    num_domains = _require_pos_int("num_domains", num_domains)
    gpus_per_tray = _require_pos_int("gpus_per_tray", gpus_per_tray)
    if 32 % gpus_per_tray:
        raise ValueError(f"gpus_per_tray must divide 32 for nvl32, got {gpus_per_tray}")
    kw.setdefault("tdp_w", 1000.0)
    _default_name(kw, "nvl32", 32 * num_domains)
    return build_cluster(num_domains, 32, gpus_per_tray, 32 // gpus_per_tray, **kw)


def gb200_nvl72(num_racks: int, **kw: Any) -> nx.Graph:
    """Build a GB200 NVL72 cluster: each rack is one 72-GPU domain of 18 trays x 4 GPUs.

    GPU TDP defaults to 1200 W.

    Parameters
    ----------
    num_racks : int
        Number of racks (= domains).
    **kw
        Passed to :func:`build_cluster`. Default name ``"nvl72-{num_gpus}"``.

    Returns
    -------
    networkx.Graph
        The cluster.
    """
    num_racks = _require_pos_int("num_racks", num_racks)
    kw.setdefault("tdp_w", 1200.0)
    _default_name(kw, "nvl72", 72 * num_racks)
    return build_cluster(num_racks, 72, 4, 18, **kw)


def nvl36x2(num_domains: int, **kw: Any) -> nx.Graph:
    """Build a GB200 NVL36x2 cluster: 72-GPU domains (18 trays x 4) spanning 2 racks of 9 trays.

    GPU TDP defaults to 1200 W.

    Parameters
    ----------
    num_domains : int
        Number of 72-GPU domains (the cluster has ``2 * num_domains`` racks).
    **kw
        Passed to :func:`build_cluster`. Default name ``"nvl36x2-{num_gpus}"``.

    Returns
    -------
    networkx.Graph
        The cluster.
    """
    num_domains = _require_pos_int("num_domains", num_domains)
    kw.setdefault("tdp_w", 1200.0)
    _default_name(kw, "nvl36x2", 72 * num_domains)
    return build_cluster(num_domains, 72, 4, 9, **kw)


BUILDERS: dict[str, Callable[..., nx.Graph]] = {
    "dgx-h100": dgx_h100,
    "nvl32": nvl32,
    "nvl72": gb200_nvl72,
    "nvl36x2": nvl36x2,
}
"""Preset builders by name; each takes the number of domains (DGX nodes / racks for NVL72)."""

_DOMAIN_SIZE = {"dgx-h100": 8, "nvl32": 32, "nvl72": 72, "nvl36x2": 72}


def build(kind: str, num_gpus: int, **kw: Any) -> nx.Graph:
    """Build a preset cluster by name and total GPU count.

    Parameters
    ----------
    kind : str
        One of ``BUILDERS``: "dgx-h100", "nvl32", "nvl72", "nvl36x2".
    num_gpus : int
        Total number of GPUs; must be a positive multiple of the preset's domain size
        (8, 32, 72, 72).
    **kw
        Passed to the preset builder (e.g. ``tdp_w``, ``rack_power_factor``,
        ``domains_per_leaf``, ``num_spines``, ``name``).

    Returns
    -------
    networkx.Graph
        The cluster.

    Raises
    ------
    ValueError
        On an unknown `kind` or a `num_gpus` that is not a positive multiple of the domain size.
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown cluster kind {kind!r}; known kinds: {', '.join(BUILDERS)}")
    num_gpus = _require_pos_int("num_gpus", num_gpus)
    size = _DOMAIN_SIZE[kind]
    if num_gpus % size:
        raise ValueError(
            f"num_gpus ({num_gpus}) must be a multiple of the {kind} domain size ({size})"
        )
    return BUILDERS[kind](num_gpus // size, **kw)


# --------------------------------------------------------------------------------------------
# queries
# --------------------------------------------------------------------------------------------


def _of_kind(G: nx.Graph, kind: str) -> list[Hashable]:
    return [n for n, k in G.nodes(data="kind") if k == kind]


def gpus(G: nx.Graph) -> list[Hashable]:
    """Return the GPU node ids in graph order.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.

    Returns
    -------
    list of Hashable
        Ids of all nodes with ``kind == "gpu"`` (healthy and failed).
    """
    return _of_kind(G, "gpu")


def trays(G: nx.Graph) -> list[Hashable]:
    """Return the tray node ids in graph order.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.

    Returns
    -------
    list of Hashable
        Ids of all nodes with ``kind == "tray"``.
    """
    return _of_kind(G, "tray")


def domains(G: nx.Graph) -> list[Hashable]:
    """Return the NVLink domain node ids in graph order.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.

    Returns
    -------
    list of Hashable
        Ids of all nodes with ``kind == "domain"``.
    """
    return _of_kind(G, "domain")


def racks(G: nx.Graph) -> list[Hashable]:
    """Return the rack node ids in graph order.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.

    Returns
    -------
    list of Hashable
        Ids of all nodes with ``kind == "rack"``.
    """
    return _of_kind(G, "rack")


# --------------------------------------------------------------------------------------------
# in-place mutation helpers
# --------------------------------------------------------------------------------------------


def _resolve(G: nx.Graph, ids: Iterable[Hashable], kinds: tuple[str, ...]) -> list[Hashable]:
    """Validate ids (unknown -> KeyError, wrong kind -> ValueError); return them deduplicated."""
    if isinstance(ids, str):
        ids = [ids]
    seen: dict[Hashable, None] = {}
    nodes = G.nodes
    for n in ids:
        if n not in nodes:
            raise KeyError(f"unknown node id {n!r}")
        kind = nodes[n].get("kind")
        if kind not in kinds:
            raise ValueError(f"node {n!r} has kind {kind!r}, expected {' or '.join(kinds)}")
        seen[n] = None
    return list(seen)


def _in_graph_order(G: nx.Graph, changed: Iterable[Hashable]) -> list[Hashable]:
    s = set(changed)
    if not s:
        return []
    return [n for n in G if n in s]


def _tray_gpus(G: nx.Graph, tray: Hashable) -> list[Hashable]:
    nodes = G.nodes
    return [g for g in G.adj[tray] if nodes[g].get("kind") == "gpu"]


def _set_state(G: nx.Graph, gpu_ids: Iterable[Hashable], state: str) -> list[Hashable]:
    nodes = G.nodes
    changed = []
    for g in gpu_ids:
        data = nodes[g]
        if data.get("state", HEALTHY) != state:
            data["state"] = state
            changed.append(g)
    return _in_graph_order(G, changed)


def fail_gpus(G: nx.Graph, ids: Iterable[Hashable]) -> list[Hashable]:
    """Mark GPUs failed, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    ids : iterable of Hashable
        GPU ids (a single string is treated as one id).

    Returns
    -------
    list of Hashable
        The GPUs that were healthy and are now failed, in graph order.

    Raises
    ------
    KeyError
        If an id is not in the graph.
    ValueError
        If an id is not a GPU.
    """
    return _set_state(G, _resolve(G, ids, ("gpu",)), FAILED)


def repair_gpus(G: nx.Graph, ids: Iterable[Hashable]) -> list[Hashable]:
    """Mark GPUs healthy again, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    ids : iterable of Hashable
        GPU ids (a single string is treated as one id).

    Returns
    -------
    list of Hashable
        The GPUs that were failed and are now healthy, in graph order.

    Raises
    ------
    KeyError
        If an id is not in the graph.
    ValueError
        If an id is not a GPU.
    """
    return _set_state(G, _resolve(G, ids, ("gpu",)), HEALTHY)


def fail_trays(G: nx.Graph, tray_ids: Iterable[Hashable]) -> list[Hashable]:
    """Fail every GPU of each given tray, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    tray_ids : iterable of Hashable
        Tray ids (a single string is treated as one id).

    Returns
    -------
    list of Hashable
        The GPU ids that were healthy and are now failed, in graph order.

    Raises
    ------
    KeyError
        If an id is not in the graph.
    ValueError
        If an id is not a tray.
    """
    targets = [g for t in _resolve(G, tray_ids, ("tray",)) for g in _tray_gpus(G, t)]
    return _set_state(G, targets, FAILED)


def _resolve_count(fraction: float | None, count: int | None, total: int) -> int:
    if (fraction is None) == (count is None):
        raise ValueError("give exactly one of fraction and count")
    if count is not None:
        if not _is_int(count) or count < 0:
            raise ValueError(f"count must be a non-negative integer, got {count!r}")
        return int(count)
    if not _is_real(fraction) or not 0.0 <= fraction <= 1.0:  # type: ignore[operator]
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    return round(fraction * total)  # type: ignore[operator]


def _choose(
    rng: np.random.Generator, candidates: list[Hashable], count: int, what: str
) -> list[Hashable]:
    if count > len(candidates):
        raise ValueError(f"cannot pick {count} {what}: only {len(candidates)} candidates")
    if count == 0:
        return []
    idx = np.sort(rng.choice(len(candidates), size=count, replace=False))
    return [candidates[i] for i in idx.tolist()]


def fail_random(
    G: nx.Graph,
    *,
    fraction: float | None = None,
    count: int | None = None,
    unit: Literal["gpu", "tray"] = "gpu",
    seed: int = 0,
) -> list[Hashable]:
    """Fail randomly chosen healthy GPUs or trays, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    fraction : float, optional
        Fraction of *all* GPUs (``unit="gpu"``) or *all* trays (``unit="tray"``) to fail;
        the number picked is ``round(fraction * total)``. Exactly one of `fraction` and
        `count` must be given.
    count : int, optional
        Number of GPUs or trays to pick.
    unit : {"gpu", "tray"}, default "gpu"
        Pick individual GPUs, or whole trays (every GPU of a picked tray fails).
    seed : int, default 0
        Seed for ``numpy.random.default_rng``; the result is deterministic given the graph.

    Returns
    -------
    list of Hashable
        The GPU ids newly failed, in graph order.

    Raises
    ------
    ValueError
        If both or neither of `fraction`/`count` are given, they are out of range, `unit` is
        unknown, or more units are requested than there are candidates (healthy GPUs, or trays
        with at least one healthy GPU).
    """
    nodes = G.nodes
    if unit == "gpu":
        all_gpus = gpus(G)
        n = _resolve_count(fraction, count, len(all_gpus))
        cand = [g for g in all_gpus if nodes[g].get("state", HEALTHY) == HEALTHY]
        picked = _choose(np.random.default_rng(seed), cand, n, "healthy GPUs")
        return _set_state(G, picked, FAILED)
    if unit == "tray":
        all_trays = trays(G)
        n = _resolve_count(fraction, count, len(all_trays))
        tray_gpus = {t: _tray_gpus(G, t) for t in all_trays}
        cand = [
            t
            for t in all_trays
            if any(nodes[g].get("state", HEALTHY) == HEALTHY for g in tray_gpus[t])
        ]
        picked = _choose(np.random.default_rng(seed), cand, n, "trays with a healthy GPU")
        return _set_state(G, [g for t in picked for g in tray_gpus[t]], FAILED)
    raise ValueError(f"unit must be 'gpu' or 'tray', got {unit!r}")


def set_speed(G: nx.Graph, ids: Iterable[Hashable], speed: float) -> list[Hashable]:
    """Set the relative speed of GPUs, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    ids : iterable of Hashable
        GPU ids (a single string is treated as one id).
    speed : float
        Relative throughput, finite and > 0 (1.0 = nominal, < 1 = straggler).

    Returns
    -------
    list of Hashable
        The GPU ids whose speed was assigned (deduplicated), in graph order.

    Raises
    ------
    KeyError
        If an id is not in the graph.
    ValueError
        If an id is not a GPU or `speed` is invalid.
    """
    value = _require_pos_finite("speed", speed)
    targets = _resolve(G, ids, ("gpu",))
    nodes = G.nodes
    for g in targets:
        nodes[g]["speed"] = value
    return _in_graph_order(G, targets)


def add_stragglers(
    G: nx.Graph,
    *,
    fraction: float | None = None,
    count: int | None = None,
    speed: float | tuple[float, float] = 0.9,
    seed: int = 0,
) -> list[Hashable]:
    """Slow down randomly chosen healthy GPUs, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    fraction : float, optional
        Fraction of *all* GPUs to slow down (``round(fraction * num_gpus)`` are picked among
        the healthy ones). Exactly one of `fraction` and `count` must be given.
    count : int, optional
        Number of GPUs to slow down.
    speed : float or tuple of (float, float), default 0.9
        The new speed, or ``(lo, hi)`` to draw each speed uniformly from ``[lo, hi]``
        (``0 < lo <= hi``, finite).
    seed : int, default 0
        Seed for ``numpy.random.default_rng``.

    Returns
    -------
    list of Hashable
        The GPUs picked, in graph order (speeds are drawn in that order).

    Raises
    ------
    ValueError
        On invalid `fraction`/`count`/`speed`, or if more GPUs are requested than are healthy.
    """
    if isinstance(speed, tuple):
        if len(speed) != 2:
            raise ValueError(f"speed range must be (lo, hi), got {speed!r}")
        lo = _require_pos_finite("speed lo", speed[0])
        hi = _require_pos_finite("speed hi", speed[1])
        if lo > hi:
            raise ValueError(f"speed range must have lo <= hi, got {speed!r}")
    else:
        lo = hi = _require_pos_finite("speed", speed)
    all_gpus = gpus(G)
    n = _resolve_count(fraction, count, len(all_gpus))
    nodes = G.nodes
    cand = [g for g in all_gpus if nodes[g].get("state", HEALTHY) == HEALTHY]
    rng = np.random.default_rng(seed)
    picked = _choose(rng, cand, n, "healthy GPUs")
    speeds = rng.uniform(lo, hi, size=len(picked)).tolist() if lo < hi else [lo] * len(picked)
    for g, s in zip(picked, speeds, strict=True):
        nodes[g]["speed"] = float(s)
    return picked


def set_p_fail(G: nx.Graph, p: float, ids: Iterable[Hashable] | None = None) -> list[Hashable]:
    """Set failure probabilities over the planning horizon, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    p : float
        Probability in [0, 1].
    ids : iterable of Hashable, optional
        GPU and/or tray ids (a single string is treated as one id). A GPU id sets that GPU's
        ``p_fail``; a tray id sets the tray's own ``p_fail`` (whole-tray failure), not its GPUs'.
        Default: every GPU.

    Returns
    -------
    list of Hashable
        The node ids whose ``p_fail`` was assigned (deduplicated), in graph order.

    Raises
    ------
    KeyError
        If an id is not in the graph.
    ValueError
        If an id is neither a GPU nor a tray, or `p` is not in [0, 1].
    """
    if not _is_real(p) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
    targets = gpus(G) if ids is None else _resolve(G, ids, ("gpu", "tray"))
    nodes = G.nodes
    value = float(p)
    for n in targets:
        nodes[n]["p_fail"] = value
    return targets if ids is None else _in_graph_order(G, targets)


# --------------------------------------------------------------------------------------------
# consistency check
# --------------------------------------------------------------------------------------------


_INF = math.inf

_ALLOWED_NEIGHBOURS: dict[str, frozenset[str]] = {
    "gpu": frozenset({"tray"}),
    "tray": frozenset({"gpu", "domain", "rack"}),
    "domain": frozenset({"tray", "switch"}),
    "rack": frozenset({"tray"}),
    "switch": frozenset({"domain", "switch"}),
}


def _bad_number(x: object, *, lo: float, hi: float = _INF, lo_open: bool = False) -> bool:
    """True unless x is a finite real in [lo, hi] (or (lo, hi] if lo_open)."""
    if type(x) is float and x == x:  # fast path; NaN != NaN
        return (x <= lo if lo_open else x < lo) or x > hi or x == _INF
    if not _is_real(x) or not math.isfinite(x):  # type: ignore[arg-type]
        return True
    return bool(x <= lo if lo_open else x < lo) or bool(x > hi)  # type: ignore[operator]


def _names(ns: Iterable[Hashable]) -> str:
    return ", ".join(repr(n) for n in ns)


def _check_gpu_attrs(n: Hashable, data: dict[str, Any], problems: list[str]) -> None:
    # Each test starts with a fast path for plain floats (NaN fails every comparison).
    state = data.get("state", HEALTHY)
    if state != HEALTHY and state != FAILED:
        problems.append(f"GPU {n!r} has state {state!r} (expected 'healthy' or 'failed')")
    speed = data.get("speed", 1.0)
    if not (type(speed) is float and 0.0 < speed < _INF) and _bad_number(
        speed, lo=0.0, lo_open=True
    ):
        problems.append(f"GPU {n!r} has speed {speed!r} (must be finite and > 0)")
    p = data.get("p_fail", 0.0)
    if not (type(p) is float and 0.0 <= p <= 1.0) and _bad_number(p, lo=0.0, hi=1.0):
        problems.append(f"GPU {n!r} has p_fail {p!r} (must be in [0, 1])")
    tdp = data.get("tdp_w", DEFAULT_TDP_W)
    if not (type(tdp) is float and 0.0 < tdp < _INF) and _bad_number(tdp, lo=0.0, lo_open=True):
        problems.append(f"GPU {n!r} has tdp_w {tdp!r} (must be finite and > 0)")
        tdp = 0.0
    if (
        len(data) > 5
        or "max_power_w" in data
        or "host" in data
        or "uuid" in data
        or "index" in data
    ):
        _check_gpu_optional(n, data, tdp, problems)  # the optional v1.1 attributes


def _check_gpu_optional(n: Hashable, data: dict[str, Any], tdp: Any, problems: list[str]) -> None:
    mx = data.get("max_power_w")
    if mx is not None:
        if _bad_number(mx, lo=0.0, lo_open=True):
            problems.append(f"GPU {n!r} has max_power_w {mx!r} (must be finite and > 0)")
        elif mx < tdp:
            problems.append(
                f"GPU {n!r} has max_power_w {mx!r} below its tdp_w {tdp!r} "
                "(a board accepts at least its nominal power limit)"
            )
    for key in ("uuid", "host"):
        v = data.get(key)
        if v is not None and (not isinstance(v, str) or not v):
            problems.append(f"GPU {n!r} has {key} {v!r} (must be a non-empty string)")
    idx = data.get("index")
    if idx is not None and (not _is_int(idx) or idx < 0):
        problems.append(f"GPU {n!r} has index {idx!r} (must be a non-negative integer)")


def _check_other_attrs(n: Hashable, kind: str, data: dict[str, Any], problems: list[str]) -> None:
    if kind == "tray":
        p = data.get("p_fail", 0.0)
        if _bad_number(p, lo=0.0, hi=1.0):
            problems.append(f"tray {n!r} has p_fail {p!r} (must be in [0, 1])")
        host = data.get("host")
        if host is not None and (not isinstance(host, str) or not host):
            problems.append(f"tray {n!r} has host {host!r} (must be a non-empty string)")
    elif kind == "domain":
        size = data.get("size")
        if not _is_int(size) or size <= 0:  # type: ignore[operator]
            problems.append(f"domain {n!r} has size {size!r} (must be a positive integer)")
    elif kind == "rack":
        budget = data.get("power_budget_w")
        if budget is not None and _bad_number(budget, lo=0.0):
            problems.append(f"rack {n!r} has power_budget_w {budget!r} (must be finite and >= 0)")
    elif kind == "switch":
        tier = data.get("tier")
        if tier != "leaf" and tier != "spine":
            problems.append(f"switch {n!r} has tier {tier!r} (expected 'leaf' or 'spine')")


def check_topology(G: nx.Graph) -> None:
    """Check a cluster graph against the topology contract, in O(nodes + edges).

    Checks node kinds and attribute ranges (missing optional attributes take their defaults;
    a domain's ``size`` is required), that every edge is a containment edge (gpu-tray,
    tray-domain, tray-rack, domain-leaf switch, switch-switch; no self-loops), that every GPU is
    in exactly one tray, every tray holds at least one GPU and is in exactly one domain and
    exactly one rack, every domain has at least one tray and its ``size`` equals its number of
    GPUs, no GPU is reachable from two domains, edge ``bandwidth_gbps`` (if present) is finite
    and > 0, and the site ``power_budget_w`` (if present) is finite and >= 0. Empty racks and
    domains without a leaf uplink are allowed.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.

    Raises
    ------
    TopologyError
        Listing every problem found (``.problems``), each naming the offending node(s).
    """
    problems: list[str] = []

    site_budget = G.graph.get("power_budget_w")
    if site_budget is not None and _bad_number(site_budget, lo=0.0):
        problems.append(f"site power_budget_w is {site_budget!r} (must be finite and >= 0)")

    # Pass 1: node kinds and attributes.
    kind_of: dict[Hashable, str] = {}
    tier_of: dict[Hashable, Any] = {}
    for n, data in G.nodes(data=True):
        kind = data.get("kind")
        if kind == "gpu":
            kind_of[n] = kind
            _check_gpu_attrs(n, data, problems)
        elif kind in _KIND_ORDER:
            kind_of[n] = kind
            if kind == "switch":
                tier_of[n] = data.get("tier")
            _check_other_attrs(n, kind, data, problems)
        elif kind is None:
            problems.append(f"node {n!r} has no 'kind' attribute")
        else:
            problems.append(f"node {n!r} has unknown kind {kind!r} (expected one of {_KINDS})")

    # Pass 2: each node's neighbourhood. An edge is reported (and its bandwidth checked) by
    # its "owner" end: the one with the smaller (kind order, position in graph) key.
    order = _KIND_ORDER
    pos = {n: i for i, n in enumerate(kind_of)}

    def owns(n: Hashable, k: str, v: Hashable, kv: str | None) -> bool:
        if kv is None:
            return True
        return (order[k], pos[n]) < (order[kv], pos[v])

    tray_gpus: dict[Hashable, list[Hashable]] = {}
    tray_domains: dict[Hashable, list[Hashable]] = {}
    domain_trays: dict[Hashable, list[Hashable]] = {}
    multi_tray_gpus: dict[Hashable, list[Hashable]] = {}
    # The raw adjacency dict (``G._adj``) avoids networkx's per-item view overhead, which
    # dominates on large clusters; it is a plain dict-of-dicts for every networkx.Graph.
    adj = getattr(G, "_adj", None)
    if not isinstance(adj, dict):
        adj = G.adj
    for n, nbrs in adj.items():
        k = kind_of.get(n)
        if k is None:
            continue  # already reported; its edges are judged from the other end
        if n in nbrs:
            problems.append(f"self-loop on {k} {n!r}")
        allowed = _ALLOWED_NEIGHBOURS[k]
        found: dict[str, list[Hashable]] = {}
        for v, e in nbrs.items():
            kv = kind_of.get(v)
            if e:
                bw = e.get("bandwidth_gbps")
                if (
                    bw is not None
                    and v != n
                    and owns(n, k, v, kv)
                    and _bad_number(bw, lo=0.0, lo_open=True)
                ):
                    problems.append(
                        f"edge {n!r}-{v!r} has bandwidth_gbps {bw!r} (must be finite and > 0)"
                    )
            if kv is None or v == n:
                continue
            if kv not in allowed:
                if owns(n, k, v, kv):
                    problems.append(
                        f"invalid edge {n!r}-{v!r}: {k}-{kv} is not a containment edge (allowed: "
                        "gpu-tray, tray-domain, tray-rack, domain-leaf switch, switch-switch)"
                    )
                continue
            if kv in found:
                found[kv].append(v)
            else:
                found[kv] = [v]
            if k == "domain" and kv == "switch" and tier_of[v] != "leaf":
                problems.append(
                    f"domain {n!r} is attached to switch {v!r} of tier {tier_of[v]!r} "
                    "(domains attach to leaf switches)"
                )

        if k == "gpu":
            ts = found.get("tray")
            if ts is None:
                problems.append(f"GPU {n!r} is in no tray")
            elif len(ts) > 1:
                problems.append(f"GPU {n!r} is in {len(ts)} trays: {_names(ts)}")
                multi_tray_gpus[n] = ts
        elif k == "tray":
            gs = found.get("gpu")
            if gs is None:
                problems.append(f"tray {n!r} has no GPU")
            tray_gpus[n] = gs or []
            ds = found.get("domain")
            if ds is None:
                problems.append(f"tray {n!r} is in no domain")
            else:
                tray_domains[n] = ds
                if len(ds) > 1:
                    problems.append(
                        f"tray {n!r} spans domains {_names(ds)} (its GPUs are reachable from "
                        f"{len(ds)} domains)"
                    )
            rs = found.get("rack")
            if rs is None:
                problems.append(f"tray {n!r} is in no rack")
            elif len(rs) > 1:
                problems.append(f"tray {n!r} is in {len(rs)} racks: {_names(rs)}")
        elif k == "domain":
            ts = found.get("tray")
            if ts is None:
                problems.append(f"domain {n!r} has no tray")
            domain_trays[n] = ts or []

    empty: list[Hashable] = []
    for g, ts in multi_tray_gpus.items():
        doms = list(dict.fromkeys(d for t in ts for d in tray_domains.get(t, empty)))
        if len(doms) > 1:
            problems.append(f"GPU {g!r} is reachable from {len(doms)} domains: {_names(doms)}")

    nodes = G.nodes
    for d, ts in domain_trays.items():
        size = nodes[d].get("size")
        if not (_is_int(size) and size > 0):
            continue  # already reported
        if multi_tray_gpus:
            num = len({g for t in ts for g in tray_gpus[t]})
        else:
            num = sum(len(tray_gpus[t]) for t in ts)
        if num != size:
            problems.append(f"domain {d!r} has size {size} but contains {num} GPUs")

    if problems:
        raise TopologyError(problems)
