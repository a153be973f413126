"""Cluster builders: a homogeneous cluster of NVLink domains and the DGX / NVL presets.

Node ids built here are strings: domains ``d{i}``, trays ``d{i}.t{j}``, GPUs ``d{i}.t{j}.g{k}``,
racks ``r{i}``, leaf switches ``leaf{i}``, spine switches ``spine{i}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ntp_opt.model.topology.attrs import (
    DEFAULT_TDP_W,
    HEALTHY,
    NIC_GBPS_PER_GPU,
    require_pos_finite,
    require_pos_int,
)

if TYPE_CHECKING:
    import networkx as nx

_MAX_DEFAULT_SPINES = 32


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
    shape = _Shape.checked(
        num_domains,
        domain_size,
        gpus_per_tray,
        trays_per_rack,
        domains_per_leaf,
        num_spines,
        tdp_w,
        rack_power_factor,
        name,
    )
    nodes, edges = _domain_records(shape)
    _rack_and_switch_records(shape, nodes, edges)

    import networkx as nx  # on first use: loading an instance file needs no graph

    G = nx.Graph()
    G.graph["name"] = (
        name if name is not None else f"cluster-{shape.num_domains}x{shape.domain_size}"
    )
    G.graph["power_budget_w"] = shape.num_trays * shape.gpus_per_tray * shape.tdp
    G.add_nodes_from(nodes)
    G.add_edges_from(edges)
    return G


_Nodes = list[tuple[str, dict[str, Any]]]
_Edges = list[tuple[str, str] | tuple[str, str, dict[str, Any]]]


@dataclass(frozen=True)
class _Shape:
    """The checked arguments of :func:`build_cluster` and the counts they imply."""

    num_domains: int
    domain_size: int
    gpus_per_tray: int
    trays_per_rack: int
    domains_per_leaf: int
    spines: int | None  # as given (``None``: the default)
    tdp: float
    factor: float

    @classmethod
    def checked(
        cls,
        num_domains: int,
        domain_size: int,
        gpus_per_tray: int,
        trays_per_rack: int,
        domains_per_leaf: int,
        num_spines: int | None,
        tdp_w: float,
        rack_power_factor: float,
        name: str | None,
    ) -> _Shape:
        """The checked shape (:func:`build_cluster`'s errors, in its order); ``name`` is checked."""
        shape = cls(
            require_pos_int("num_domains", num_domains),
            require_pos_int("domain_size", domain_size),
            require_pos_int("gpus_per_tray", gpus_per_tray),
            require_pos_int("trays_per_rack", trays_per_rack),
            require_pos_int("domains_per_leaf", domains_per_leaf),
            None if num_spines is None else require_pos_int("num_spines", num_spines),
            require_pos_finite("tdp_w", tdp_w),
            require_pos_finite("rack_power_factor", rack_power_factor),
        )
        if name is not None and not isinstance(name, str):
            raise ValueError(f"name must be a string or None, got {name!r}")
        shape.check_trays()
        return shape

    def check_trays(self) -> None:
        """Raise ``ValueError`` unless trays fill the domains and racks (:func:`build_cluster`)."""
        domain_size, gpus_per_tray = self.domain_size, self.gpus_per_tray
        trays_per_rack = self.trays_per_rack
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

    @property
    def trays_per_domain(self) -> int:
        return self.domain_size // self.gpus_per_tray

    @property
    def num_trays(self) -> int:
        return self.num_domains * self.trays_per_domain

    @property
    def num_leaves(self) -> int:
        return -(-self.num_domains // self.domains_per_leaf)

    @property
    def num_spines(self) -> int:
        if self.spines is not None:
            return self.spines
        return min(_MAX_DEFAULT_SPINES, max(1, -(-self.num_leaves // 8)))

    @property
    def domain_bw(self) -> float:
        return NIC_GBPS_PER_GPU * self.domain_size

    @property
    def rack_ids(self) -> list[str]:
        return [f"r{r}" for r in range(-(-self.num_trays // self.trays_per_rack))]


def _domain_records(shape: _Shape) -> tuple[_Nodes, _Edges]:
    """The domain, tray and GPU nodes with their edges (to trays, racks and leaves)."""
    nodes: _Nodes = []
    edges: _Edges = []
    rack_ids = shape.rack_ids
    domain_bw = shape.domain_bw
    gpu_proto = {"kind": "gpu", "state": HEALTHY, "speed": 1.0, "p_fail": 0.0, "tdp_w": shape.tdp}
    global_tray = 0
    for i in range(shape.num_domains):
        d = f"d{i}"
        nodes.append((d, {"kind": "domain", "size": shape.domain_size}))
        for j in range(shape.trays_per_domain):
            t = f"{d}.t{j}"
            nodes.append((t, {"kind": "tray", "p_fail": 0.0}))
            edges.append((t, d))
            edges.append((t, rack_ids[global_tray // shape.trays_per_rack]))
            global_tray += 1
            for k in range(shape.gpus_per_tray):
                g = f"{t}.g{k}"
                nodes.append((g, dict(gpu_proto)))
                edges.append((g, t))
        edges.append((d, f"leaf{i // shape.domains_per_leaf}", {"bandwidth_gbps": domain_bw}))
    return nodes, edges


def _rack_and_switch_records(shape: _Shape, nodes: _Nodes, edges: _Edges) -> None:
    """Append the rack and switch nodes and the leaf-spine edges."""
    num_trays, trays_per_rack = shape.num_trays, shape.trays_per_rack
    num_spines = shape.num_spines
    spine_ids = [f"spine{s}" for s in range(num_spines)]
    for r, rid in enumerate(shape.rack_ids):
        trays_in_rack = min(trays_per_rack, num_trays - r * trays_per_rack)
        budget = shape.factor * trays_in_rack * shape.gpus_per_tray * shape.tdp
        nodes.append((rid, {"kind": "rack", "power_budget_w": budget}))
    for s in range(shape.num_leaves):
        lid = f"leaf{s}"
        nodes.append((lid, {"kind": "switch", "tier": "leaf"}))
        domains_on_leaf = min(
            shape.domains_per_leaf, shape.num_domains - s * shape.domains_per_leaf
        )
        uplink_bw = domains_on_leaf * shape.domain_bw / num_spines
        edges.extend((lid, sp, {"bandwidth_gbps": uplink_bw}) for sp in spine_ids)
    nodes.extend((sp, {"kind": "switch", "tier": "spine"}) for sp in spine_ids)


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
    num_nodes = require_pos_int("num_nodes", num_nodes)
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
    num_domains = require_pos_int("num_domains", num_domains)
    gpus_per_tray = require_pos_int("gpus_per_tray", gpus_per_tray)
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
    num_racks = require_pos_int("num_racks", num_racks)
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
    num_domains = require_pos_int("num_domains", num_domains)
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


DOMAIN_SIZE: dict[str, int] = {"dgx-h100": 8, "nvl32": 32, "nvl72": 72, "nvl36x2": 72}
"""GPUs per NVLink domain of each preset in ``BUILDERS``."""


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
    num_gpus = require_pos_int("num_gpus", num_gpus)
    size = DOMAIN_SIZE[kind]
    if num_gpus % size:
        raise ValueError(
            f"num_gpus ({num_gpus}) must be a multiple of the {kind} domain size ({size})"
        )
    return BUILDERS[kind](num_gpus // size, **kw)
