"""Build the cluster graph from what the scheduler and the driver say.

Each importer reduces its source to :class:`Host` records (the scheduler's view:
name, GPU count, NVLink domain, rack, health, product) and, with
``--nvidia-smi``, :class:`SmiHost` records (the driver's view, per GPU). The
function :func:`compose_cluster` joins them into the cluster graph of
``docs/model.md`` section 1, built the way :mod:`ntp_opt.model.topology`'s builders
build theirs (containment edges gpu-tray, tray-domain, tray-rack; rack budget =
sum of its GPUs' ``tdp_w``; site budget = sum of all ``tdp_w``), with node ids
that keep the real names:

* tray id = the scheduler's host name (attribute ``host`` as well);
* GPU id = ``"<host>:gpu<index>"``, attributes ``host``, ``index`` and, with
  ``nvidia-smi`` output, ``uuid``;
* domain id = the Slurm block name, the ``nvidia.com/gpu.clique`` label value,
  or ``"<host>/nvlink"`` for a Kubernetes node without a clique (one NVLink
  domain per host, as on DGX/HGX H100);
* rack id = the rack label value, or ``"<domain>/rack"`` (one rack per domain);
  attribute ``budget_source`` says how the rack was formed and where its GPUs'
  ``tdp_w`` came from (``ntp-opt info`` shows it).

Power is never guessed: a GPU's ``tdp_w`` comes from its ``nvidia-smi`` file (or
a sibling GPU's on the same host), else from the hardware table for a known
product, else from the ``--tdp-w`` option (:class:`PowerDefault`); with none of
them the import is refused. No switch nodes are written: neither source
describes the scale-out fabric.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, NoReturn

import networkx as nx

from ntp_opt.model import hardware
from ntp_opt.model.files import InputError, caps

__all__ = [
    "MAX_GPUS_PER_HOST",
    "MAX_WATTS",
    "Host",
    "PowerDefault",
    "SmiGpu",
    "SmiHost",
    "UnreadableInput",
    "Warn",
    "compose_cluster",
    "fail",
    "read_capped",
    "show",
]

#: Most GPUs one host may have (scheduler count, XML file): a DGX/HGX host has 8,
#: a GB200 tray 4; the cap keeps a hostile count from building millions of nodes.
MAX_GPUS_PER_HOST = 1024
#: Largest power limit accepted from any source, in watts (boards draw at most a
#: few kW; the instance schema's own bound is 10^6 W).
MAX_WATTS = 100_000.0

Warn = Callable[[str], None]
"""Where importers report warnings (the CLI prints them to stderr)."""


def fail(where: str, msg: str, field_: str = "") -> NoReturn:
    """Raise :class:`ntp_opt.model.files.InputError` for ``where``.

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


class UnreadableInput(InputError):
    """An input file that is empty or cannot be read (the caller may only warn)."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _regular(mode: int, src: str) -> None:
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a file")
        fail(src, f"not a regular file ({kind}): refused, reading it could block or never end")


def read_capped(path: str | os.PathLike[str], max_bytes: int, hint: str = "") -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` bytes.

    A FIFO, socket, device or directory is refused before it is opened (and
    again on the opened descriptor, which is opened non-blocking, so that a
    file swapped for a FIFO in between cannot block); the size is checked
    before reading and while reading.

    Parameters
    ----------
    path : str or path-like
        The file.
    max_bytes : int
        Largest size accepted.
    hint : str
        Appended to the too-large message (what a real file weighs).

    Returns
    -------
    bytes

    Raises
    ------
    UnreadableInput
        The file is empty (or only white space) or cannot be opened or read.
    ntp_opt.model.files.InputError
        Not a regular file, or too large.
    """
    src = str(path)
    try:
        _regular(os.stat(path).st_mode, src)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise UnreadableInput(src, [("", f"cannot read file: {err.strerror}")]) from None
    chunks: list[bytes] = []
    total = 0
    try:
        st = os.fstat(fd)
        _regular(st.st_mode, src)
        too_big = f"more than {max_bytes} bytes{hint}"
        if st.st_size > max_bytes:
            fail(src, f"file is {st.st_size} bytes, {too_big}")
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > max_bytes:
                fail(src, f"file grew to {too_big}")
            chunks.append(chunk)
    except OSError as err:
        raise UnreadableInput(src, [("", f"cannot read file: {err.strerror}")]) from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if not raw.strip():
        raise UnreadableInput(src, [("", "empty file")])
    return raw


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for echoing untrusted values in messages."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "..."


@dataclass(frozen=True)
class PowerDefault:
    """Power for GPUs whose limits neither ``nvidia-smi`` nor the hardware table give.

    ``tdp_w`` (``--tdp-w``) is their nominal power and counts in their rack's
    budget; ``max_power_w`` (``--max-power-w``, at least ``tdp_w``) the largest
    limit their boards accept. Without ``max_power_w`` they are not boosted.
    """

    tdp_w: float
    max_power_w: float | None = None


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
    rack_source: str = ""
    """How ``rack`` was chosen (``"node label example.com/rack"``); empty for the
    default ``"<domain>/rack"`` (one rack per NVLink domain)."""


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
    source: str  # "nvidia-smi", "the hardware table" or "--tdp-w"
    table_max_w: float | None = None  # the product's max limit, for XML without one


