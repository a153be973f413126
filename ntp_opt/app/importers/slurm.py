"""Slurm: NVLink domains from topology/block or topology/tree, hosts from ``scontrol show node``.

The sources are read by :mod:`ntp_opt.app.importers.slurm_topology`
(``topology.yaml``, ``topology.conf``, ``scontrol show topology``) and
:mod:`ntp_opt.app.importers.slurm_nodes` (``scontrol show node``, node states,
running ``scontrol``); :func:`import_slurm` puts them together.

Mapping: one block = one NVLink domain = one rack (``<block>/rack``: on GB200
NVL72 a rack is one domain). A tree says nothing about NVLink: with
``nvlink="host"`` each host is its own domain (``<host>/nvlink``, HGX/DGX) and
its leaf switch is its rack; with ``nvlink="leaf"`` each leaf switch is one
domain and one rack (``<leaf>/rack``). Without a choice, hosts of 8 GPUs are
taken as HGX/DGX (``host``, with a warning); any other GPU count is refused.

Node states are classified by
:data:`~ntp_opt.app.importers.slurm_nodes.STATE_WORDS`: usable, unusable, or
unusable unless the user allows its kind
(:data:`~ntp_opt.app.importers.slurm_nodes.ALLOW_KINDS`); an unknown word is
unusable with a warning.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

import networkx as nx

from ntp_opt.app.importers.compose import (
    Host,
    PowerDefault,
    SmiHost,
    Warn,
    compose_cluster,
    fail,
)
from ntp_opt.app.importers.slurm_nodes import (
    ALLOW_KINDS,
    SlurmNode,
    Source,
    classify_state,
    read_nodes,
)
from ntp_opt.app.importers.slurm_topology import Block, read_topology
from ntp_opt.model.files import MAX_NODES

if TYPE_CHECKING:
    from ntp_opt.app.importers.nvidia_smi import XmlCache

__all__ = ["NVLINK_CHOICES", "import_slurm"]

#: ``--nvlink`` values for a tree topology.
NVLINK_CHOICES = ("host", "leaf")
_GPU_REASON = re.compile(r"gpu|xid|ecc|nvlink|remap|retired", re.IGNORECASE)


def _state_reason(node: SlurmNode, allow: Collection[str], warn: Warn) -> str | None:
    """Why ``node``'s GPUs are failed (``None``: usable); warns where the user should know."""
    v = classify_state(node.state, allow)
    if v.unknown:
        warn(
            f"{node.where}: host {node.name} has state {node.state!r} with word(s) "
            f"{', '.join(v.unknown)} this importer does not know: taken as unusable"
        )
    if v.usable:
        if v.why:
            warn(f"{node.where}: host {node.name} is {node.state}, counted usable: {v.why}")
        return None
    if "DRAIN" in node.state.upper() and _GPU_REASON.search(node.reason):
        warn(
            f"{node.where}: host {node.name} is drained for a GPU reason ({node.reason!r}): "
            "the whole tray is marked failed; if one GPU is bad, remove it from the "
            "node's Gres and resume the node to use the others"
        )
    hint = "".join(f"; --allow {k} if {ALLOW_KINDS[k]}" for k in v.allow)
    return f"{node.state} in Slurm ({v.why}{hint})"


def _tree_mode(
    leaves: list[Block], by_name: dict[str, SlurmNode], nvlink: str | None, warn: Warn
) -> str:
    """``host`` or ``leaf``: what an NVLink domain is on a tree topology."""
    if nvlink is not None:
        return nvlink
    counts: dict[int, str] = {}
    for b in leaves:
        for h in b.hosts:
            n = by_name.get(h)
            if n is not None and n.gpus:
                counts.setdefault(n.gpus, h)
    other = {g: h for g, h in counts.items() if g != 8}
    if other:
        g, h = next(iter(other.items()))
        fail(
            leaves[0].where,
            f"topology/tree says nothing about NVLink, and host {h} has {g} GPUs (not an "
            "8-GPU HGX/DGX host): give --nvlink host (NVLink inside each host) or --nvlink "
            "leaf (one NVLink domain per leaf switch, e.g. a GB200 NVL72 rack)",
        )
    warn(
        f"{leaves[0].where.rsplit(':', 1)[0]}: topology/tree: each 8-GPU host is taken as "
        "one NVLink domain (HGX/DGX) and its leaf switch as its rack; --nvlink leaf says "
        "otherwise"
    )
    return "host"


