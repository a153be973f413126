"""Kubernetes: hosts, NVLink domains and health from ``kubectl get nodes -o json``.

Read per Node object (``metadata``, ``spec``, ``status`` of the Kubernetes Node
API; labels as NVIDIA's GPU operator / GPU feature discovery sets them):

* GPU count: ``status.capacity["nvidia.com/gpu"]`` and the label
  ``nvidia.com/gpu.count``; when both are present they must agree (with
  time-slicing, capacity = count x ``nvidia.com/gpu.replicas``). Nodes with
  neither are not GPU nodes and are left out. ``status.allocatable`` below
  capacity (the device plugin saw unhealthy GPUs) gets a warning.
* Product: label ``nvidia.com/gpu.product`` (hardware defaults without XML).
* NVLink domain: label ``nvidia.com/gpu.clique`` (``<cluster UUID>.<clique id>``,
  the NVLink partition of multi-node NVLink systems such as GB200 NVL72). A node
  without it is its own domain, ``<node>/nvlink`` (DGX/HGX H100: NVLink inside
  the node only).
* Rack: the label named by ``rack_label``, else ``topology.kubernetes.io/zone``,
  else one rack per domain (``<domain>/rack``).
* Failed tray: condition ``Ready`` not ``True`` (or missing), ``spec.unschedulable``
  (cordoned), or a ``NoSchedule``/``NoExecute`` taint whose key the job does not
  tolerate (``nvidia.com/gpu`` is tolerated by default: GPU nodes commonly carry
  it to keep other pods off).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import networkx as nx

from ntp_opt.app.importers.compose import Host, SmiHost, Warn, compose_cluster, fail
from ntp_opt.model.files import read_json

__all__ = ["DEFAULT_TOLERATED", "import_k8s", "read_nodes"]

#: Taint keys tolerated by default (the usual dedicated-GPU-node taint).
DEFAULT_TOLERATED: tuple[str, ...] = ("nvidia.com/gpu",)
_CLIQUE = re.compile(r"^[^.\s]+\.[0-9]+$")


def _label_path(i: int, key: str) -> str:
    return f'items[{i}].metadata.labels["{key}"]'


def _int(value: Any, src: str, path: str) -> int:
    if isinstance(value, bool):
        fail(src, f"expected a GPU count, got {value!r}", path)
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and value.strip().isdigit():
        n = int(value)
    else:
        fail(src, f"expected a GPU count, got {value!r}", path)
    if n < 0 or n > 4096:
        fail(src, f"GPU count {n} out of range", path)
    return n


def _obj(value: Any, src: str, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        fail(src, f"expected an object, got {type(value).__name__}", path)
    return value


def read_nodes(
    path: str | Path,
    *,
    rack_label: str | None = None,
    tolerate: tuple[str, ...] = DEFAULT_TOLERATED,
    warn: Warn,
    left_out: set[str] | None = None,
) -> list[Host]:
    """The GPU nodes of a ``kubectl get nodes -o json`` file as :class:`Host` records.

    Parameters
    ----------
    path : str or Path
        ``kubectl get nodes -o json`` output (a ``List``/``NodeList``, or one ``Node``).
    rack_label : str, optional
        Node label naming the rack (default: ``topology.kubernetes.io/zone``).
    tolerate : tuple of str
        Taint keys that do not make a node unusable.
    warn : callable
        Receives one message per warning.
    left_out : set of str, optional
        Receives the names of the nodes left out (no GPU).

    Returns
    -------
    list of Host
        The GPU nodes in file order.

    Raises
    ------
    ntp_opt.files.InputError
        ``FILE: JSON path: message`` for malformed JSON, a node without a name or
        listed twice, GPU counts that disagree, a malformed clique label, or a
        missing ``rack_label``.
    """
    src = str(Path(path))
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    skipped = 0
    for i, item in enumerate(_items(read_json(Path(path)), src)):
        host = _node(i, item, src, seen, rack_label, tolerate, warn)
        if isinstance(host, str):
            skipped += 1
            if left_out is not None:
                left_out.add(host)
        else:
            hosts.append(host)
    if not hosts:
        fail(
            src, "no GPU node (none has status.capacity['nvidia.com/gpu'] or nvidia.com/gpu.count)"
        )
    if skipped:
        warn(f"{src}: {skipped} node(s) without GPUs left out")
    return hosts


def _items(data: Any, src: str) -> list[Any]:
    """The node objects of a ``NodeList``/``List``, or of a single ``Node``."""
    if isinstance(data, dict) and data.get("kind") == "Node":
        items: Any = [data]
    elif isinstance(data, dict) and "items" in data:
        items = data["items"]
    else:
        fail(src, "expected a NodeList or List (kubectl get nodes -o json) with 'items'")
    if not isinstance(items, list):
        fail(src, "expected a list", "items")
    return items


def _node(
    i: int,
    item: Any,
    src: str,
    seen: dict[str, int],
    rack_label: str | None,
    tolerate: tuple[str, ...],
    warn: Warn,
) -> Host | str:
    """Node ``items[i]`` as a :class:`Host`, or its name when it has no GPU."""
    base = f"items[{i}]"
    item = _obj(item, src, base)
    meta = _obj(item.get("metadata"), src, f"{base}.metadata")
    spec = _obj(item.get("spec"), src, f"{base}.spec")
    status = _obj(item.get("status"), src, f"{base}.status")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        fail(src, "node without a name", f"{base}.metadata.name")
    if name in seen:
        fail(src, f"node {name} listed twice (first at items[{seen[name]}])", base)
    seen[name] = i
    labels = _obj(meta.get("labels"), src, f"{base}.metadata.labels")
    capacity = _obj(status.get("capacity"), src, f"{base}.status.capacity")
    allocatable = _obj(status.get("allocatable"), src, f"{base}.status.allocatable")
    cap, gpus = _gpu_count(i, name, labels, capacity, src)
    if not gpus:
        return name
    if "nvidia.com/gpu" in allocatable and cap is not None:
        alloc = _int(
            allocatable["nvidia.com/gpu"], src, f'{base}.status.allocatable["nvidia.com/gpu"]'
        )
        if alloc < cap:
            warn(
                f"{src}: {base}: node {name} has {alloc} of {cap} GPUs allocatable: the "
                "device plugin reports unhealthy GPUs; give --nvidia-smi output to mark "
                "which ones failed"
            )
    clique = labels.get("nvidia.com/gpu.clique")
    if clique is not None:
        if not isinstance(clique, str) or not _CLIQUE.match(clique):
            fail(
                src,
                f"expected '<cluster UUID>.<clique id>', got {clique!r}",
                _label_path(i, "nvidia.com/gpu.clique"),
            )
        domain = clique
    else:
        domain = f"{name}/nvlink"
    if rack_label is not None:
        rack = labels.get(rack_label)
        if not isinstance(rack, str) or not rack:
            fail(src, f"node {name} has no rack label {rack_label!r}", _label_path(i, rack_label))
    else:
        zone = labels.get("topology.kubernetes.io/zone")
        rack = zone if isinstance(zone, str) and zone else f"{domain}/rack"
    product = labels.get("nvidia.com/gpu.product")
    return Host(
        name=name,
        gpus=gpus,
        domain=domain,
        rack=rack,
        where=f"{src}: {base}",
        failed_reason=", ".join(_unusable(spec, status, tolerate, src, base)) or None,
        product=product if isinstance(product, str) else None,
        fabric_domain=clique,
    )


def _gpu_count(
    i: int, name: str, labels: dict[str, Any], capacity: dict[str, Any], src: str
) -> tuple[int | None, int | None]:
    """``status.capacity``'s GPU count (or None) and the node's GPU count (None: no GPU figure)."""
    cap_path = f'items[{i}].status.capacity["nvidia.com/gpu"]'
    cap = _int(capacity["nvidia.com/gpu"], src, cap_path) if "nvidia.com/gpu" in capacity else None
    lab = (
        _int(labels["nvidia.com/gpu.count"], src, _label_path(i, "nvidia.com/gpu.count"))
        if "nvidia.com/gpu.count" in labels
        else None
    )
    if cap is not None and lab is not None and cap != lab:
        rep = labels.get("nvidia.com/gpu.replicas")
        reps = int(rep) if isinstance(rep, str) and rep.isdigit() else 1
        if cap != lab * reps:
            fail(
                src,
                f"node {name}: {cap} GPUs in status.capacity but the label "
                f"nvidia.com/gpu.count says {lab}",
                cap_path,
            )
    return cap, lab if lab is not None else cap


def _unusable(
    spec: dict[str, Any], status: dict[str, Any], tolerate: tuple[str, ...], src: str, base: str
) -> list[str]:
    """Why the node cannot run work: not Ready, cordoned, tainted (empty: usable)."""
    reasons: list[str] = []
    conds = status.get("conditions") or []
    if not isinstance(conds, list):
        fail(src, "expected a list", f"{base}.status.conditions")
    ready = [c for c in conds if isinstance(c, dict) and c.get("type") == "Ready"]
    if not ready:
        reasons.append("without a Ready condition")
    elif ready[0].get("status") != "True":
        reasons.append(f"NotReady (Ready={ready[0].get('status')})")
    if spec.get("unschedulable") is True:
        reasons.append("cordoned (spec.unschedulable)")
    taints = spec.get("taints") or []
    if not isinstance(taints, list):
        fail(src, "expected a list", f"{base}.spec.taints")
    for t in taints:
        if not isinstance(t, dict):
            continue
        if t.get("effect") in ("NoSchedule", "NoExecute") and t.get("key") not in tolerate:
            if t.get("key") == "node.kubernetes.io/unschedulable" and spec.get("unschedulable"):
                continue
            val = f"={t['value']}" if t.get("value") else ""
            reasons.append(f"tainted {t.get('key')}{val}:{t.get('effect')}")
    return reasons


def import_k8s(
    nodes: str | Path,
    *,
    nvidia_smi: str | Path | None = None,
    rack_label: str | None = None,
    tolerate: tuple[str, ...] = DEFAULT_TOLERATED,
    name: str = "k8s",
    warn: Warn,
) -> nx.Graph:
    """Build a cluster graph from ``kubectl get nodes -o json`` (and nvidia-smi output).

    Parameters
    ----------
    nodes : str or Path
        ``kubectl get nodes -o json`` output.
    nvidia_smi : str or Path, optional
        Directory of ``<node>.xml`` files (``nvidia-smi -q -x`` per node).
    rack_label : str, optional
        Node label giving the rack (default ``topology.kubernetes.io/zone``).
    tolerate : tuple of str
        Taint keys that do not make a node unusable.
    name : str
        Cluster name.
    warn : callable
        Receives one message per warning.

    Returns
    -------
    networkx.Graph

    Raises
    ------
    ntp_opt.files.InputError
        For every malformed or inconsistent source (see ``docs/import.md``).
    """
    from ntp_opt.app.importers.nvidia_smi import read_dir

    outside: set[str] = set()
    hosts = read_nodes(nodes, rack_label=rack_label, tolerate=tolerate, warn=warn, left_out=outside)
    smi: dict[str, SmiHost] | None = None
    if nvidia_smi is not None:
        smi = read_dir(nvidia_smi, hosts, warn=warn, left_out=frozenset(outside))
    return compose_cluster(hosts, smi, name=name, warn=warn)
