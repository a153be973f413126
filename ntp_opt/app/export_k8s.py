"""Export a plan as Kubernetes objects: one pinned Job per planned host.

``ntp-opt export --to k8s`` writes the whole Megatron-LM export
(:func:`ntp_opt.app.export.export_megatron`) plus three files
(``docs/export.md``, section "Kubernetes"):

``k8s.json``
    A ``v1`` ``List`` to ``kubectl apply -f``: a headless ``Service`` (the
    pods' DNS names; ``MASTER_ADDR`` is the name of the pod of node rank 0),
    a ``ConfigMap`` (the wrapper, the rank tables, ``ntp_config.py``,
    ``megatron-args.txt``; tables above 1 MiB are cut over several, see
    :func:`configmap_parts`) and one ``batch/v1`` ``Job`` per host that runs
    at least one rank, active or placeholder (node rank = order of the host's
    first rank). Each Job's pod is pinned to its node by node affinity on
    ``metadata.name`` (the node's name, which is the instance's host name
    when it was imported with ``ntp-opt import k8s``), tolerates the
    ``nvidia.com/gpu`` ``NoSchedule`` taint, and requests every GPU of the
    host the plan may use (see :func:`pod_gpus`).
``k8s-ranks.tsv``
    The wrapper's table: rank, node, ``CUDA_VISIBLE_DEVICES`` value, active.
``k8s-launch.sh``
    The wrapper (:data:`LAUNCH_SCRIPT`): reads the node name from the
    downward API (``NTP_NODE_NAME`` = ``spec.nodeName``), starts one process
    per rank of that node with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK=0``,
    ``MASTER_ADDR``/``MASTER_PORT`` and its GPU, and exits non-zero when the
    node runs no rank or any rank fails.

Device binding: a GPU's ``uuid`` attribute (``ntp-opt import --nvidia-smi``)
gives ``CUDA_VISIBLE_DEVICES=GPU-...``, which names the same board whatever
the device plugin hands the container. A host whose planned GPUs lack a
UUID falls back to indices with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; inside the
container those count only the pod's GPUs, so a host device index ``d`` is
written as its position among the pod's GPUs (:func:`pod_gpus`), which is
right when the device plugin hands over exactly the GPUs the instance
calls healthy.

The manifest is built as Python objects and written with :func:`json.dumps`;
the wrapper reads its data from files and never evaluates them, and every
host name, UUID and object name is checked against the grammar Kubernetes
gives it, so no instance string reaches a shell or a YAML parser as code.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ntp_opt.app.export import (
    ARGS_NAME,
    CONFIG_NAME,
    RANKS_NAME,
    Export,
    RankRow,
    export_megatron,
    gpu_hosts,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.megatron import MegatronError
from ntp_opt.rules.validate import Violation

__all__ = [
    "CONFIGMAP_LIMIT",
    "K8S_LAUNCH_NAME",
    "K8S_NAME",
    "K8S_RANKS_NAME",
    "LAUNCH_SCRIPT",
    "K8sHost",
    "K8sOptions",
    "configmap_parts",
    "export_k8s",
    "k8s_files",
    "k8s_hosts",
    "k8s_manifest",
    "k8s_notes",
    "pod_gpus",
]

#: File names written next to the Megatron-LM export.
K8S_NAME = "k8s.json"
K8S_RANKS_NAME = "k8s-ranks.tsv"
K8S_LAUNCH_NAME = "k8s-launch.sh"
#: Where the ConfigMap is mounted in every pod.
MOUNT = "/ntp"
#: The extended resource of NVIDIA's device plugin.
GPU_RESOURCE = "nvidia.com/gpu"
#: Kubernetes refuses objects above 1 MiB; a ConfigMap's data must leave room for its metadata.
CONFIGMAP_LIMIT = 1_000_000
#: Files that may be cut at line ends over several ConfigMaps.
_SPLITTABLE = (K8S_RANKS_NAME, RANKS_NAME)
#: A DNS-1123 label (object names, pod host names, namespaces), at most 63 characters.
LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
#: A DNS-1123 subdomain (node names), at most 253 characters.
SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
#: Labels every object carries (plus ``app.kubernetes.io/instance`` = the export's name).
APP_LABEL = {"app.kubernetes.io/name": "ntp-opt"}


@dataclass(frozen=True)
class K8sOptions:
    """What the Kubernetes objects need beyond the plan.

    Attributes
    ----------
    image
        Container image with PyTorch, Megatron-LM and the NTP training script.
    name
        Prefix of every object's name (a DNS-1123 label of at most 40 characters).
    namespace
        Namespace written into every object (``None``: the one ``kubectl`` uses).
    command
        The training command; the wrapper appends the flags of ``megatron-args.txt``.
    master_port
        The rendezvous port (``MASTER_PORT``) on the pod of node rank 0.
    configmap_bytes
        Most bytes of files one ConfigMap holds; larger rank tables are split
        over several (:func:`configmap_parts`).

    Raises
    ------
    ValueError
        On an unusable value, naming the option.
    """

    image: str
    name: str = "ntp"
    namespace: str | None = None
    command: tuple[str, ...] = ("python", "pretrain_gpt_ntp.py")
    master_port: int = 29500
    configmap_bytes: int = CONFIGMAP_LIMIT

    def __post_init__(self) -> None:
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"--image: {self.image!r} is not a container image reference")
        if len(self.name) > 40 or not LABEL_RE.fullmatch(self.name):
            raise ValueError(
                f"--name: {self.name!r} is not a DNS-1123 label of at most 40 characters "
                "([a-z0-9-], starting and ending alphanumeric)"
            )
        if self.namespace is not None and not LABEL_RE.fullmatch(self.namespace):
            raise ValueError(f"--namespace: {self.namespace!r} is not a DNS-1123 label")
        if not self.command or not all(isinstance(c, str) and c for c in self.command):
            raise ValueError("--command: the training command is empty")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port: {self.master_port} is not a TCP port")

    @classmethod
    def from_cli(
        cls,
        image: str | None,
        name: str,
        namespace: str | None,
        command: str | None,
        master_port: int,
    ) -> K8sOptions:
        """The options from command-line strings (``command`` split as a shell would, not run).

        Raises
        ------
        ValueError
            On a missing image or an unusable value, naming the option.
        """
        if image is None:
            raise ValueError("--image is required with --to k8s")
        try:
            argv = tuple(shlex.split(command)) if command is not None else cls.command
        except ValueError as err:
            raise ValueError(f"--command: {err}") from None
        return cls(image, name, namespace, argv, master_port)


@dataclass(frozen=True)
class K8sHost:
    """One planned host: its Job, its pod and its ranks.

    Attributes
    ----------
    node_rank
        Position of the host by its first rank (0 holds rank 0: the rendezvous).
    node
        The Kubernetes node name (the instance's host name).
    job
        Name of the Job, the pod's ``hostname`` too (a DNS-1123 label).
    gpus
        ``nvidia.com/gpu`` the pod requests.
    rows
        The host's rank rows, in rank order.
    visible
        ``CUDA_VISIBLE_DEVICES`` of each row (a UUID or an index among the pod's GPUs).
    """

    node_rank: int
    node: str
    job: str
    gpus: int
    rows: tuple[RankRow, ...]
    visible: tuple[str, ...]

    @property
    def by_uuid(self) -> bool:
        """Whether the ranks are bound by GPU UUID (else by index, PCI bus order)."""
        return all(v.startswith("GPU-") for v in self.visible)


def _slug(host: str, room: int) -> str:
    """``host`` as label characters (lower case, ``-`` for the rest), at most ``room`` long."""
    s = re.sub(r"[^a-z0-9]+", "-", host.lower())[:room].strip("-")
    return s or "host"


def pod_gpus(instance: Instance, ex: Export) -> dict[str, list[int]]:
    """The device indices each planned host's pod asks for, in index order.

    A cluster host's pod asks for all its healthy GPUs: the device plugin,
    not the pod, chooses which boards a container gets, so asking for fewer
    than all could leave a planned board out. A host outside the cluster
    (``--placeholder-hosts``) asks for the devices its placeholder ranks use.

    Parameters
    ----------
    instance
        The instance.
    ex
        The export of a plan of ``instance``.

    Returns
    -------
    dict
        Host name -> device indices, for every host that runs a rank.
    """
    a = instance.arrays
    hosts, device = gpu_hosts(instance)
    healthy: dict[str, list[int]] = {}
    for i, h in enumerate(hosts):
        if a.healthy[i]:
            healthy.setdefault(h, []).append(int(device[i]))
    out: dict[str, list[int]] = {}
    for row in ex.rows:
        if row.host not in out:
            out[row.host] = sorted(healthy.get(row.host, []))
        if row.device not in out[row.host]:  # a placeholder host outside the cluster
            out[row.host] = sorted([*out[row.host], row.device])
    return out


def k8s_hosts(instance: Instance, ex: Export, options: K8sOptions) -> list[K8sHost]:
    """The planned hosts, by node rank, with their Job names, GPU counts and bindings.

    Parameters
    ----------
    instance
        The instance.
    ex
        The export of a plan of ``instance``.
    options
        The Kubernetes options (the name prefix).

    Returns
    -------
    list of K8sHost
        One per host that runs a rank (active or placeholder).

    Raises
    ------
    MegatronError
        When a host name is not a Kubernetes node name (``k8s-hosts``). A
        GPU's ``uuid`` attribute is checked by the export itself
        (``megatron-uuids``, :data:`ntp_opt.app.export.UUID_RE`).
    """
    problems: list[Violation] = []
    by_host: dict[str, list[RankRow]] = {}
    for row in ex.rows:
        by_host.setdefault(row.host, []).append(row)
    for h in by_host:
        if len(h) > 253 or not SUBDOMAIN_RE.fullmatch(h):
            problems.append(
                Violation(
                    "k8s-hosts",
                    f"host {h!r} is not a Kubernetes node name (a DNS-1123 subdomain: "
                    "lower case [a-z0-9.-], at most 253 characters)",
                )
            )
    nodes = instance.cluster.nodes
    uuid: dict[Any, str | None] = {}
    for row in ex.rows:
        if row.gpu is None:
            continue
        u = nodes[row.gpu].get("uuid")  # checked by the export (megatron-uuids)
        uuid[row.gpu] = u if isinstance(u, str) else None
    if problems:
        raise MegatronError(problems)
    gpus = pod_gpus(instance, ex)
    out: list[K8sHost] = []
    order = sorted(by_host, key=lambda h: by_host[h][0].rank)
    for n, h in enumerate(order):
        rows = by_host[h]
        prefix = f"{options.name}-{n}-"
        job = prefix + _slug(h, 63 - len(prefix))
        uuids = [None if r.gpu is None else uuid[r.gpu] for r in rows]
        if all(u is not None for u in uuids):
            visible = tuple(str(u) for u in uuids)
        else:
            visible = tuple(str(gpus[h].index(r.device)) for r in rows)
        out.append(K8sHost(n, h, job, len(gpus[h]), tuple(rows), visible))
    return out


def _ranks_table(hosts: Sequence[K8sHost]) -> str:
    rows = sorted(
        (row.rank, h.node, vis, int(row.active))
        for h in hosts
        for row, vis in zip(h.rows, h.visible, strict=True)
    )
    return "".join(
        ["# rank\tnode\tcuda_visible_devices\tactive\n"]
        + [f"{r}\t{node}\t{vis}\t{act}\n" for r, node, vis, act in rows]
    )


def _meta(name: str, options: K8sOptions, labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {**APP_LABEL, "app.kubernetes.io/instance": options.name, **(labels or {})},
    }
    if options.namespace is not None:
        meta["namespace"] = options.namespace
    return meta


def _job(h: K8sHost, master: str, options: K8sOptions, config_maps: list[str]) -> dict[str, Any]:
    labels = {"ntp-opt/node-rank": str(h.node_rank)}
    pod_labels = {**APP_LABEL, "app.kubernetes.io/instance": options.name, **labels}
    n_active = sum(r.active for r in h.rows)
    env = [
        {"name": "NTP_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "NTP_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NTP_EXPORT_DIR", "value": MOUNT},
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(options.master_port)},
    ]
    container = {
        "name": "megatron",
        "image": options.image,
        "command": ["bash", f"{MOUNT}/{K8S_LAUNCH_NAME}"],
        "args": list(options.command),
        "env": env,
        "resources": {"limits": {GPU_RESOURCE: str(h.gpus)}},
        "volumeMounts": [
            {"name": "ntp", "mountPath": MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    if h.node_rank == 0:
        container["ports"] = [
            {"name": "rendezvous", "containerPort": options.master_port, "protocol": "TCP"}
        ]
    pod_spec = {
        "restartPolicy": "Never",
        "hostname": h.job,
        "subdomain": options.name,
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [h.node]}
                            ]
                        }
                    ]
                }
            }
        },
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
        "volumes": [
            {
                "name": "ntp",
                "projected": {"sources": [{"configMap": {"name": n}} for n in config_maps]},
            },
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    meta = _meta(h.job, options, labels)
    meta["annotations"] = {
        "ntp-opt/node": h.node,
        "ntp-opt/ranks": f"{h.rows[0].rank}..{h.rows[-1].rank} ({len(h.rows)}, {n_active} active)",
        "ntp-opt/binding": "uuid" if h.by_uuid else "index",
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "completions": 1,
            "parallelism": 1,
            "backoffLimit": 0,
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def configmap_parts(data: dict[str, str], limit: int) -> list[dict[str, str]]:
    """The ConfigMaps' files: ``data`` packed into parts of at most ``limit`` bytes.

    Files are kept whole while they fit; a rank table that does not (``k8s-ranks.tsv``,
    ``ranks.txt``) is cut at line ends into ``NAME.1``, ``NAME.2``, ... (the
    wrapper reads ``k8s-ranks.tsv`` and ``k8s-ranks.tsv.*``). Parts are filled
    in order; the pods mount them all into one directory (a projected volume).

    Parameters
    ----------
    data
        File name -> text.
    limit
        Most bytes (names and texts, UTF-8) per part.

    Returns
    -------
    list of dict
        The parts, the first holding the first file.

    Raises
    ------
    MegatronError
        ``k8s-size`` when a single file that cannot be cut, or a single line,
        exceeds ``limit``.
    """
    pieces: list[tuple[str, str]] = []
    for name, text in data.items():
        if len(name.encode()) + len(text.encode()) <= limit or name not in _SPLITTABLE:
            pieces.append((name, text))
            continue
        chunk: list[str] = []
        used = count = 0
        room = limit - len(name.encode()) - 8  # the suffix ".NNNNNNN"
        for line in text.splitlines(keepends=True):
            n = len(line.encode())
            if chunk and used + n > room:
                count += 1
                pieces.append((f"{name}.{count}", "".join(chunk)))
                chunk, used = [], 0
            chunk.append(line)
            used += n
        pieces.append((f"{name}.{count + 1}", "".join(chunk)))
    parts: list[dict[str, str]] = [{}]
    used = 0
    for name, text in pieces:
        n = len(name.encode()) + len(text.encode())
        if n > limit:
            raise MegatronError(
                [
                    Violation(
                        "k8s-size",
                        f"{name} needs {n} bytes in a ConfigMap, which holds at most {limit}",
                    )
                ]
            )
        if parts[-1] and used + n > limit:
            parts.append({})
            used = 0
        parts[-1][name] = text
        used += n
    return parts


def k8s_manifest(
    hosts: Sequence[K8sHost], data: dict[str, str], options: K8sOptions
) -> dict[str, Any]:
    """The ``v1`` ``List`` of the Service, the ConfigMaps and one Job per host.

    Parameters
    ----------
    hosts
        :func:`k8s_hosts`.
    data
        The files every pod sees in ``/ntp`` (name -> text), split over
        ConfigMaps ``NAME-config``, ``NAME-config-1``, ... by :func:`configmap_parts`.
    options
        The Kubernetes options.

    Returns
    -------
    dict
        A JSON-ready object ``kubectl apply -f`` accepts.

    Raises
    ------
    MegatronError
        As :func:`configmap_parts`.
    """
    parts = configmap_parts(data, options.configmap_bytes)
    names = [f"{options.name}-config" + (f"-{i}" if i else "") for i in range(len(parts))]
    master = f"{hosts[0].job}.{options.name}"
    selector = {**APP_LABEL, "app.kubernetes.io/instance": options.name}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(options.name, options),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": options.master_port, "protocol": "TCP"}],
        },
    }
    cms = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(n, options), "data": part}
        for n, part in zip(names, parts, strict=True)
    ]
    items = [service, *cms, *(_job(h, master, options, names) for h in hosts)]
    return {"apiVersion": "v1", "kind": "List", "items": items}


def k8s_files(instance: Instance, ex: Export, options: K8sOptions) -> dict[str, str]:
    """The Kubernetes files of an export: ``k8s.json``, ``k8s-ranks.tsv``, ``k8s-launch.sh``.

    Parameters
    ----------
    instance
        The instance.
    ex
        The export of a plan of ``instance`` (``ex.files`` holds the Megatron-LM files).
    options
        The Kubernetes options.

    Returns
    -------
    dict
        File name -> text.

    Raises
    ------
    MegatronError
        As :func:`k8s_hosts` and :func:`configmap_parts`.
    """
    hosts = k8s_hosts(instance, ex, options)
    table = _ranks_table(hosts)
    data = {
        K8S_LAUNCH_NAME: LAUNCH_SCRIPT,
        CONFIG_NAME: ex.files[CONFIG_NAME],
        ARGS_NAME: ex.files[ARGS_NAME],
        K8S_RANKS_NAME: table,
        RANKS_NAME: ex.files[RANKS_NAME],
    }
    manifest = k8s_manifest(hosts, data, options)
    return {
        K8S_NAME: json.dumps(manifest, indent=1, ensure_ascii=True) + "\n",
        K8S_RANKS_NAME: table,
        K8S_LAUNCH_NAME: LAUNCH_SCRIPT,
    }


def k8s_notes(instance: Instance, ex: Export, options: K8sOptions) -> list[str]:
    """What a user of the Kubernetes export should know: the pods, the rendezvous, the bindings.

    Parameters
    ----------
    instance, ex, options
        As for :func:`k8s_files`.

    Returns
    -------
    list of str
        One sentence per line.
    """
    hosts = k8s_hosts(instance, ex, options)
    n_gpus = sum(h.gpus for h in hosts)
    notes = [
        f"{len(hosts)} Jobs (one pod per planned host) requesting {n_gpus} GPUs for "
        f"{len(ex.rows)} ranks; MASTER_ADDR={hosts[0].job}.{options.name} (node {hosts[0].node})"
    ]
    by_index = [h.node for h in hosts if not h.by_uuid]
    if by_index:
        shown = ", ".join(by_index[:3]) + (
            f" and {len(by_index) - 3} more" if len(by_index) > 3 else ""
        )
        notes.append(
            f"{len(by_index)} host(s) bound by GPU index, not UUID ({shown}): the instance has no "
            "uuid for their GPUs (ntp-opt import --nvidia-smi gives it); the index is counted "
            "among the pod's GPUs in PCI bus order"
        )
    return notes


def export_k8s(
    instance: Instance,
    plan: Plan,
    out_dir: str | os.PathLike[str],
    options: K8sOptions,
    *,
    reorder: bool = False,
    placeholder_hosts: Sequence[str] = (),
    placeholder_gpus: int | None = None,
    inputs: Sequence[str | os.PathLike[str]] = (),
) -> Export:
    """Write the Megatron-LM export of ``plan`` and its Kubernetes objects into ``out_dir``.

    Parameters
    ----------
    instance, plan, reorder, placeholder_hosts, placeholder_gpus, inputs
        As for :func:`ntp_opt.app.export.export_megatron`.
    out_dir
        Output directory (created if missing).
    options
        The Kubernetes options.

    Returns
    -------
    Export
        What was written (``files`` names every file, the Kubernetes ones included).

    Raises
    ------
    ntp_opt.validate.PlanError, MegatronError
        As :func:`ntp_opt.app.export.export_megatron` and :func:`k8s_files`;
        nothing is written then.
    """
    return export_megatron(
        instance,
        plan,
        Path(out_dir),
        reorder=reorder,
        placeholder_hosts=placeholder_hosts,
        placeholder_gpus=placeholder_gpus,
        inputs=inputs,
        extra_files=lambda ex: k8s_files(instance, ex, options),
    )


LAUNCH_SCRIPT = r"""#!/bin/bash
# Written by ntp-opt: the Kubernetes pod's entry point (docs/export.md, "Kubernetes").
#   bash k8s-launch.sh TRAINING-COMMAND [ARGS...]
# Starts one process per rank that k8s-ranks.tsv (next to this script, or in
# $NTP_EXPORT_DIR) plans on node $NTP_NODE_NAME (the pod's spec.nodeName), each with
# RANK, WORLD_SIZE, LOCAL_RANK=0, MASTER_ADDR, MASTER_PORT and CUDA_VISIBLE_DEVICES
# (a GPU UUID, or an index with CUDA_DEVICE_ORDER=PCI_BUS_ID), and the flags of
# megatron-args.txt appended to the command. It reads its tables as data only.
# Exit status: 0 when every rank exits 0; 2 bad setup (variable, file or command
# missing); 3 this node runs no rank; 4 a planned GPU UUID is not visible in the pod;
# otherwise the status of the first rank that failed (the others are stopped).
set -u
me="k8s-launch.sh"
dir="${NTP_EXPORT_DIR:-$(cd "$(dirname "$0")" && pwd)}"
node="${NTP_NODE_NAME:-}"
if [ -z "$node" ]; then
  echo "$me: NTP_NODE_NAME is not set (the pod's spec.nodeName, from the downward API)" >&2
  exit 2
fi
if [ -z "${MASTER_ADDR:-}" ]; then echo "$me: MASTER_ADDR is not set" >&2; exit 2; fi
port="${MASTER_PORT:-29500}"
if [ "$#" -eq 0 ]; then echo "$me: no training command given" >&2; exit 2; fi
table="$dir/k8s-ranks.tsv"
shopt -s nullglob
parts=("$dir"/k8s-ranks.ts[v] "$dir"/k8s-ranks.tsv.*)
shopt -u nullglob
if [ "${#parts[@]}" -eq 0 ]; then echo "$me: no $table in $dir" >&2; exit 2; fi
for f in "${parts[@]}"; do
  if [ ! -r "$f" ]; then echo "$me: cannot read $f" >&2; exit 2; fi
done
world=0
ranks=()
devs=()
acts=()
while IFS=$'\t' read -r r h v a _; do
  case "$r" in '' | '#'*) continue ;; esac
  case "$r$a" in *[!0-9]*)
    echo "$me: $table: malformed line for rank $(printf '%q' "$r")" >&2
    exit 2
    ;;
  esac
  world=$((world + 1))
  if [ "$h" = "$node" ]; then
    ranks+=("$r")
    devs+=("$v")
    acts+=("$a")
  fi