def import_slurm(
    topology: str | Path | Source,
    nodes: str | Path | Source,
    *,
    nvidia_smi: str | Path | None = None,
    nvidia_smi_cache: XmlCache | None = None,
    name: str = "slurm",
    warn: Warn,
    topology_name: str | None = None,
    nvlink: str | None = None,
    allow: Collection[str] = (),
    power: PowerDefault | None = None,
) -> nx.Graph:
    """Build a cluster graph from Slurm's topology and node state (and nvidia-smi output).

    Parameters
    ----------
    topology : str, Path or Source
        ``topology.yaml``, ``topology.conf`` (topology/block or topology/tree) or
        ``scontrol show topology`` output.
    nodes : str, Path or Source
        ``scontrol show node --oneliner`` output.
    nvidia_smi : str or Path, optional
        Directory of ``<host>.xml`` files (``nvidia-smi -q -x`` per host).
    nvidia_smi_cache : XmlCache, optional
        Keeps the parse of each file until it changes (``ntp-opt watch`` reads
        the directory every poll); see :class:`~ntp_opt.app.importers.nvidia_smi.XmlCache`.
    name : str
        Cluster name.
    warn : callable
        Receives one message per warning.
    topology_name : str, optional
        Block topology to use in a YAML file with several.
    nvlink : {"host", "leaf"}, optional
        On a tree topology: each host is an NVLink domain (its leaf switch its
        rack), or each leaf switch is one. Default: ``host`` when every GPU host
        has 8 GPUs, else an error. Refused with a block topology.
    allow : collection of str
        :data:`ALLOW_KINDS` of node state counted as usable.
    power : PowerDefault, optional
        Power of GPUs of unknown product without XML (``--tdp-w``, ``--max-power-w``).

    Returns
    -------
    networkx.Graph

    Raises
    ------
    ntp_opt.model.files.InputError
        For every malformed or inconsistent source (see ``docs/import.md``).
    """
    if nvlink is not None and nvlink not in NVLINK_CHOICES:
        raise ValueError(f"nvlink must be one of {', '.join(NVLINK_CHOICES)}, not {nvlink!r}")
    for k in allow:
        if k not in ALLOW_KINDS:
            raise ValueError(f"unknown --allow kind {k!r} (one of {', '.join(ALLOW_KINDS)})")
    blocks = read_topology(topology, topology_name=topology_name)
    snodes = read_nodes(nodes)
    nodes_src = nodes.name if isinstance(nodes, Source) else str(nodes)
    by_name = {n.name: n for n in snodes}
    tree = blocks[0].kind == "switch"
    if not tree and nvlink is not None:
        fail(blocks[0].where, "--nvlink is for topology/tree: each block is one NVLink domain")
    mode = _tree_mode(blocks, by_name, nvlink, warn) if tree else "block"
    hosts = _block_hosts(blocks, by_name, mode, nodes_src, allow, warn)
    _check_size(hosts, blocks, snodes, nodes_src, warn)
    smi = None
    if nvidia_smi is not None:
        smi = _read_smi(nvidia_smi, hosts, snodes, warn, nvidia_smi_cache)
    return compose_cluster(hosts, smi, name=name, warn=warn, power=power)


def _read_smi(
    nvidia_smi: str | Path,
    hosts: list[Host],
    snodes: list[SlurmNode],
    warn: Warn,
    cache: XmlCache | None,
) -> dict[str, SmiHost]:
    """The nvidia-smi files of ``hosts``; those of other Slurm nodes are skipped."""
    from ntp_opt.app.importers.nvidia_smi import read_dir

    used = {h.name for h in hosts}
    outside = {n.name for n in snodes if n.name not in used}
    outside |= {n.hostname for n in snodes if n.name not in used and n.hostname}
    return read_dir(nvidia_smi, hosts, warn=warn, left_out=frozenset(outside), cache=cache)


def _block_hosts(
    blocks: list[Block],
    by_name: dict[str, SlurmNode],
    mode: str,
    nodes_src: str,
    allow: Collection[str],
    warn: Warn,
) -> list[Host]:
    """The GPU hosts of ``blocks`` with their domain and rack (``mode``: block, host or leaf)."""
    tree = mode != "block"
    hosts: list[Host] = []
    for b in blocks:
        for h in b.hosts:
            node = by_name.get(h)
            if node is None:
                fail(
                    b.where,
                    f"unknown host {h} in {b.kind} {b.name!r}: not in {nodes_src} (FUTURE "
                    "nodes are listed by scontrol show node --future)",
                )
            if node.gpus == 0:
                if tree:  # a tree also connects CPU nodes; a block is for GPU nodes
                    continue
                fail(node.where, f"host {h} of block {b.name!r} has no GPU in its Gres")
            if mode == "host":
                domain, rack = f"{h}/nvlink", b.name
            else:
                domain, rack = b.name, f"{b.name}/rack"
            hosts.append(
                Host(
                    name=h,
                    gpus=node.gpus,
                    domain=domain,
                    rack=rack,
                    where=node.where,
                    failed_reason=_state_reason(node, allow, warn),
                    product=node.gpu_type,
                    aliases=(node.hostname,) if node.hostname and node.hostname != h else (),
                    domain_where=b.where,
                )
            )
    return hosts


def _check_size(
    hosts: list[Host], blocks: list[Block], snodes: list[SlurmNode], nodes_src: str, warn: Warn
) -> None:
    """Refuse no host or too many nodes; warn about GPU nodes in no block or leaf."""
    if not hosts:
        fail(blocks[0].where.rsplit(":", 1)[0], "no GPU host in the topology")
    size = sum(h.gpus for h in hosts) + len(hosts)
    size += len({h.domain for h in hosts}) + len({h.rack for h in hosts})
    if size > MAX_NODES:
        fail(
            nodes_src,
            f"the cluster would have {size} nodes (GPUs, hosts, domains, racks): more than "
            f"an instance may hold ({MAX_NODES})",
        )
    in_blocks = {h for b in blocks for h in b.hosts}
    extra = [n.name for n in snodes if n.name not in in_blocks and n.gpus > 0]
    if extra:
        shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
        what = "leaf switch" if blocks[0].kind == "switch" else "topology block"
        warn(f"{nodes_src}: {len(extra)} GPU node(s) in no {what} are left out: {shown}")
