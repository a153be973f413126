"""Slurm: NVLink domains from the topology/block plugin, hosts from ``scontrol show node``.

Formats read (Slurm's man pages ``topology.yaml(5)``, ``topology.conf(5)``, ``scontrol(1)``):

* ``topology.yaml``: a list of topologies; the one with a ``block`` section
  (``block_sizes``, ``blocks: [{block: NAME, nodes: HOSTLIST}, ...]``) is used.
  With several block topologies, the one marked ``cluster_default: true``, or
  the one named by ``topology_name``.
* ``topology.conf`` (topology/block): one ``BlockName=NAME Nodes=HOSTLIST``
  line per block, optionally ``BlockSizes=...``; parameter names are case
  insensitive, ``#`` starts a comment, a trailing backslash continues a line.
  ``SwitchName=`` lines (topology/tree) describe switches, not NVLink domains,
  and are refused.
* ``scontrol show node --oneliner`` (or the multi-line form): per node
  ``NodeName``, ``NodeHostName``, ``Gres`` (``gpu:4``, ``gpu:h100:8``,
  ``gpu:8(S:0-1)``, several comma-separated entries), ``State`` (``IDLE``,
  ``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``, ...) and ``Reason``.

Mapping: one block = one NVLink domain = one rack (``<block>/rack``: on GB200
NVL72 a rack is one domain). A host whose state contains DOWN, DRAIN (also
DRAINED/DRAINING), FAIL (also FAILING), NOT_RESPONDING, ERROR, FUTURE,
UNKNOWN, INVAL or REBOOT_ISSUED, or ends in ``*`` (not responding), is a failed tray.
A drained host whose reason mentions a GPU (``gpu``, ``xid``, ``ecc``,
``nvlink``) gets a warning: the whole tray is out although one GPU may be bad.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx

from ntp_opt.app.importers.compose import (
    Host,
    PowerDefault,
    SmiHost,
    Warn,
    compose_cluster,
    fail,
)
from ntp_opt.app.importers.hostlist import HostlistError, expand

__all__ = ["Block", "SlurmNode", "import_slurm", "read_nodes", "read_topology"]

MAX_INPUT_BYTES = 256 * 1024**2

FAILED_STATES = frozenset(
    {
        "DOWN",
        "DRAIN",
        "DRAINED",
        "DRAINING",
        "FAIL",
        "FAILING",
        "NOT_RESPONDING",
        "ERROR",
        "FUTURE",
        "UNKNOWN",
        "INVAL",
        "REBOOT_ISSUED",
    }
)
_GPU_REASON = re.compile(r"gpu|xid|ecc|nvlink|remap|retired", re.IGNORECASE)


@dataclass
class Block:
    """One topology/block block: an NVLink domain."""

    name: str
    hosts: list[str]
    where: str


@dataclass
class SlurmNode:
    """One node of ``scontrol show node``."""

    name: str
    hostname: str | None
    gpus: int
    gpu_type: str | None
    state: str
    reason: str
    where: str


def _read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_INPUT_BYTES:
            fail(str(path), f"file is {size} bytes, more than {MAX_INPUT_BYTES}")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        fail(str(path), f"not UTF-8 text: {err.reason}")
    except OSError as err:
        fail(str(path), f"cannot read file: {err.strerror}")


def _hosts(expr: Any, where: str) -> list[str]:
    try:
        return expand(expr)
    except HostlistError as err:
        fail(where, f"bad hostlist: {err}")


# --- topology.yaml ------------------------------------------------------------


def _yaml_topology(path: Path, text: str, topology_name: str | None) -> list[Block]:
    try:
        import yaml
    except ImportError:  # pragma: no cover - the [import] extra
        raise ValueError(
            "reading topology.yaml needs PyYAML: pip install 'ntp-opt[import]'"
        ) from None

    src = str(path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        loc = f"{src}:{mark.line + 1}" if mark is not None else src
        fail(loc, f"malformed YAML: {getattr(err, 'problem', None) or err}")

    def at(node: Any) -> str:
        return f"{src}:{node.start_mark.line + 1}"

    def mapping(node: Any, what: str) -> dict[str, Any]:
        if not isinstance(node, yaml.MappingNode):
            fail(at(node) if node is not None else src, f"{what} must be a mapping")
        out: dict[str, Any] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                fail(at(k), f"{what}: keys must be strings")
            out[k.value] = v
        return out

    if root is None or not isinstance(root, yaml.SequenceNode):
        fail(src if root is None else at(root), "expected a list of topologies")
    candidates: list[tuple[str, bool, Any, Any]] = []
    for item in root.value:
        topo = mapping(item, "topology")
        name_node = topo.get("topology")
        tname = name_node.value if isinstance(name_node, yaml.ScalarNode) else "?"
        if "block" in topo:
            default = topo.get("cluster_default")
            is_default = isinstance(default, yaml.ScalarNode) and default.value.lower() == "true"
            candidates.append((tname, is_default, topo["block"], item))
    if not candidates:
        fail(at(root), "no topology with a 'block' section (topology/block gives NVLink domains)")
    if topology_name is not None:
        chosen = [c for c in candidates if c[0] == topology_name]
        if not chosen:
            names = ", ".join(c[0] for c in candidates)
            fail(src, f"no block topology named {topology_name!r} (block topologies: {names})")
    elif len(candidates) > 1:
        chosen = [c for c in candidates if c[1]]
        if len(chosen) != 1:
            names = ", ".join(c[0] for c in candidates)
            fail(
                src,
                f"several block topologies ({names}) and none is cluster_default: "
                "choose one with --topology-name",
            )
    else:
        chosen = candidates
    block = mapping(chosen[0][2], "block")
    blocks_node = block.get("blocks")
    if not isinstance(blocks_node, yaml.SequenceNode):
        fail(at(chosen[0][2]), "block: 'blocks' must be a list")
    out: list[Block] = []
    for b in blocks_node.value:
        bm = mapping(b, "block entry")
        name_node = bm.get("block")
        if not isinstance(name_node, yaml.ScalarNode) or not name_node.value:
            fail(at(b), "block entry without a 'block' name")
        nodes = bm.get("nodes")
        if nodes is None or (isinstance(nodes, yaml.ScalarNode) and not nodes.value.strip()):
            fail(at(b), f"block {name_node.value!r} is empty (no nodes)")
        if isinstance(nodes, yaml.SequenceNode):
            hosts: list[str] = []
            for n in nodes.value:
                if not isinstance(n, yaml.ScalarNode):
                    fail(at(n), "nodes: expected hostlist strings")
                hosts += _hosts(n.value, at(n))
        elif isinstance(nodes, yaml.ScalarNode):
            hosts = _hosts(nodes.value, at(nodes))
        else:
            fail(at(nodes), "nodes: expected a hostlist string")
        out.append(Block(str(name_node.value), hosts, at(b)))
    return out


# --- topology.conf ------------------------------------------------------------


def _conf_lines(text: str) -> list[tuple[int, str]]:
    """Logical lines (comments stripped, continuations joined) with their first line number."""
    out: list[tuple[int, str]] = []
    buf = ""
    start = 0
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not buf:
            start = no
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            out.append((start, buf.strip()))
        buf = ""
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def _conf_topology(path: Path, text: str) -> list[Block]:
    src = str(path)
    out: list[Block] = []
    for no, line in _conf_lines(text):
        where = f"{src}:{no}"
        pairs: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if not sep:
                fail(where, f"expected Key=Value, got {token!r}")
            k = key.lower()
            if k in pairs:
                fail(where, f"{key} given twice")
            pairs[k] = value
        if "switchname" in pairs:
            fail(
                where,
                "SwitchName= is the topology/tree form (switches, not NVLink domains); "
                "ntp-opt reads topology/block (BlockName=... Nodes=...)",
            )
        if "blockname" in pairs:
            unknown = set(pairs) - {"blockname", "nodes"}
            if unknown:
                fail(where, f"unknown parameter(s) on a block line: {', '.join(sorted(unknown))}")
            name = pairs["blockname"]
            if not name:
                fail(where, "BlockName= is empty")
            if not pairs.get("nodes"):
                fail(where, f"block {name!r} is empty (no Nodes=)")
            out.append(Block(name, _hosts(pairs["nodes"], where), where))
        elif set(pairs) == {"blocksizes"}:
            continue
        else:
            fail(
                where, f"unknown line (expected BlockName=... Nodes=... or BlockSizes=...): {line}"
            )
    if not out:
        fail(src, "no BlockName= line: no NVLink domain is described")
    return out


def read_topology(path: str | Path, *, topology_name: str | None = None) -> list[Block]:
    """Read the blocks of a ``topology.yaml`` or ``topology.conf`` file.

    Parameters
    ----------
    path : str or Path
        ``*.yaml`` / ``*.yml`` are read as ``topology.yaml(5)``, anything else as
        ``topology.conf(5)``.
    topology_name : str, optional
        Which block topology of a YAML file to use when it has several.

    Returns
    -------
    list of Block
        In file order. A host may appear in one block only.

    Raises
    ------
    ntp_opt.files.InputError
        ``FILE:LINE: message`` for malformed files, bad hostlists, empty blocks,
        duplicate block names and hosts in two blocks.
    """
    p = Path(path)
    text = _read_text(p)
    if p.suffix.lower() in (".yaml", ".yml"):
        blocks = _yaml_topology(p, text, topology_name)
    else:
        blocks = _conf_topology(p, text)
    names: dict[str, Block] = {}
    owner: dict[str, Block] = {}
    for b in blocks:
        if b.name in names:
            fail(b.where, f"block {b.name!r} defined twice (first at {names[b.name].where})")
        names[b.name] = b
        for h in b.hosts:
            if h in owner:
                other = owner[h]
                if other is b:
                    fail(b.where, f"host {h} is listed twice in block {b.name!r}")
                fail(
                    b.where,
                    f"host {h} of block {b.name!r} is also in block {other.name!r} ({other.where})",
                )
            owner[h] = b
    return blocks


# --- scontrol show node -------------------------------------------------------

_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_]*)=")
# Keys printed after Reason= (whose value is free text): scontrol's node printer order.
_AFTER_REASON = frozenset({"Comment", "Extra", "InstanceId", "InstanceType", "ReservationName"})


def _fields(record: str) -> dict[str, str]:
    out: dict[str, str] = {}
    matches = list(_KEY.finditer(record))
    keep: list[re.Match[str]] = []
    in_reason = False
    for m in matches:
        key = m.group(1)
        if in_reason and key not in _AFTER_REASON:
            continue
        keep.append(m)
        if key == "Reason":
            in_reason = True
    for i, m in enumerate(keep):
        end = keep[i + 1].start() if i + 1 < len(keep) else len(record)
        out.setdefault(m.group(1), record[m.end() : end].strip())
    return out


def _split_gres(value: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    cur = ""
    for ch in value:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in parts if p]


def parse_gres(value: str, where: str) -> tuple[int, str | None]:
    """GPU count and type of a ``Gres=`` value.

    Parameters
    ----------
    value : str
        The value, e.g. ``gpu:4``, ``gpu:h100:8(S:0-1)``, ``gpu:a:4,nic:1`` or ``(null)``.
    where : str
        ``FILE:LINE`` for error messages.

    Returns
    -------
    tuple of (int, str or None)
        The number of GPUs (summed over ``gpu`` entries) and the last GPU type named.

    Raises
    ------
    ntp_opt.files.InputError
        On a malformed ``gpu`` entry (``gpu::4``).
    """
    total = 0
    gpu_type: str | None = None
    if value in ("", "(null)"):
        return 0, None
    for entry in _split_gres(value):
        core = entry.split("(", 1)[0]
        fields = core.split(":")
        if fields[0] != "gpu":
            continue
        count = 1
        if len(fields) >= 2 and fields[-1].isdigit():
            count = int(fields[-1])
            tfields = fields[1:-1]
        else:
            tfields = fields[1:]
        if any(not f for f in tfields) or len(tfields) > 1:
            fail(where, f"malformed Gres entry {entry!r}")
        if tfields:
            gpu_type = tfields[0]
        total += count
    return total, gpu_type


def read_nodes(path: str | Path) -> list[SlurmNode]:
    """Read ``scontrol show node --oneliner`` output (the multi-line form is accepted too).

    Parameters
    ----------
    path : str or Path
        The saved output.

    Returns
    -------
    list of SlurmNode
        In file order, each with its ``FILE:LINE``.

    Raises
    ------
    ntp_opt.files.InputError
        ``FILE:LINE: message`` for lines that are not node records, a node without
        ``State=``, a malformed ``Gres=``, or a node listed twice.
    """
    p = Path(path)
    src = str(p)
    text = _read_text(p)
    records: list[tuple[int, str]] = []
    for no, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if raw[:1].isspace() and records:
            records[-1] = (records[-1][0], records[-1][1] + " " + raw.strip())
        elif raw.startswith("NodeName="):
            records.append((no, raw.strip()))
        else:
            fail(f"{src}:{no}", f"expected a NodeName=... record, got {raw.strip()[:60]!r}")
    if not records:
        fail(src, "no NodeName= record")
    out: list[SlurmNode] = []
    seen: dict[str, str] = {}
    for no, rec in records:
        where = f"{src}:{no}"
        f = _fields(rec)
        name = f.get("NodeName", "")
        if not name or " " in name:
            fail(where, f"bad NodeName {name!r}")
        if name in seen:
            fail(where, f"node {name} listed twice (first at {seen[name]})")
        seen[name] = where
        if "State" not in f or not f["State"]:
            fail(where, f"node {name} has no State=")
        gpus, gpu_type = parse_gres(f.get("Gres", "(null)"), where)
        hostname = f.get("NodeHostName") or None
        out.append(
            SlurmNode(name, hostname, gpus, gpu_type, f["State"], f.get("Reason", ""), where)
        )
    return out


def _failed_state(state: str) -> str | None:
    """Why a node state makes the tray unusable, or ``None``."""
    s = state.strip().upper()
    parts = [x for x in re.split(r"\+", s) if x]
    flags = set()
    for part in parts:
        if part.endswith("*"):
            flags.add("NOT_RESPONDING")
        flags.add(part.rstrip("*~#$@^-!%"))
    bad = sorted(flags & FAILED_STATES)
    return "+".join(bad) if bad else None


def import_slurm(
    topology: str | Path,
    nodes: str | Path,
    *,
    nvidia_smi: str | Path | None = None,
    name: str = "slurm",
    warn: Warn,
    topology_name: str | None = None,
    power: PowerDefault | None = None,
) -> nx.Graph:
    """Build a cluster graph from Slurm's topology and node state (and nvidia-smi output).

    Parameters
    ----------
    topology : str or Path
        ``topology.yaml`` or ``topology.conf`` (topology/block).
    nodes : str or Path
        ``scontrol show node --oneliner`` output.
    nvidia_smi : str or Path, optional
        Directory of ``<host>.xml`` files (``nvidia-smi -q -x`` per host).
    name : str
        Cluster name.
    warn : callable
        Receives one message per warning.
    topology_name : str, optional
        Block topology to use in a YAML file with several.
    power : PowerDefault, optional
        Power of GPUs of unknown product without XML (``--tdp-w``, ``--max-power-w``).

    Returns
    -------
    networkx.Graph

    Raises
    ------
    ntp_opt.files.InputError
        For every malformed or inconsistent source (see ``docs/import.md``).
    """
    from ntp_opt.app.importers.nvidia_smi import read_dir

    blocks = read_topology(topology, topology_name=topology_name)
    snodes = read_nodes(nodes)
    by_name = {n.name: n for n in snodes}
    in_blocks = {h for b in blocks for h in b.hosts}
    hosts: list[Host] = []
    for b in blocks:
        for h in b.hosts:
            node = by_name.get(h)
            if node is None:
                fail(b.where, f"unknown host {h} in block {b.name!r}: not in {nodes}")
            if node.gpus == 0:
                fail(node.where, f"host {h} of block {b.name!r} has no GPU in its Gres")
            why = _failed_state(node.state)
            if why and "DRAIN" in why and _GPU_REASON.search(node.reason):
                warn(
                    f"{node.where}: host {h} is drained for a GPU reason ({node.reason!r}): "
                    "the whole tray is marked failed; if one GPU is bad, remove it from the "
                    "node's Gres and resume the node to use the others"
                )
            hosts.append(
                Host(
                    name=h,
                    gpus=node.gpus,
                    domain=b.name,
                    rack=f"{b.name}/rack",
                    where=node.where,
                    failed_reason=f"{node.state} in Slurm" if why else None,
                    product=node.gpu_type,
                    aliases=(node.hostname,) if node.hostname and node.hostname != h else (),
                    domain_where=b.where,
                )
            )
    extra = [n.name for n in snodes if n.name not in in_blocks and n.gpus > 0]
    if extra:
        shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
        warn(f"{nodes}: {len(extra)} GPU node(s) in no topology block are left out: {shown}")
    smi: dict[str, SmiHost] | None = None
    if nvidia_smi is not None:
        outside = {n.name for n in snodes if n.name not in in_blocks}
        outside |= {n.hostname for n in snodes if n.name not in in_blocks and n.hostname}
        smi = read_dir(nvidia_smi, hosts, warn=warn, left_out=frozenset(outside))
    return compose_cluster(hosts, smi, name=name, warn=warn, power=power)
