"""Cluster consistency check: :func:`check_topology` and :class:`TopologyError`.

:func:`check_topology` runs named checks in a fixed order (site attributes, node attributes,
each node's neighbourhood, GPUs shared between domains, domain sizes), so the problems it
reports come in a deterministic order.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ntp_opt.model.topology.attrs import DEFAULT_TDP_W, FAILED, HEALTHY, KINDS, is_int, is_real

if TYPE_CHECKING:
    import networkx as nx

_KIND_ORDER = {k: i for i, k in enumerate(KINDS)}
_MAX_PROBLEMS_SHOWN = 20


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
    if not is_real(x) or not math.isfinite(x):  # type: ignore[arg-type]
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
    if idx is not None and (not is_int(idx) or idx < 0):
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
        if not is_int(size) or size <= 0:  # type: ignore[operator]
            problems.append(f"domain {n!r} has size {size!r} (must be a positive integer)")
    elif kind == "rack":
        budget = data.get("power_budget_w")
        if budget is not None and _bad_number(budget, lo=0.0):
            problems.append(f"rack {n!r} has power_budget_w {budget!r} (must be finite and >= 0)")
    elif kind == "switch":
        tier = data.get("tier")
        if tier != "leaf" and tier != "spine":
            problems.append(f"switch {n!r} has tier {tier!r} (expected 'leaf' or 'spine')")


def _check_site(G: nx.Graph, problems: list[str]) -> None:
    site_budget = G.graph.get("power_budget_w")
    if site_budget is not None and _bad_number(site_budget, lo=0.0):
        problems.append(f"site power_budget_w is {site_budget!r} (must be finite and >= 0)")


def _check_nodes(
    G: nx.Graph, problems: list[str]
) -> tuple[dict[Hashable, str], dict[Hashable, Any]]:
    """Node kinds and attributes; return the kind of every valid node and each switch's tier."""
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
            problems.append(f"node {n!r} has unknown kind {kind!r} (expected one of {KINDS})")
    return kind_of, tier_of


@dataclass
class _Containment:
    """What the neighbourhood pass learnt about containment, for the later checks."""

    kind_of: dict[Hashable, str]
    tier_of: dict[Hashable, Any]
    pos: dict[Hashable, int] = field(init=False)
    tray_gpus: dict[Hashable, list[Hashable]] = field(default_factory=dict)
    tray_domains: dict[Hashable, list[Hashable]] = field(default_factory=dict)
    domain_trays: dict[Hashable, list[Hashable]] = field(default_factory=dict)
    multi_tray_gpus: dict[Hashable, list[Hashable]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pos = {n: i for i, n in enumerate(self.kind_of)}

    def owns(self, n: Hashable, k: str, v: Hashable, kv: str | None) -> bool:
        """An edge is reported (and its bandwidth checked) by its "owner" end: the one with
        the smaller (kind order, position in graph) key."""
        if kv is None:
            return True
        return (_KIND_ORDER[k], self.pos[n]) < (_KIND_ORDER[kv], self.pos[v])


def _check_neighbours(
    c: _Containment, n: Hashable, k: str, nbrs: dict[Hashable, Any], problems: list[str]
) -> dict[str, list[Hashable]]:
    """Edges of one node: bandwidths, containment kinds, domain uplinks; return the
    neighbours by kind."""
    if n in nbrs:
        problems.append(f"self-loop on {k} {n!r}")
    allowed = _ALLOWED_NEIGHBOURS[k]
    found: dict[str, list[Hashable]] = {}
    for v, e in nbrs.items():
        kv = c.kind_of.get(v)
        if e:
            bw = e.get("bandwidth_gbps")
            if (
                bw is not None
                and v != n
                and c.owns(n, k, v, kv)
                and _bad_number(bw, lo=0.0, lo_open=True)
            ):
                problems.append(
                    f"edge {n!r}-{v!r} has bandwidth_gbps {bw!r} (must be finite and > 0)"
                )
        if kv is None or v == n:
            continue
        if kv not in allowed:
            if c.owns(n, k, v, kv):
                problems.append(
                    f"invalid edge {n!r}-{v!r}: {k}-{kv} is not a containment edge (allowed: "
                    "gpu-tray, tray-domain, tray-rack, domain-leaf switch, switch-switch)"
                )
            continue
        if kv in found:
            found[kv].append(v)
        else:
            found[kv] = [v]
        if k == "domain" and kv == "switch" and c.tier_of[v] != "leaf":
            problems.append(
                f"domain {n!r} is attached to switch {v!r} of tier {c.tier_of[v]!r} "
                "(domains attach to leaf switches)"
            )
    return found


def _check_membership(
    c: _Containment, n: Hashable, k: str, found: dict[str, list[Hashable]], problems: list[str]
) -> None:
    """GPU in one tray; tray with GPUs, in one domain and one rack; domain with trays."""
    if k == "gpu":
        ts = found.get("tray")
        if ts is None:
            problems.append(f"GPU {n!r} is in no tray")
        elif len(ts) > 1:
            problems.append(f"GPU {n!r} is in {len(ts)} trays: {_names(ts)}")
            c.multi_tray_gpus[n] = ts
    elif k == "tray":
        gs = found.get("gpu")
        if gs is None:
            problems.append(f"tray {n!r} has no GPU")
        c.tray_gpus[n] = gs or []
        ds = found.get("domain")
        if ds is None:
            problems.append(f"tray {n!r} is in no domain")
        else:
            c.tray_domains[n] = ds
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
        c.domain_trays[n] = ts or []


def _check_edges(G: nx.Graph, c: _Containment, problems: list[str]) -> None:
    """Each valid node's neighbourhood, filling `c`'s containment maps."""
    # The raw adjacency dict (``G._adj``) avoids networkx's per-item view overhead, which
    # dominates on large clusters; it is a plain dict-of-dicts for every networkx.Graph.
    adj = getattr(G, "_adj", None)
    if not isinstance(adj, dict):
        adj = G.adj
    for n, nbrs in adj.items():
        k = c.kind_of.get(n)
        if k is None:
            continue  # already reported; its edges are judged from the other end
        found = _check_neighbours(c, n, k, nbrs, problems)
        _check_membership(c, n, k, found, problems)


def _check_shared_gpus(c: _Containment, problems: list[str]) -> None:
    """No GPU reachable from two domains (through two trays)."""
    empty: list[Hashable] = []
    for g, ts in c.multi_tray_gpus.items():
        doms = list(dict.fromkeys(d for t in ts for d in c.tray_domains.get(t, empty)))
        if len(doms) > 1:
            problems.append(f"GPU {g!r} is reachable from {len(doms)} domains: {_names(doms)}")


def _check_domain_sizes(G: nx.Graph, c: _Containment, problems: list[str]) -> None:
    """Each domain's ``size`` equals its number of GPUs."""
    nodes = G.nodes
    for d, ts in c.domain_trays.items():
        size = nodes[d].get("size")
        if not (is_int(size) and size > 0):
            continue  # already reported
        if c.multi_tray_gpus:
            num = len({g for t in ts for g in c.tray_gpus[t]})
        else:
            num = sum(len(c.tray_gpus[t]) for t in ts)
        if num != size:
            problems.append(f"domain {d!r} has size {size} but contains {num} GPUs")


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
    _check_site(G, problems)
    kind_of, tier_of = _check_nodes(G, problems)
    c = _Containment(kind_of, tier_of)
    _check_edges(G, c, problems)
    _check_shared_gpus(c, problems)
    _check_domain_sizes(G, c, problems)
    if problems:
        raise TopologyError(problems)
