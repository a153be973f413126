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
* Rack: the label named by ``rack_label``, else the first of
  :data:`RACK_LABELS` the GPU nodes carry, else one rack per NVLink domain
  (``<domain>/rack``: each domain budgeted at its own GPUs' power, the tightest
  choice). The zone label is never taken as a rack by default: a zone is a
  data hall or a whole availability zone, and one budget for it lets a plan
  concentrate power in one real rack.
* Failed tray: condition ``Ready`` not ``True`` (or missing), ``spec.unschedulable``
  (cordoned), or a ``NoSchedule``/``NoExecute`` taint whose key the job does not
  tolerate (``nvidia.com/gpu`` is tolerated by default: GPU nodes commonly carry
  it to keep other pods off).

Read from a file or, with :func:`run_kubectl`, from ``kubectl get nodes -o json``
itself; both are bounded (:data:`MAX_NODES_JSON_BYTES`, :data:`MAX_K8S_NODES`,
and a time limit for kubectl) and values are range-checked on the way in.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import selectors
import shutil
import signal
import subprocess
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from ntp_opt.app.importers.compose import (
    MAX_GPUS_PER_HOST,
    Host,
    PowerDefault,
    SmiHost,
    Warn,
    compose_cluster,
    fail,
    read_capped,
    show,
)
from ntp_opt.model.files import parse_json

if TYPE_CHECKING:
    from ntp_opt.app.importers.nvidia_smi import XmlCache

__all__ = [
    "DEFAULT_TOLERATED",
    "MAX_K8S_NODES",
    "MAX_NODES_JSON_BYTES",
    "RACK_LABELS",
    "KubectlOutput",
    "import_k8s",
    "read_nodes",
    "run_kubectl",
]

#: Taint keys tolerated by default (the usual dedicated-GPU-node taint).
DEFAULT_TOLERATED: tuple[str, ...] = ("nvidia.com/gpu",)
#: Node labels naming a physical rack, tried in this order without ``--rack-label``:
#: the de-facto ``topology.kubernetes.io/rack`` (used by topology-aware schedulers'
#: examples; not one of Kubernetes' own well-known labels) and GKE's
#: ``cloud.google.com/gce-topology-subblock`` (a sub-block is the hosts of one rack).
RACK_LABELS: tuple[str, ...] = (
    "topology.kubernetes.io/rack",
    "cloud.google.com/gce-topology-subblock",
)
_ZONE = "topology.kubernetes.io/zone"
#: Largest ``kubectl get nodes -o json`` accepted, in bytes (a node object takes
#: 5-40 KB, mostly its ``status.images``).
MAX_NODES_JSON_BYTES = 256 * 1024**2
#: Most node objects accepted (Kubernetes supports clusters of 5,000 nodes; the
#: largest managed offerings, 65,000).
MAX_K8S_NODES = 100_000
_MAX_NAME = 253  # a node name is a DNS subdomain
_MAX_VALUE = 63  # a label value
_MAX_KEY = 253 + 1 + 63  # a label key: DNS-subdomain prefix, '/', name
_CLIQUE = re.compile(r"^[^.\s]+\.[0-9]+$")
_DIGITS = re.compile(r"^[0-9]{1,9}$")


@dataclass(frozen=True)
class KubectlOutput:
    """What ``kubectl get nodes -o json`` printed, and how to name it in messages."""

    data: bytes
    source: str


def _label_path(i: int, key: str) -> str:
    return f'items[{i}].metadata.labels["{key}"]'