done < <(cat -- "${parts[@]}")
if [ "${#ranks[@]}" -eq 0 ]; then
  printf '%s: node %q runs no rank: it is not in %s (%d ranks);' "$me" "$node" "$table" \
    "$world" >&2
  echo " the pod is on the wrong node or the export is stale" >&2
  exit 3
fi
margs=()
if [ -r "$dir/megatron-args.txt" ]; then read -r -a margs <"$dir/megatron-args.txt"; fi
if command -v nvidia-smi >/dev/null 2>&1; then
  seen="$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null || true)"
  for i in "${!ranks[@]}"; do
    case "${devs[i]}" in GPU-*)
      if ! grep -qxF -- "${devs[i]}" <<<"$seen"; then
        echo "$me: rank ${ranks[i]}: GPU ${devs[i]} is not among this pod's GPUs" >&2
        exit 4
      fi
      ;;
    esac
  done
fi
wait_s="${NTP_DNS_WAIT:-300}"
if [ "$wait_s" -gt 0 ] && command -v getent >/dev/null 2>&1; then
  waited=0
  until getent hosts "$MASTER_ADDR" >/dev/null; do
    if [ "$waited" -ge "$wait_s" ]; then
      echo "$me: warning: $MASTER_ADDR does not resolve after ${wait_s}s; starting anyway" >&2
      break
    fi
    sleep 2
    waited=$((waited + 2))
  done