def _host_power(
    h: Host, xml_gpus: list[SmiGpu], power: PowerDefault | None
) -> tuple[_Power | None, str]:
    """Limits for the host's GPUs without their own XML readings (None: unknown), and why."""
    product = next((g.product for g in xml_gpus if g.product), None) or h.product
    found = hardware.lookup(product) if product else None
    sibling = next((g for g in xml_gpus if g.tdp_w is not None), None)
    if sibling is not None and sibling.tdp_w is not None:
        mx = found.max_power_w if found is not None else None
        return _Power(sibling.tdp_w, sibling.max_power_w, "nvidia-smi", mx), ""
    if found is not None:
        return _Power(found.tdp_w, found.max_power_w, "the hardware table"), ""
    if power is not None:
        return _Power(power.tdp_w, power.max_power_w or power.tdp_w, "--tdp-w"), ""
    if product:
        return None, f"GPU product {show(product)} is not in the hardware table"
    return None, "no GPU product is named (no nvidia-smi file, no product from the scheduler)"


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
    power: PowerDefault | None = None,
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
    power : PowerDefault, optional
        Limits for GPUs whose power neither ``nvidia-smi`` nor the hardware table
        gives (``--tdp-w``, ``--max-power-w``); without it such GPUs are refused.

    Returns
    -------
    networkx.Graph
        The cluster (see the module docstring for ids and attributes).

    Raises
    ------
    ntp_opt.model.files.InputError
        When the sources disagree: more GPUs in the XML than the scheduler counts,
        duplicate device indices, fabric cliques that contradict the scheduler's
        domains, a node id used twice; a host with more than
        :data:`MAX_GPUS_PER_HOST` GPUs, more nodes than an instance file may hold,
        or GPUs whose power is not known.
    """
    smi = smi or {}
    _check_sizes(hosts)
    powers = _powers(hosts, smi, power, warn)
    _check_cliques(hosts, smi)
    rows = _Rows()
    for h in hosts:
        _add_host(rows, h, smi.get(h.name), powers[h.name], warn)
    if rows.no_max:
        warn(
            f"nvidia-smi: {rows.no_max} GPU(s) without a max power limit, of a product not in "
            "the hardware table: planned without boost (max_power_w = tdp_w)"
        )
    _check_names(rows, hosts, name)
    return _graph(rows, name)


@dataclass
class _Rows:
    """The nodes and edges of the cluster graph, gathered host by host."""

    gpu_rows: list[tuple[str, dict[str, Any]]] = dc_field(default_factory=list)
    tray_rows: list[tuple[str, dict[str, Any]]] = dc_field(default_factory=list)
    edges: list[tuple[str, str]] = dc_field(default_factory=list)
    domain_gpus: dict[str, int] = dc_field(default_factory=dict)
    rack_tdp: dict[str, float] = dc_field(default_factory=dict)
    rack_from: dict[str, set[str]] = dc_field(default_factory=dict)
    rack_kind: dict[str, str] = dc_field(default_factory=dict)
    no_max: int = 0


def _xml_indices(h: Host, data: SmiHost | None, warn: Warn) -> tuple[dict[int, SmiGpu], list[int]]:
    """The XML's GPUs of ``h`` by device index, and the indices of all its GPUs."""
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
    if h.failed_reason:
        warn(f"{h.where}: host {h.name} is {h.failed_reason}: its {h.gpus} GPUs are failed")
    indices = sorted([*by_index, *missing_idx]) if data is not None else list(range(h.gpus))
    return by_index, indices


def _add_host(rows: _Rows, h: Host, data: SmiHost | None, fallback: _Power, warn: Warn) -> None:
    """Add host ``h``, its GPUs and their edges to ``rows``."""
    by_index, indices = _xml_indices(h, data, warn)
    rows.tray_rows.append((h.name, {"kind": "tray", "p_fail": 0.0, "host": h.name}))
    rows.rack_kind.setdefault(h.rack, h.rack_source or "one rack per NVLink domain")
    sources = rows.rack_from.setdefault(h.rack, set())
    rows.edges.append((h.name, h.domain))
    rows.edges.append((h.name, h.rack))
    for i in indices:
        sg = by_index.get(i)
        failed = bool(h.failed_reason) or (data is not None and sg is None)
        if sg is not None and sg.failed:
            failed = True
            if not h.failed_reason:
                warn(f"{sg.where}: GPU {i} of host {h.name} marked failed: " + "; ".join(sg.failed))
        own = sg is not None and sg.tdp_w is not None
        tdp = sg.tdp_w if sg is not None and sg.tdp_w is not None else fallback.tdp_w
        mx = sg.max_power_w if sg is not None and own else fallback.max_power_w
        if mx is None:  # an XML without a max limit: the product's if known, else no boost
            mx = fallback.table_max_w
            rows.no_max += mx is None
        sources.add("nvidia-smi" if own else fallback.source)
        attrs: dict[str, Any] = {
            "kind": "gpu",
            "state": "failed" if failed else "healthy",
            "speed": 1.0,
            "p_fail": 0.0,
            "tdp_w": float(tdp),
        }
        attrs["max_power_w"] = float(max(mx, tdp)) if mx is not None else float(tdp)
        attrs["host"] = h.name
        attrs["index"] = i
        if sg is not None and sg.uuid:
            attrs["uuid"] = sg.uuid
        gid = f"{h.name}:gpu{i}"
        rows.gpu_rows.append((gid, attrs))
        rows.edges.append((gid, h.name))
        rows.rack_tdp[h.rack] = rows.rack_tdp.get(h.rack, 0.0) + float(tdp)
    rows.domain_gpus[h.domain] = rows.domain_gpus.get(h.domain, 0) + len(indices)


