"""Build the cluster graph from what the scheduler and the driver say.

Each importer reduces its source to :class:`Host` records (the scheduler's view:
name, GPU count, NVLink domain, rack, health, product) and, with
``--nvidia-smi``, :class:`SmiHost` records (the driver's view, per GPU). The
function :func:`compose_cluster` joins them into the cluster graph of
``docs/model.md`` section 1, built the way :mod:`ntp_opt.topology`'s builders
build theirs (containment edges gpu-tray, tray-domain, tray-rack; rack budget =
sum of its GPUs' ``tdp_w``; site budget = sum of all ``tdp_w``), with node ids
that keep the real names:

* tray id = the scheduler's host name (attribute ``host`` as well);
* GPU id = ``"<host>:gpu<index>"``, attributes ``host``, ``index`` and, with
  ``nvidia-smi`` output, ``uuid``;
* domain id = the Slurm block name, the ``nvidia.com/gpu.clique`` label value,
  or ``"<host>/nvlink"`` for a Kubernetes node without a clique (one NVLink
  domain per host, as on DGX/HGX H100);
* rack id = the rack label value, or ``"<domain>/rack"`` (one rack per domain).

No switch nodes are written: neither source describes the scale-out fabric.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, NoReturn

import networkx as nx

from ntp_opt.model import hardware
from ntp_opt.model.files import InputError
from ntp_opt.model.topology import DEFAULT_TDP_W

__all__ = ["Host", "SmiGpu", "SmiHost", "Warn", "compose_cluster", "fail"]

Warn = Callable[[str], None]
"""Where importers report warnings (the CLI prints them to stderr)."""


def fail(where: str, msg: str, field_: str = "") -> NoReturn:
    """Raise :class:`ntp_opt.files.InputError` for ``where``.

    Parameters
    ----------
    where : str
        ``FILE:LINE``, ``FILE: JSON path`` or ``FILE``.
    msg : str
        What is wrong.
    field_ : str
        A field path (JSON path, XPath) printed after ``where``.
    """
    raise InputError(where, [(field_, msg)])


@dataclass
class Host:
    """One host as the scheduler describes it."""

    name: str
    gpus: int
    domain: str
    rack: str
    where: str
    field: str = ""
    failed_reason: str | None = None
    product: str | None = None
    fabric_domain: str | None = None
    aliases: tuple[str, ...] = ()
    domain_where: str = ""


@dataclass
class SmiGpu:
    """One GPU as ``nvidia-smi -q -x`` describes it."""

    index: int
    uuid: str | None
    product: str | None
    tdp_w: float | None
    max_power_w: float | None
    clique: str | None
    where: str
    field: str
    failed: list[str] = dc_field(default_factory=list)


@dataclass
class SmiHost:
    """One host's ``nvidia-smi -q -x`` file."""

    path: str
    gpus: list[SmiGpu]
    capped: list[tuple[float, float]] = dc_field(default_factory=list)


@dataclass
class _Power:
    tdp_w: float
    max_power_w: float | None


def _product_power(product: str | None, host: str, warn: Warn, seen: set[str]) -> _Power:
    found = hardware.lookup(product) if product else None
    if found is not None:
        return _Power(found.tdp_w, found.max_power_w)
    key = product or ""
    if key not in seen:
        seen.add(key)
        what = f"GPU product {product!r}" if product else "no GPU product"
        warn(
            f"{what} (first on host {host}) is not in the hardware table: tdp_w "
            f"{DEFAULT_TDP_W:g} W and no max_power_w (the job's max_boost applies); give "
            "--nvidia-smi output to read the real limits"
        )
    return _Power(DEFAULT_TDP_W, None)


def _clash(
    first: dict[str, tuple[str, str]], key: str, value: str, host: str
) -> tuple[str, str] | None:
    """``(value, host)`` first recorded for ``key`` if it differs from ``value``, else None."""
    prev = first.setdefault(key, (value, host))
    return prev if prev[0] != value else None


def _check_cliques(hosts: list[Host], smi: dict[str, SmiHost]) -> None:
    clique_of_domain: dict[str, tuple[str, str]] = {}
    domain_of_clique: dict[str, tuple[str, str]] = {}
    for h in hosts:
        data = smi.get(h.name)
        if data is None:
            continue
        for g in data.gpus:
            if g.clique is None:
                continue
            if h.fabric_domain is not None and g.clique != h.fabric_domain:
                fail(
                    g.where,
                    f"fabric clique {g.clique} of GPU {g.index} disagrees with the "
                    f"scheduler's NVLink domain {h.fabric_domain} for host {h.name} ({h.where})",
                    g.field,
                )
            if prev := _clash(clique_of_domain, h.domain, g.clique, h.name):
                fail(
                    g.where,
                    f"fabric clique {g.clique} of host {h.name} differs from clique {prev[0]} "
                    f"of host {prev[1]}, but the scheduler puts both in NVLink domain {h.domain}",
                    g.field,
                )
            if other := _clash(domain_of_clique, g.clique, h.domain, h.name):
                fail(
                    g.where,
                    f"fabric clique {g.clique} of host {h.name} (domain {h.domain}) is also "
                    f"the clique of host {other[1]} in another domain {other[0]}",
                    g.field,
                )


