"""Slurm: NVLink domains from topology/block or topology/tree, hosts from ``scontrol show node``.

Formats read (Slurm's man pages ``topology.yaml(5)``, ``topology.conf(5)``, ``scontrol(1)``):

* ``topology.yaml``: a list of topologies; the one with a ``block`` section
  (``block_sizes``, ``blocks: [{block: NAME, nodes: HOSTLIST}, ...]``) is used.
  With several block topologies, the one marked ``cluster_default: true``, or
  the one named by ``topology_name``; without a block topology, the ``tree``
  one (``switches: [{switch: NAME, nodes: HOSTLIST, children: LIST}]``).
  Parsed with caps on size, aliases and
  nesting (:data:`MAX_YAML_BYTES`, :data:`MAX_YAML_ALIASES`, :data:`MAX_YAML_DEPTH`).
* ``topology.conf`` and ``scontrol show topology`` output: ``BlockName=NAME
  Nodes=HOSTLIST`` lines (topology/block; ``BlockSizes=``, and the
  ``BlockIndex=``/``BlockSize=`` that scontrol prints, are ignored) or
  ``SwitchName=NAME Nodes=HOSTLIST`` / ``SwitchName=NAME Switches=LIST`` lines
  (topology/tree; ``Level=``/``LinkSpeed=`` ignored); parameter names are case
  insensitive, ``#`` starts a comment, a trailing backslash continues a line.
* ``scontrol show node --oneliner`` (or the multi-line form): per node
  ``NodeName``, ``NodeHostName``, ``Gres`` (``gpu:4``, ``gpu:h100:8``,
  ``gpu:8(S:0-1)``, several comma-separated entries), ``State`` (``IDLE``,
  ``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``, ...) and ``Reason``.

Mapping: one block = one NVLink domain = one rack (``<block>/rack``: on GB200
NVL72 a rack is one domain). A tree says nothing about NVLink: with
``nvlink="host"`` each host is its own domain (``<host>/nvlink``, HGX/DGX) and
its leaf switch is its rack; with ``nvlink="leaf"`` each leaf switch is one
domain and one rack (``<leaf>/rack``). Without a choice, hosts of 8 GPUs are
taken as HGX/DGX (``host``, with a warning); any other GPU count is refused.

Node states are classified by :data:`STATE_WORDS` (every base state and flag
scontrol prints, Slurm 22.05 to 24.x, and sinfo's long names and suffixes):
usable, unusable, or unusable unless the user allows its kind
(:data:`ALLOW_KINDS`); an unknown word is unusable with a warning.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import subprocess
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from ntp_opt.app.importers.compose import (
    Host,
    PowerDefault,
    SmiHost,
    Warn,
    compose_cluster,
    fail,
)
from ntp_opt.app.importers.hostlist import Budget, HostlistError, expand
from ntp_opt.model.files import MAX_NODES

if TYPE_CHECKING:
    from ntp_opt.app.importers.nvidia_smi import XmlCache

__all__ = [
    "ALLOW_KINDS",
    "NVLINK_CHOICES",
    "STATE_WORDS",
    "Block",
    "SlurmNode",
    "Source",
    "StateVerdict",
    "classify_state",
    "import_slurm",
    "parse_gres",
    "read_nodes",
    "read_topology",
    "scontrol",
]

#: Largest text source read (a file, or one scontrol output).
MAX_INPUT_BYTES = 256 * 1024**2
#: Largest ``topology.yaml`` (a real one is kilobytes; PyYAML composes about 0.3 MB/s).
MAX_YAML_BYTES = 1024**2
#: Most YAML aliases (``*name``) in one ``topology.yaml``.
MAX_YAML_ALIASES = 100
#: Deepest YAML nesting (a topology.yaml nests 5 levels).
MAX_YAML_DEPTH = 64
#: Seconds a live ``scontrol`` may run.
SCONTROL_TIMEOUT_S = 120.0

USABLE = "usable"
UNUSABLE = "unusable"
#: Kinds of node state the user may count as usable (``--allow KIND``), and why one would.
ALLOW_KINDS: dict[str, str] = {
    "reserved": "the job will run in that reservation, or after it ends",
    "powered-down": "power saving boots the node when a job asks for it",
    "reboot": "the node comes back after its reboot",
}
#: ``--nvlink`` values for a tree topology.
NVLINK_CHOICES = ("host", "leaf")

#: Every node state word -> (usable / unusable / an ALLOW_KINDS key, meaning).
#: Base states and flags of ``scontrol show node`` (Slurm 22.05 to 24.x), then the
#: long names ``sinfo`` prints. The one table of docs/import.md says the same.
STATE_WORDS: dict[str, tuple[str, str]] = {
    # base states
    "IDLE": (USABLE, "no job runs on it"),
    "ALLOCATED": (USABLE, "jobs run on it"),
    "MIXED": (USABLE, "jobs run on part of it"),
    "DOWN": (UNUSABLE, "down"),
    "ERROR": (UNUSABLE, "in an error state"),
    "FUTURE": (UNUSABLE, "configured for the future, not in service"),
    "UNKNOWN": (UNUSABLE, "state not yet known to slurmctld"),
    # flags
    "BLOCKED": (USABLE, "blocked by another job's exclusive topology request"),
    "CLOUD": (USABLE, "a cloud node"),
    "COMPLETING": (USABLE, "jobs are completing"),
    "DRAIN": (UNUSABLE, "drained by an administrator"),
    "DYNAMIC_FUTURE": (UNUSABLE, "a dynamic node not yet registered"),
    "DYNAMIC_NORM": (USABLE, "a dynamic node"),
    "EXTERNAL": (UNUSABLE, "external to Slurm"),
    "FAIL": (UNUSABLE, "failed by an administrator"),
    "INVALID_REG": (
        UNUSABLE,
        "registered with fewer resources than configured (often a GPU missing)",
    ),
    "MAINTENANCE": ("reserved", "in a maintenance reservation"),
    "NOT_RESPONDING": (UNUSABLE, "not responding"),
    "PERFCTRS": (USABLE, "network performance counters in use"),
    "PLANNED": (USABLE, "planned by the backfill scheduler"),
    "POWER_DOWN": ("powered-down", "about to be powered down"),
    "POWER_DRAIN": (UNUSABLE, "drained and about to be powered down"),
    "POWERED_DOWN": ("powered-down", "powered down"),
    "POWERING_DOWN": ("powered-down", "powering down"),
    "POWERING_UP": ("powered-down", "powering up"),
    "POWER_UP": ("powered-down", "about to be powered up"),
    "REBOOT_ISSUED": (UNUSABLE, "rebooting"),
    "REBOOT_REQUESTED": ("reboot", "a reboot is requested"),
    "RESERVED": ("reserved", "in an advance reservation"),
    "RESUME": (USABLE, "resumed by an administrator"),
    # sinfo's long names
    "ALLOC": (USABLE, "jobs run on it"),
    "DRAINED": (UNUSABLE, "drained by an administrator"),
    "DRAINING": (UNUSABLE, "being drained by an administrator"),
    "FAILING": (UNUSABLE, "failing, by an administrator"),
    "INVAL": (UNUSABLE, "registered with fewer resources than configured (often a GPU missing)"),
    "MAINT": ("reserved", "in a maintenance reservation"),
    "NPC": (USABLE, "network performance counters in use"),
    "REBOOT": ("reboot", "a reboot is requested"),
}
#: sinfo's state suffixes -> the flag each stands for.
STATE_SUFFIXES = {
    "*": "NOT_RESPONDING",
    "~": "POWERED_DOWN",
    "#": "POWERING_UP",
    "!": "POWER_DOWN",
    "%": "POWERING_DOWN",
    "$": "MAINTENANCE",
    "@": "REBOOT_REQUESTED",
    "^": "REBOOT_ISSUED",
    "-": "PLANNED",
}
_GPU_REASON = re.compile(r"gpu|xid|ecc|nvlink|remap|retired", re.IGNORECASE)
_WORD = re.compile(r"[A-Z][A-Z_]*")


@dataclass(frozen=True)
class Source:
    """Text read from somewhere other than a file (``scontrol``'s output)."""

    text: str
    name: str


@dataclass
class Block:
    """One NVLink block (topology/block) or one leaf switch (topology/tree)."""

    name: str
    hosts: list[str]
    where: str
    kind: str = "block"


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


@dataclass(frozen=True)
class StateVerdict:
    """What a node state means for its GPUs.

    Attributes
    ----------
    usable : bool
        The GPUs may be planned on.
    why : str
        For an unusable state, the words that make it so and their meaning; for a
        usable one, the allowed words (empty when nothing was allowed).
    allow : tuple of str
        The :data:`ALLOW_KINDS` that would make the state usable (unusable states
        whose only obstacles are such kinds).
    unknown : tuple of str
        Words not in :data:`STATE_WORDS` (taken as unusable).
    """

    usable: bool
    why: str = ""
    allow: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()


def classify_state(state: str, allow: Collection[str] = ()) -> StateVerdict:
    """Classify a Slurm node state (``IDLE+DRAIN``, ``DOWN*``, ``mixed~`` ...).

    Parameters
    ----------
    state : str
        The ``State=`` value (words joined by ``+``, sinfo suffixes accepted, any case).
    allow : collection of str
        :data:`ALLOW_KINDS` the user counts as usable.

    Returns
    -------
    StateVerdict

    Examples
    --------
    >>> classify_state("IDLE+DRAIN").usable
    False
    >>> classify_state("IDLE+POWERED_DOWN", allow={"powered-down"}).usable
    True
    """
    words: list[str] = []
    for part in state.strip().upper().split("+"):
        if not part:
            continue  # "ALLOCATED+" (sinfo: allocated and completing)
        core = part.rstrip("".join(STATE_SUFFIXES))
        words.append(core or part)
        words += [STATE_SUFFIXES[c] for c in part[len(core) :] if core]
    bad: list[str] = []
    kinds: list[str] = []
    allowed: list[str] = []
    unknown: list[str] = []
    for w in dict.fromkeys(words):
        use, meaning = STATE_WORDS.get(w, ("", ""))
        if not use:
            unknown.append(w)
            bad.append(f"{w}: not a node state this importer knows")
        elif use == UNUSABLE:
            bad.append(f"{w}: {meaning}")
        elif use != USABLE:
            if use in allow:
                allowed.append(f"{w}: {meaning} (--allow {use})")
            else:
                kinds.append(use)
                bad.append(f"{w}: {meaning}")
    if not words:
        return StateVerdict(False, "empty state", (), ("",))
    if bad:
        only_kinds = len(bad) == len(kinds)
        return StateVerdict(
            False, "; ".join(bad), tuple(dict.fromkeys(kinds)) if only_kinds else (), tuple(unknown)
        )
    return StateVerdict(True, "; ".join(allowed))


# --- reading ------------------------------------------------------------------


def _read_text(path: Path | Source, limit: int = MAX_INPUT_BYTES) -> tuple[str, str]:
    """``(text, name)`` of a file or a :class:`Source`, refusing more than ``limit`` bytes."""
    if isinstance(path, Source):
        return path.text, path.name
    try:
        size = path.stat().st_size
        if size > limit:
            fail(str(path), f"file is {size} bytes, more than {limit}")
        chunks: list[bytes] = []
        total = 0
        with path.open("rb") as fh:  # in chunks: a pipe (<(scontrol ...)) has no size
            while chunk := fh.read(1 << 20):
                total += len(chunk)
                if total > limit:
                    fail(str(path), f"more than {limit} bytes")
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8"), str(path)
    except UnicodeDecodeError as err:
        fail(str(path), f"not UTF-8 text: {err.reason}")
    except OSError as err:
        fail(str(path), f"cannot read file: {err.strerror}")


def scontrol(*args: str, timeout: float = SCONTROL_TIMEOUT_S) -> Source:
    """Run the ``scontrol`` on ``PATH`` (``SLURM_CONF`` is honoured) and return its output.

    Parameters
    ----------
    *args : str
        Its arguments, e.g. ``"show", "node", "--oneliner"``.
    timeout : float
        Seconds before it is killed.

    Returns
    -------
    Source
        Its standard output, named ``scontrol ARGS``.

    Raises
    ------
    ntp_opt.model.files.InputError
        When scontrol is missing, exits non-zero (its first error line is quoted),
        runs longer than ``timeout`` or prints more than :data:`MAX_INPUT_BYTES`.
    """
    name = " ".join(("scontrol", *args))
    exe = shutil.which("scontrol")
    if exe is None:
        fail(name, "scontrol is not on PATH (--live runs it; or give saved files)")
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # scontrol itself retries for a minute
        fail(name, f"SLURM_CONF={conf} is not a file")
    try:
        proc = subprocess.Popen(
            [exe, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    except OSError as err:
        fail(name, f"cannot run {exe}: {err.strerror}")
    out, err_b = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    problem = ""
    with selectors.DefaultSelector() as sel:
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err_b)
        while sel.get_map() and not problem:
            left = deadline - time.monotonic()
            if left <= 0:
                problem = f"did not finish within {timeout:g} s"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf: bytearray = key.data
                buf += chunk
                if len(out) > MAX_INPUT_BYTES or len(err_b) > 1 << 20:
                    problem = f"printed more than {MAX_INPUT_BYTES} bytes"
    if problem:
        proc.kill()
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        problem = problem or f"did not finish within {timeout:g} s"
    finally:
        proc.stdout.close()
        proc.stderr.close()
    if problem:
        fail(name, problem)
    if code != 0:
        first = next((ln for ln in err_b.decode(errors="replace").splitlines() if ln.strip()), "")
        fail(name, f"exit status {code}" + (f": {first.strip()[:200]}" if first else ""))
    try:
        return Source(out.decode("utf-8"), name)
    except UnicodeDecodeError as err:
        fail(name, f"output is not UTF-8 text: {err.reason}")


def _hosts(expr: Any, where: str, budget: Budget) -> list[str]:
    try:
        return expand(expr, budget)
    except HostlistError as err:
        fail(where, f"bad hostlist: {err}")


# --- topology.yaml ------------------------------------------------------------


def _compose_yaml(src: str, text: str) -> Any:
    """``yaml.compose`` with a SafeLoader that counts aliases and nesting as it goes."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - the [import] extra
        raise ValueError(
            "reading topology.yaml needs PyYAML: pip install 'ntp-opt[import]'"
        ) from None

    class Bounded(yaml.SafeLoader):
        aliases = 0
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            mark = self.peek_event().start_mark
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_YAML_ALIASES:
                    fail(f"{src}:{mark.line + 1}", f"more than {MAX_YAML_ALIASES} YAML aliases")
            self.depth += 1
            if self.depth > MAX_YAML_DEPTH:
                fail(f"{src}:{mark.line + 1}", f"YAML nested more than {MAX_YAML_DEPTH} deep")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loader = Bounded(text)
    try:
        return loader.get_single_node()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        loc = f"{src}:{mark.line + 1}" if mark is not None else src
        fail(loc, f"malformed YAML: {getattr(err, 'problem', None) or err}")
    finally:
        loader.dispose()


def _yaml_tree(section: Any, mapping: Any, at: Any, budget: Budget) -> list[Block]:
    """The leaf switches of a topology.yaml ``tree`` section (``switches: [{switch, children,
    nodes}]``)."""
    import yaml

    tree = mapping(section, "tree")
    items = tree.get("switches")
    if not isinstance(items, yaml.SequenceNode):
        fail(at(section), "tree: 'switches' must be a list")
    switches: dict[str, tuple[str, list[str], list[str]]] = {}
    for item in items.value:
        sw = mapping(item, "switch entry")
        name_node = sw.get("switch")
        if not isinstance(name_node, yaml.ScalarNode) or not name_node.value:
            fail(at(item), "switch entry without a 'switch' name")
        name = str(name_node.value)
        if name in switches:
            fail(at(item), f"switch {name!r} defined twice (first at {switches[name][0]})")
        lists: dict[str, list[str]] = {}
        for key in ("nodes", "children"):
            node = sw.get(key)
            if node is None:
                lists[key] = []
            elif isinstance(node, yaml.ScalarNode):
                lists[key] = _hosts(node.value, at(node), budget) if node.value.strip() else []
            else:
                fail(at(node), f"{key}: expected a hostlist string")
        if not lists["nodes"] and not lists["children"]:
            fail(at(item), f"switch {name!r} has neither nodes nor children")
        switches[name] = (at(item), lists["nodes"], lists["children"])
    if not switches:
        fail(at(section), "tree: no switch")
    return _leaves(switches)


def _yaml_topology(src: str, text: str, topology_name: str | None) -> list[Block]:
    import yaml

    root = _compose_yaml(src, text)
    budget = Budget()

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
    candidates: list[tuple[str, bool, Any, str]] = []
    for item in root.value:
        topo = mapping(item, "topology")
        name_node = topo.get("topology")
        tname = name_node.value if isinstance(name_node, yaml.ScalarNode) else "?"
        default = topo.get("cluster_default")
        is_default = isinstance(default, yaml.ScalarNode) and default.value.lower() == "true"
        for kind in ("block", "tree"):
            if kind in topo:
                candidates.append((tname, is_default, topo[kind], kind))
    if not candidates:
        fail(at(root), "no topology with a 'block' or 'tree' section")
    if topology_name is not None:
        chosen = [c for c in candidates if c[0] == topology_name]
        if not chosen:
            names = ", ".join(c[0] for c in candidates)
            fail(src, f"no block or tree topology named {topology_name!r} (there are: {names})")
    else:  # blocks are NVLink domains: preferred to a tree (the scale-out fabric)
        kind = "block" if any(c[3] == "block" for c in candidates) else "tree"
        pool = [c for c in candidates if c[3] == kind]
        chosen = pool if len(pool) == 1 else [c for c in pool if c[1]]
        if len(chosen) != 1:
            names = ", ".join(c[0] for c in pool)
            fail(
                src,
                f"several {kind} topologies ({names}) and none is cluster_default: "
                "choose one with --topology-name",
            )
    if chosen[0][3] == "tree":
        return _yaml_tree(chosen[0][2], mapping, at, budget)
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
                hosts += _hosts(n.value, at(n), budget)
        elif isinstance(nodes, yaml.ScalarNode):
            hosts = _hosts(nodes.value, at(nodes), budget)
        else:
            fail(at(nodes), "nodes: expected a hostlist string")
        out.append(Block(str(name_node.value), hosts, at(b)))
    return out


# --- topology.conf / scontrol show topology -----------------------------------


def _conf_lines(text: str) -> Iterable[tuple[int, str]]:
    """Logical lines (comments stripped, continuations joined) with their first line number."""
    buf: list[str] = []
    start = 0
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not buf:
            start = no
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        joined = " ".join(buf).strip()
        if joined:
            yield start, joined
        buf = []
    joined = " ".join(buf).strip()
    if joined:
        yield start, joined


_BLOCK_KEYS = frozenset({"blockname", "nodes", "blockindex", "blocksize"})
_SWITCH_KEYS = frozenset({"switchname", "nodes", "switches", "level", "linkspeed"})


def _conf_topology(src: str, text: str) -> list[Block]:
    budget = Budget()
    blocks: list[Block] = []
    switches: dict[str, tuple[str, list[str], list[str]]] = {}  # name -> where, nodes, children
    for no, line in _conf_lines(text):
        where = f"{src}:{no}"
        pairs: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if not sep:
                fail(where, f"expected Key=Value, got {token[:60]!r}")
            k = key.lower()
            if k in pairs:
                fail(where, f"{key[:60]} given twice")
            pairs[k] = value
        if "blockname" in pairs or "switchname" in pairs:
            block = "blockname" in pairs
            keys, what = (_BLOCK_KEYS, "block") if block else (_SWITCH_KEYS, "switch")
            if switches if block else blocks:
                fail(where, "BlockName= and SwitchName= lines in one topology")
            unknown = set(pairs) - keys
            if unknown:
                shown = ", ".join(sorted(unknown))[:100]
                fail(where, f"unknown parameter(s) on a {what} line: {shown}")
            name = pairs["blockname" if block else "switchname"]
            if not name:
                fail(where, f"{'BlockName' if block else 'SwitchName'}= is empty")
            if block:
                if not pairs.get("nodes"):
                    fail(where, f"block {name!r} is empty (no Nodes=)")
                blocks.append(Block(name, _hosts(pairs["nodes"], where, budget), where))
                continue
            if name in switches:
                fail(where, f"switch {name!r} defined twice (first at {switches[name][0]})")
            if not pairs.get("nodes") and not pairs.get("switches"):
                fail(where, f"switch {name!r} has neither Nodes= nor Switches=")
            nodes = _hosts(pairs["nodes"], where, budget) if pairs.get("nodes") else []
            kids = _hosts(pairs["switches"], where, budget) if pairs.get("switches") else []
            switches[name] = (where, nodes, kids)
        elif set(pairs) == {"blocksizes"}:
            continue
        else:
            fail(
                where,
                f"unknown line (expected BlockName=... Nodes=..., SwitchName=... or "
                f"BlockSizes=...): {line[:80]}",
            )
    if blocks:
        return blocks
    if not switches:
        fail(src, "no BlockName= or SwitchName= line: no topology is described")
    return _leaves(switches)


def _leaves(switches: dict[str, tuple[str, list[str], list[str]]]) -> list[Block]:
    """The leaf switches of a tree and their hosts.

    A host belongs to the lowest switch that lists it: ``scontrol show topology``
    prints an upper switch with every node below it besides its ``Switches=``;
    ``topology.conf`` gives the leaves ``Nodes=``. Linear in the listings: the
    switches are numbered depth first (entry and exit), and "T is below S" is
    two comparisons.
    """
    parent: dict[str, str] = {}
    for name, (where, _, kids) in switches.items():
        for k in kids:
            if k not in switches:
                fail(where, f"switch {name!r} lists an undefined switch {k!r}")
            if k == name:
                fail(where, f"switch {name!r} is below itself")
            if parent.setdefault(k, name) != name:
                fail(where, f"switch {k!r} is below both {parent[k]!r} and {name!r}")
    tin: dict[str, int] = {}
    tout: dict[str, int] = {}
    clock = 0
    for root in (s for s in switches if s not in parent):
        tin[root] = clock = clock + 1
        stack = [(root, iter(switches[root][2]))]
        while stack:
            s, todo = stack[-1]
            nxt = next(todo, None)
            if nxt is None:
                tout[s] = clock = clock + 1
                stack.pop()
            elif nxt not in tin:
                tin[nxt] = clock = clock + 1
                stack.append((nxt, iter(switches[nxt][2])))
    for name, (where, _, _) in switches.items():
        if name not in tin:
            fail(where, f"switch {name!r} is below itself (a cycle of Switches=)")
    owner: dict[str, str] = {}
    line = {name: i for i, name in enumerate(switches)}
    for s in sorted(switches, key=tin.__getitem__, reverse=True):  # lower switches first
        where, nodes, _ = switches[s]
        for h in nodes:
            t = owner.setdefault(h, s)
            if t == s:
                continue
            if not (tin[s] < tin[t] and tout[t] < tout[s]):  # t is not below s
                a, b = sorted((s, t), key=line.__getitem__)  # report at the later line
                fail(switches[b][0], f"host {h} of switch {b!r} is also in switch {a!r} "
                     f"({switches[a][0]})")  # fmt: skip
    out: list[Block] = []
    for name, (where, nodes, _) in switches.items():
        own = [h for h in nodes if owner[h] == name]
        if own:
            out.append(Block(name, own, where, kind="switch"))
    return out


def read_topology(path: str | Path | Source, *, topology_name: str | None = None) -> list[Block]:
    """Read the blocks of a ``topology.yaml`` / ``topology.conf`` file or ``scontrol`` output.

    Parameters
    ----------
    path : str, Path or Source
        ``*.yaml`` / ``*.yml`` are read as ``topology.yaml(5)``, anything else
        (and ``scontrol show topology`` output) as ``topology.conf(5)``.
    topology_name : str, optional
        Which block topology of a YAML file to use when it has several.

    Returns
    -------
    list of Block
        In file order: blocks (``kind="block"``), or the leaf switches of a tree
        (``kind="switch"``). A host may appear in one block or leaf only.

    Raises
    ------
    ntp_opt.model.files.InputError
        ``FILE:LINE: message`` for malformed files, bad hostlists, empty blocks,
        duplicate block names and hosts in two blocks.
    """
    p = path if isinstance(path, Source) else Path(path)
    yml = isinstance(p, Path) and p.suffix.lower() in (".yaml", ".yml")
    text, src = _read_text(p, MAX_YAML_BYTES if yml else MAX_INPUT_BYTES)
    if yml:
        blocks = _yaml_topology(src, text, topology_name)
    else:
        blocks = _conf_topology(src, text)
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
                    fail(b.where, f"host {h} is listed twice in {b.kind} {b.name!r}")
                fail(
                    b.where,
                    f"host {h} of {b.kind} {b.name!r} is also in {other.kind} {other.name!r} "
                    f"({other.where})",
                )
            owner[h] = b
    return blocks


# --- scontrol show node -------------------------------------------------------

_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_]*)=")
# Keys printed after Reason= (whose value is free text): scontrol's node printer order.
_AFTER_REASON = frozenset({"Comment", "Extra", "InstanceId", "InstanceType", "ReservationName"})


def _fields(record: str) -> dict[str, str]:
    out: dict[str, str] = {}
    keep: list[re.Match[str]] = []
    in_reason = False
    for m in _KEY.finditer(record):
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
    start = 0
    for i, ch in enumerate(value):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(value[start:i])
            start = i + 1
    parts.append(value[start:])
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
    ntp_opt.model.files.InputError
        On a malformed ``gpu`` entry (``gpu::4``), or more GPUs than an instance
        may have nodes (:data:`ntp_opt.model.files.MAX_NODES`).
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
            digits = fields[-1]
            count = int(digits) if len(digits) <= 9 else MAX_NODES + 1
            tfields = fields[1:-1]
        else:
            tfields = fields[1:]
        if any(not f for f in tfields) or len(tfields) > 1:
            fail(where, f"malformed Gres entry {entry[:60]!r}")
        if tfields:
            gpu_type = tfields[0]
        total += count
        if total > MAX_NODES:
            fail(
                where,
                f"Gres {value[:60]!r} counts more GPUs than an instance may have nodes "
                f"({MAX_NODES})",
            )
    return total, gpu_type


def read_nodes(path: str | Path | Source) -> list[SlurmNode]:
    """Read ``scontrol show node --oneliner`` output (the multi-line form is accepted too).

    Parameters
    ----------
    path : str, Path or Source
        The saved output, or :func:`scontrol`'s.

    Returns
    -------
    list of SlurmNode
        In file order, each with its ``FILE:LINE``.

    Raises
    ------
    ntp_opt.model.files.InputError
        ``FILE:LINE: message`` for lines that are not node records, a node without
        ``State=``, a malformed ``Gres=``, or a node listed twice.
    """
    text, src = _read_text(path if isinstance(path, Source) else Path(path))
    records: list[tuple[int, list[str]]] = []
    for no, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if raw[:1].isspace() and records:
            records[-1][1].append(raw.strip())  # a list: joined once, linear in the input
        elif raw.startswith("NodeName="):
            records.append((no, [raw.strip()]))
        else:
            fail(f"{src}:{no}", f"expected a NodeName=... record, got {raw.strip()[:60]!r}")
    if not records:
        fail(src, "no NodeName= record")
    out: list[SlurmNode] = []
    seen: dict[str, str] = {}
    for no, parts in records:
        where = f"{src}:{no}"
        f = _fields(" ".join(parts))
        name = f.get("NodeName", "")
        if not name or " " in name or len(name) > 255:
            fail(where, f"bad NodeName {name[:60]!r}")
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


# --- the cluster --------------------------------------------------------------


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
    from ntp_opt.app.importers.nvidia_smi import read_dir

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
    in_blocks = {h for b in blocks for h in b.hosts}
    hosts: list[Host] = []
    cpu_only = 0
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
                    cpu_only += 1
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
    extra = [n.name for n in snodes if n.name not in in_blocks and n.gpus > 0]
    if extra:
        shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
        what = "leaf switch" if tree else "topology block"
        warn(f"{nodes_src}: {len(extra)} GPU node(s) in no {what} are left out: {shown}")
    smi: dict[str, SmiHost] | None = None
    if nvidia_smi is not None:
        used = {h.name for h in hosts}
        outside = {n.name for n in snodes if n.name not in used}
        outside |= {n.hostname for n in snodes if n.name not in used and n.hostname}
        smi = read_dir(
            nvidia_smi,
            hosts,
            warn=warn,
            left_out=frozenset(outside),
            cache=nvidia_smi_cache,
        )
    return compose_cluster(hosts, smi, name=name, warn=warn, power=power)