def _claim(ids: dict[str, str], node: str, kind: str, hosts: list[Host], name: str) -> None:
    """Record ``node`` as a ``kind``; refuse a name used for two kinds of node."""
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


def _check_names(rows: _Rows, hosts: list[Host], name: str) -> None:
    """Refuse a node id used twice (domains, racks, trays, GPUs, in that order)."""
    ids: dict[str, str] = {}
    for d in rows.domain_gpus:
        _claim(ids, d, "domain", hosts, name)
    for r in rows.rack_tdp:
        _claim(ids, r, "rack", hosts, name)
    for t, _ in rows.tray_rows:
        _claim(ids, t, "tray", hosts, name)
    for gid, _ in rows.gpu_rows:
        _claim(ids, gid, "gpu", hosts, name)


def _graph(rows: _Rows, name: str) -> nx.Graph:
    """The cluster graph of ``rows``."""
    G = nx.Graph()
    G.graph["name"] = name
    G.add_nodes_from((d, {"kind": "domain", "size": n}) for d, n in rows.domain_gpus.items())
    G.add_nodes_from(rows.tray_rows)
    G.add_nodes_from(rows.gpu_rows)
    order = ("nvidia-smi", "the hardware table", "--tdp-w")
    G.add_nodes_from(
        (
            r,
            {
                "kind": "rack",
                "power_budget_w": w,
                "budget_source": f"{rows.rack_kind[r]}; sum of its GPUs' tdp_w (from "
                + ", ".join(x for x in order if x in rows.rack_from[r])
                + ")",
            },
        )
        for r, w in rows.rack_tdp.items()
    )
    G.add_edges_from(rows.edges)
    G.graph["power_budget_w"] = float(sum(rows.rack_tdp.values()))
    return G


def _check_sizes(hosts: list[Host]) -> None:
    """Refuse hosts with too many GPUs and clusters an instance file cannot hold."""
    total = 0
    for h in hosts:
        if not 0 < h.gpus <= MAX_GPUS_PER_HOST:
            fail(h.where, f"host {h.name}: {h.gpus} GPUs, expected 1 to {MAX_GPUS_PER_HOST}")
        total += h.gpus
    nodes = total + len(hosts) + len({h.domain for h in hosts}) + len({h.rack for h in hosts})
    cap = caps.MAX_NODES  # read at each call, as the loader does
    if nodes > cap:
        fail(
            hosts[-1].where,
            f"the cluster would have {nodes} nodes ({total} GPUs on {len(hosts)} hosts, "
            f"domains, racks): more than the {cap} an instance file may hold",
        )


def _powers(
    hosts: list[Host], smi: dict[str, SmiHost], power: PowerDefault | None, warn: Warn
) -> dict[str, _Power]:
    """Each host's limits for GPUs without their own XML readings; refuses unknown power."""
    out: dict[str, _Power] = {}
    unknown: list[tuple[Host, str]] = []
    for h in hosts:
        data = smi.get(h.name)
        p, why = _host_power(h, data.gpus if data is not None else [], power)
        if p is None:
            unknown.append((h, why))
        else:
            out[h.name] = p
    if unknown:
        h, why = unknown[0]
        more = f" (and {len(unknown) - 1} more host(s))" if len(unknown) > 1 else ""
        fail(
            h.where,
            f"host {h.name}: the power of its GPUs is not known: {why}{more}; give "
            "--nvidia-smi output for it, or --tdp-w W (and --max-power-w W) to state "
            "the power of GPUs of unknown product",
        )
    if power is not None:
        used = [n for n, p in out.items() if p.source == "--tdp-w"]
        if used:
            boost = (
                f"--max-power-w {power.max_power_w:g} W"
                if power.max_power_w is not None
                else "no boost (no --max-power-w)"
            )
            warn(
                f"--tdp-w {power.tdp_w:g} W applies to the GPUs of {len(used)} host(s) "
                f"of unknown product ({', '.join(used[:3])}{' ...' if len(used) > 3 else ''}), "
                f"{boost}; their racks' budgets count it"
            )
        else:
            warn(
                "--tdp-w / --max-power-w unused: the power of every GPU is known from "
                "nvidia-smi or the hardware table"
            )
    return out