fi
n_active=0
for a in "${acts[@]}"; do n_active=$((n_active + a)); done
n_idle=$((${#ranks[@]} - n_active))
echo "$me: node $node: starting ranks ${ranks[*]} of world $world ($n_active active," \
  "$n_idle placeholders); MASTER_ADDR=$MASTER_ADDR:$port" >&2
export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait; exit 143' TERM INT
for i in "${!ranks[@]}"; do
  (
    export RANK="${ranks[i]}" WORLD_SIZE="$world" LOCAL_RANK=0 LOCAL_WORLD_SIZE=1
    export MASTER_ADDR MASTER_PORT="$port" NTP_RANK_ACTIVE="${acts[i]}"
    export CUDA_VISIBLE_DEVICES="${devs[i]}"
    case "${devs[i]}" in GPU-*) ;; *) export CUDA_DEVICE_ORDER=PCI_BUS_ID ;; esac
    exec "$@" "${margs[@]}"
  ) &
  pids+=("$!")
done
status=0
left="${#pids[@]}"
while [ "$left" -gt 0 ]; do
  wait -n
  rc=$?
  left=$((left - 1))
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status="$rc"
    echo "$me: a rank exited with status $rc; stopping the other ranks of node $node" >&2
    kill "${pids[@]}" 2>/dev/null
  fi
done
exit "$status"
"""