def compose_cluster(
    hosts: list[Host],
    smi: dict[str, SmiHost] | None,
    *,
    name: str,
    warn: Warn,
) -> nx.Graph:
    """Join the scheduler's hosts and the driver's GPUs into a cluster graph.

    Parameters
    ----------
    hosts : list of Host
        Every host of the NVLink topology, in the order the scheduler lists them.
    smi : dict of str to SmiHost, optional
        ``nvidia-smi -q -x`` output by host name (hosts without a file take the
        hardware table's limits for their product).
    name : str
        ``G.graph["name"]``.
    warn : callable
        Called with one message per warning.

    Returns
    -------
    networkx.Graph
        The cluster (see the module docstring for ids and attributes).

    Raises
    ------
    ntp_opt.files.InputError
        When the sources disagree: more GPUs in the XML than the scheduler counts,
        duplicate device indices, fabric cliques that contradict the scheduler's
        domains, a node id used twice.
    """
    smi = smi or {}
    seen_products: set[str] = set()
    G = nx.Graph()
    G.graph["name"] = name
    domain_gpus: dict[str, int] = {}
    rack_tdp: dict[str, float] = {}
    _check_cliques(hosts, smi)

    gpu_rows: list[tuple[str, dict[str, Any]]] = []
    edges: list[tuple[str, str]] = []
    tray_rows: list[tuple[str, dict[str, Any]]] = []
    for h in hosts:
        data = smi.get(h.name)
        xml_gpus = data.gpus if data is not None else []
        if data is not None and len(xml_gpus) > h.gpus:
            fail(
                data.path,
                f"lists {len(xml_gpus)} GPUs but the scheduler counts {h.gpus} on host "
                f"{h.name} ({h.where})",
            )
        by_index: dict[int, SmiGpu] = {}
        for g in xml_gpus:
            if g.index in by_index:
                fail(g.where, f"device index {g.index} appears twice", g.field)
            by_index[g.index] = g
        missing = h.gpus - len(xml_gpus)
        free = (i for i in range(h.gpus + len(xml_gpus) + 1) if i not in by_index)
        missing_idx = [next(free) for _ in range(missing)] if data is not None else []
        if data is not None and missing:
            warn(
                f"{data.path}: {missing} of the {h.gpus} GPUs the scheduler counts on host "
                f"{h.name} are missing from the nvidia-smi output: GPU(s) "
                f"{', '.join(map(str, missing_idx))} marked failed"
            )
        product = next((g.product for g in xml_gpus if g.product), None) or h.product
        table = _product_power(product, h.name, warn, seen_products)
        sibling = next((g for g in xml_gpus if g.tdp_w is not None), None)
        fallback = (
            _Power(sibling.tdp_w, sibling.max_power_w)  # type: ignore[arg-type]
            if sibling is not None
            else table
        )
        if h.failed_reason:
            warn(f"{h.where}: host {h.name} is {h.failed_reason}: its {h.gpus} GPUs are failed")

        indices = sorted([*by_index, *missing_idx]) if data is not None else list(range(h.gpus))
        tray_rows.append((h.name, {"kind": "tray", "p_fail": 0.0, "host": h.name}))
        edges.append((h.name, h.domain))
        edges.append((h.name, h.rack))
        for i in indices:
            sg = by_index.get(i)
            failed = bool(h.failed_reason) or (data is not None and sg is None)
            if sg is not None and sg.failed:
                failed = True
                if not h.failed_reason:
                    warn(
                        f"{sg.where}: GPU {i} of host {h.name} marked failed: "
                        + "; ".join(sg.failed)
                    )
            tdp = sg.tdp_w if sg is not None and sg.tdp_w is not None else fallback.tdp_w
            mx = sg.max_power_w if sg is not None and sg.tdp_w is not None else fallback.max_power_w
            if mx is None:
                mx = table.max_power_w  # an XML without a max limit: the product's, if known
            attrs: dict[str, Any] = {
                "kind": "gpu",
                "state": "failed" if failed else "healthy",
                "speed": 1.0,
                "p_fail": 0.0,
                "tdp_w": float(tdp),
            }
            if mx is not None:
                attrs["max_power_w"] = float(max(mx, tdp))
            attrs["host"] = h.name
            attrs["index"] = i
            if sg is not None and sg.uuid:
                attrs["uuid"] = sg.uuid
            gid = f"{h.name}:gpu{i}"
            gpu_rows.append((gid, attrs))
            edges.append((gid, h.name))
            rack_tdp[h.rack] = rack_tdp.get(h.rack, 0.0) + float(tdp)
        domain_gpus[h.domain] = domain_gpus.get(h.domain, 0) + len(indices)

    ids: dict[str, str] = {}

    def claim(node: str, kind: str) -> None:
        if node in ids:
            # point at where the name came from: the block / label that made the domain or
            # rack, else the host record
            first = ids[node]
            src = next(
                (
                    h.domain_where or h.where
                    for h in hosts
                    if (h.domain == node and "domain" in (first, kind))
                    or (h.rack == node and "rack" in (first, kind))
                ),
                None,
            )
            where = src or next((h.where for h in hosts if h.name == node.split(":")[0]), name)
            fail(where, f"name {node!r} is used both as a {first} and as a {kind}")
        ids[node] = kind

    for d in domain_gpus:
        claim(d, "domain")
    for r in rack_tdp:
        claim(r, "rack")
    for t, _ in tray_rows:
        claim(t, "tray")
    for gid, _ in gpu_rows:
        claim(gid, "gpu")

    G.add_nodes_from((d, {"kind": "domain", "size": n}) for d, n in domain_gpus.items())
    G.add_nodes_from(tray_rows)
    G.add_nodes_from(gpu_rows)
    G.add_nodes_from((r, {"kind": "rack", "power_budget_w": w}) for r, w in rack_tdp.items())
    G.add_edges_from(edges)
    G.graph["power_budget_w"] = float(sum(rack_tdp.values()))
    return G
