"""Slurm's topology: NVLink blocks (topology/block) or leaf switches (topology/tree).

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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ntp_opt.app.importers.compose import fail
from ntp_opt.app.importers.hostlist import Budget, HostlistError, expand
from ntp_opt.app.importers.slurm_nodes import MAX_INPUT_BYTES, Source, read_text

__all__ = ["Block", "read_topology"]

#: Largest ``topology.yaml`` (a real one is kilobytes; PyYAML composes about 0.3 MB/s).
MAX_YAML_BYTES = 1024**2
#: Most YAML aliases (``*name``) in one ``topology.yaml``.
MAX_YAML_ALIASES = 100
#: Deepest YAML nesting (a topology.yaml nests 5 levels).
MAX_YAML_DEPTH = 64


@dataclass
class Block:
    """One NVLink block (topology/block) or one leaf switch (topology/tree)."""

    name: str
    hosts: list[str]
    where: str
    kind: str = "block"


def _hosts(expr: Any, where: str, budget: Budget) -> list[str]:
    try:
        return expand(expr, budget)
    except HostlistError as err:
        fail(where, f"bad hostlist: {err}")


# --- topology.yaml ------------------------------------------------------------


class _BoundedComposer:
    """Mixed into a ``yaml.SafeLoader``: counts aliases and nesting as nodes are composed."""

    src = ""
    aliases = 0
    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        """Compose one node, failing past :data:`MAX_YAML_ALIASES` or :data:`MAX_YAML_DEPTH`."""
        import yaml

        loader: Any = self
        mark = loader.peek_event().start_mark
        if loader.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                fail(f"{self.src}:{mark.line + 1}", f"more than {MAX_YAML_ALIASES} YAML aliases")
        self.depth += 1
        if self.depth > MAX_YAML_DEPTH:
            fail(f"{self.src}:{mark.line + 1}", f"YAML nested more than {MAX_YAML_DEPTH} deep")
        try:
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self.depth -= 1


def _compose_yaml(src: str, text: str) -> Any:
    """``yaml.compose`` with a SafeLoader that counts aliases and nesting as it goes."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - the [import] extra
        raise ValueError(
            "reading topology.yaml needs PyYAML: pip install 'ntp-opt[import]'"
        ) from None

    bounded = type("Bounded", (_BoundedComposer, yaml.SafeLoader), {"src": src})
    loader = bounded(text)
    try:
        return loader.get_single_node()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        loc = f"{src}:{mark.line + 1}" if mark is not None else src
        fail(loc, f"malformed YAML: {getattr(err, 'problem', None) or err}")
    finally:
        loader.dispose()


@dataclass(frozen=True)
class _Yaml:
    """Where a node of one ``topology.yaml`` is, and its checked mappings."""

    src: str
    budget: Budget

    def at(self, node: Any) -> str:
        """``FILE:LINE`` of ``node``."""
        return f"{self.src}:{node.start_mark.line + 1}"

    def mapping(self, node: Any, what: str) -> dict[str, Any]:
        """The keys of a mapping node (``what`` names it in errors)."""
        import yaml

        if not isinstance(node, yaml.MappingNode):
            fail(self.at(node) if node is not None else self.src, f"{what} must be a mapping")
        out: dict[str, Any] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                fail(self.at(k), f"{what}: keys must be strings")
            out[k.value] = v
        return out


def _yaml_tree(section: Any, y: _Yaml) -> list[Block]:
    """The leaf switches of a topology.yaml ``tree`` section (``switches: [{switch, children,
    nodes}]``)."""
    import yaml

    at, budget = y.at, y.budget
    tree = y.mapping(section, "tree")
    items = tree.get("switches")
    if not isinstance(items, yaml.SequenceNode):
        fail(at(section), "tree: 'switches' must be a list")
    switches: dict[str, tuple[str, list[str], list[str]]] = {}
    for item in items.value:
        sw = y.mapping(item, "switch entry")
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


def _yaml_choice(root: Any, y: _Yaml, topology_name: str | None) -> tuple[str, bool, Any, str]:
    """The topology to read: ``(name, cluster_default, section, "block" or "tree")``."""
    import yaml

    src = y.src
    if root is None or not isinstance(root, yaml.SequenceNode):
        fail(src if root is None else y.at(root), "expected a list of topologies")
    candidates: list[tuple[str, bool, Any, str]] = []
    for item in root.value:
        topo = y.mapping(item, "topology")
        name_node = topo.get("topology")
        tname = name_node.value if isinstance(name_node, yaml.ScalarNode) else "?"
        default = topo.get("cluster_default")
        is_default = isinstance(default, yaml.ScalarNode) and default.value.lower() == "true"
        for kind in ("block", "tree"):
            if kind in topo:
                candidates.append((tname, is_default, topo[kind], kind))
    if not candidates:
        fail(y.at(root), "no topology with a 'block' or 'tree' section")
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
    return chosen[0]


def _yaml_topology(src: str, text: str, topology_name: str | None) -> list[Block]:
    """The blocks (or leaf switches) of a ``topology.yaml``."""
    import yaml

    y = _Yaml(src, Budget())
    at, budget = y.at, y.budget
    chosen = _yaml_choice(_compose_yaml(src, text), y, topology_name)
    if chosen[3] == "tree":
        return _yaml_tree(chosen[2], y)
    block = y.mapping(chosen[2], "block")
    blocks_node = block.get("blocks")
    if not isinstance(blocks_node, yaml.SequenceNode):
        fail(at(chosen[2]), "block: 'blocks' must be a list")
    out: list[Block] = []
    for b in blocks_node.value:
        bm = y.mapping(b, "block entry")
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
    text, src = read_text(p, MAX_YAML_BYTES if yml else MAX_INPUT_BYTES)
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