def _int(value: Any, src: str, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and _DIGITS.match(value.strip()):
        n = int(value)
    else:
        fail(src, f"expected a GPU count (0 to {MAX_GPUS_PER_HOST}), got {show(value)}", path)
    if n < 0 or n > MAX_GPUS_PER_HOST:
        fail(src, f"GPU count {n} out of range (0 to {MAX_GPUS_PER_HOST})", path)
    return n


def _label(labels: dict[str, Any], key: str, src: str, i: int) -> str | None:
    """A label value (None when absent), refused unless a non-empty string of <= 63 chars."""
    value = labels.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > _MAX_VALUE:
        fail(
            src,
            f"expected a label value of 1 to {_MAX_VALUE} characters, got {show(value)}",
            _label_path(i, key),
        )
    return value


def _obj(value: Any, src: str, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        fail(src, f"expected an object, got {type(value).__name__}", path)
    return value


def read_nodes(
    path: str | Path | KubectlOutput,
    *,
    rack_label: str | None = None,
    tolerate: tuple[str, ...] = DEFAULT_TOLERATED,
    warn: Warn,
    left_out: set[str] | None = None,
) -> list[Host]:
    """The GPU nodes of a ``kubectl get nodes -o json`` file as :class:`Host` records.

    Parameters
    ----------
    path : str, Path or KubectlOutput
        ``kubectl get nodes -o json`` output (a ``List``/``NodeList``, or one
        ``Node``): a file, or what :func:`run_kubectl` returned.
    rack_label : str, optional
        Node label naming the rack (default: the first of :data:`RACK_LABELS`
        present, else one rack per NVLink domain).
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
    ntp_opt.model.files.InputError
        ``FILE: JSON path: message`` for malformed JSON, a file that is not a
        regular file or is too large, more than :data:`MAX_K8S_NODES` nodes, a
        node without a name or listed twice, GPU counts that disagree or are out
        of range, a malformed clique label, or a missing ``rack_label``.
    """
    if isinstance(path, KubectlOutput):
        src, raw = path.source, path.data
    else:
        src = str(Path(path))
        hint = " (a node object takes 5-40 KB; drop status.images with jq to shrink it)"
        raw = read_capped(path, MAX_NODES_JSON_BYTES, hint)
        if src.endswith(".gz"):
            raw = _gunzip(raw, src, hint)
    data = parse_json(raw, src)
    del raw
    items = _items(data, src)
    if len(items) > MAX_K8S_NODES:
        fail(src, f"{len(items)} nodes, more than {MAX_K8S_NODES}", "items")
    hosts: list[Host] = []
    labels_of: list[tuple[int, dict[str, Any]]] = []
    seen: dict[str, int] = {}
    skipped = 0
    for i, item in enumerate(items):
        node = _node(i, item, src, seen, tolerate, warn)
        if isinstance(node, str):
            skipped += 1
            if left_out is not None:
                left_out.add(node)
        else:
            hosts.append(node[0])
            labels_of.append((i, node[1]))
    if not hosts:
        fail(
            src, "no GPU node (none has status.capacity['nvidia.com/gpu'] or nvidia.com/gpu.count)"
        )
    _racks(hosts, labels_of, src, rack_label, warn)
    if skipped:
        warn(f"{src}: {skipped} node(s) without GPUs left out")
    return hosts


def _gunzip(raw: bytes, src: str, hint: str) -> bytes:
    """``raw`` decompressed, at most :data:`MAX_NODES_JSON_BYTES` (a gzip bomb stops there)."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as fh:
            out = fh.read(MAX_NODES_JSON_BYTES + 1)
    except (OSError, EOFError, zlib.error) as err:
        fail(src, f"cannot decompress: {err}")
    if len(out) > MAX_NODES_JSON_BYTES:
        fail(src, f"decompresses to more than {MAX_NODES_JSON_BYTES} bytes{hint}")
    return out


def _racks(
    hosts: list[Host],
    labels_of: list[tuple[int, dict[str, Any]]],
    src: str,
    rack_label: str | None,
    warn: Warn,
) -> None:
    """Set each host's rack: ``rack_label``, else a :data:`RACK_LABELS` label, else per domain."""
    key = rack_label
    if key is not None and not 0 < len(key) <= _MAX_KEY:
        fail("--rack-label", f"a label key has 1 to {_MAX_KEY} characters, got {len(key)}")
    if key is None:
        key = next((k for k in RACK_LABELS if any(k in lab for _, lab in labels_of)), None)
    if key is None:
        zone = (
            f"; the zone label {_ZONE} is not taken as a rack (a zone is a data hall or "
            f"more): pass --rack-label {_ZONE} if yours is one"
            if any(_ZONE in lab for _, lab in labels_of)
            else ""
        )
        warn(
            f"{src}: no rack label on the GPU nodes ({', '.join(RACK_LABELS)}; --rack-label "
            "names another): one rack per NVLink domain, each budgeted at its own GPUs' "
            f"tdp_w (the tightest choice){zone}"
        )
        for h in hosts:
            h.rack = f"{h.domain}/rack"
        return
    without: list[str] = []
    for h, (i, labels) in zip(hosts, labels_of, strict=True):
        rack = _label(labels, key, src, i)
        if rack is None:
            if rack_label is not None:
                fail(src, f"node {h.name} has no rack label {rack_label!r}", _label_path(i, key))
            without.append(h.name)
            h.rack = f"{h.domain}/rack"
        else:
            h.rack, h.rack_source = rack, f"node label {key}"
    if rack_label is None:
        racks = len({h.rack for h in hosts if h.rack_source})
        rest = (
            f"; {len(without)} GPU node(s) without it ({', '.join(without[:3])}"
            f"{' ...' if len(without) > 3 else ''}) get one rack per NVLink domain"
            if without
            else ""
        )
        warn(
            f"{src}: racks from node label {key} ({racks} rack(s)){rest}; --rack-label "
            "names another label"
        )


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
    tolerate: tuple[str, ...],
    warn: Warn,
) -> tuple[Host, dict[str, Any]] | str:
    """Node ``items[i]`` as a :class:`Host` and its labels, or its name when it has no GPU."""
    base = f"items[{i}]"
    item = _obj(item, src, base)
    meta = _obj(item.get("metadata"), src, f"{base}.metadata")
    spec = _obj(item.get("spec"), src, f"{base}.spec")
    status = _obj(item.get("status"), src, f"{base}.status")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        fail(src, "node without a name", f"{base}.metadata.name")
    if len(name) > _MAX_NAME:  # characters are the exports' business (they refuse unsafe ones)
        fail(
            src,
            f"node name of {len(name)} characters, more than {_MAX_NAME}",
            f"{base}.metadata.name",
        )
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
    clique = _label(labels, "nvidia.com/gpu.clique", src, i)
    if clique is not None:
        if not _CLIQUE.match(clique):
            fail(
                src,
                f"expected '<cluster UUID>.<clique id>', got {show(clique)}",
                _label_path(i, "nvidia.com/gpu.clique"),
            )
        domain = clique
    else:
        domain = f"{name}/nvlink"
    host = Host(
        name=name,
        gpus=gpus,
        domain=domain,
        rack="",  # set by _racks once every node's labels are known
        where=f"{src}: {base}",
        failed_reason=", ".join(_unusable(spec, status, tolerate, src, base)) or None,
        product=_label(labels, "nvidia.com/gpu.product", src, i),
        fabric_domain=clique,
    )
    return host, labels


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
        reps = int(rep) if isinstance(rep, str) and _DIGITS.match(rep) else 1
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
        reasons.append(f"NotReady (Ready={str(ready[0].get('status'))[:20]})")
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
            val = f"={str(t['value'])[:_MAX_VALUE]}" if t.get("value") else ""
            reasons.append(f"tainted {str(t.get('key'))[:_MAX_NAME]}{val}:{t.get('effect')}")
    return reasons


def import_k8s(
    nodes: str | Path | KubectlOutput,
    *,
    nvidia_smi: str | Path | None = None,
    nvidia_smi_cache: XmlCache | None = None,
    rack_label: str | None = None,
    tolerate: tuple[str, ...] = DEFAULT_TOLERATED,
    name: str = "k8s",
    warn: Warn,
    power: PowerDefault | None = None,
) -> nx.Graph:
    """Build a cluster graph from ``kubectl get nodes -o json`` (and nvidia-smi output).

    Parameters
    ----------
    nodes : str, Path or KubectlOutput
        ``kubectl get nodes -o json`` output: a file, or :func:`run_kubectl`'s result.
    nvidia_smi : str or Path, optional
        Directory of ``<node>.xml`` files (``nvidia-smi -q -x`` per node).
    nvidia_smi_cache : XmlCache, optional
        Keeps the parse of each file until it changes (``ntp-opt watch`` reads
        the directory every poll); see :class:`~ntp_opt.app.importers.nvidia_smi.XmlCache`.
    rack_label : str, optional
        Node label giving the rack (default: the first of :data:`RACK_LABELS`
        present, else one rack per NVLink domain).
    tolerate : tuple of str
        Taint keys that do not make a node unusable.
    name : str
        Cluster name.
    warn : callable
        Receives one message per warning.
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

    outside: set[str] = set()
    hosts = read_nodes(nodes, rack_label=rack_label, tolerate=tolerate, warn=warn, left_out=outside)
    smi: dict[str, SmiHost] | None = None
    if nvidia_smi is not None:
        smi = read_dir(
            nvidia_smi,
            hosts,
            warn=warn,
            left_out=frozenset(outside),
            cache=nvidia_smi_cache,
        )
    return compose_cluster(hosts, smi, name=name, warn=warn, power=power)


def run_kubectl(
    context: str | None = None,
    *,
    timeout: float = 60.0,
    max_bytes: int = MAX_NODES_JSON_BYTES,
    kubectl: str = "kubectl",
) -> KubectlOutput:
    """Run ``kubectl get nodes -o json`` (the ``kubectl`` on PATH, honouring KUBECONFIG).

    Parameters
    ----------
    context : str, optional
        ``--context`` for kubectl.
    timeout : float
        Seconds kubectl may take; then it (and its process group: credential
        plugins) is killed.
    max_bytes : int
        Most output bytes read; more kills kubectl.
    kubectl : str
        The command (looked up on PATH).

    Returns
    -------
    KubectlOutput
        The output, named ``kubectl get nodes -o json`` (with the context).

    Raises
    ------
    ntp_opt.model.files.InputError
        One line: kubectl missing, failing (its first error line), too slow, or
        printing too much.
    """
    argv = [kubectl, "get", "nodes", "-o", "json"]
    if context is not None:
        argv += ["--context", context]
    src = " ".join(argv[:5]) + (f" (context {context})" if context is not None else "")
    exe = shutil.which(kubectl)
    if exe is None:
        fail(src, f"{kubectl} not found on PATH (--live runs it; or give --nodes FILE)")
    try:
        proc = subprocess.Popen(
            [exe, *argv[1:]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as err:
        fail(src, f"cannot run {exe}: {err.strerror}")
    out, errout, problem = _collect(proc, timeout, max_bytes)
    if problem is None:
        code = proc.wait()
        if code != 0:
            first = next(
                (ln for ln in errout.decode("utf-8", "replace").splitlines() if ln.strip()),
                "no message",
            )
            problem = f"failed (exit status {code}): {first.strip()[:300]}"
        elif not out.strip():
            problem = "printed nothing"
    if problem is not None:
        fail(src, problem)
    return KubectlOutput(out, src)


def _collect(
    proc: subprocess.Popen[bytes], timeout: float, max_bytes: int
) -> tuple[bytes, bytes, str | None]:
    """kubectl's stdout (at most ``max_bytes``), stderr (64 KB) and what stopped reading early."""
    assert proc.stdout is not None and proc.stderr is not None
    out: list[bytes] = []
    err: list[bytes] = []
    sizes = {"out": 0, "err": 0}
    problem: str | None = None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    deadline = time.monotonic() + timeout
    try:
        while sel.get_map() and problem is None:
            left = deadline - time.monotonic()
            events = sel.select(max(left, 0.0)) if left > 0 else []
            if not events:
                problem = f"no answer within {timeout:g} s (--kubectl-timeout)"
                break
            for key, _ in events:
                chunk = os.read(key.fd, 1 << 20)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                sizes[key.data] += len(chunk)
                if key.data == "out":
                    out.append(chunk)
                    if sizes["out"] > max_bytes:
                        problem = f"output exceeds {max_bytes} bytes"
                elif sizes["err"] <= 65536:
                    err.append(chunk)
    finally:
        sel.close()
        if problem is not None:
            _kill(proc)
        proc.stdout.close()
        proc.stderr.close()
    return b"".join(out), b"".join(err), problem


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill kubectl and its process group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    proc.wait()
