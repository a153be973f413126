"""The content of a k8s export.

The Service, the ConfigMaps, one pinned Job per host and the wrapper script.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ntp_opt.app.export.k8s_hosts import (
    APP_LABEL,
    K8S_LAUNCH_NAME,
    K8S_RANKS_NAME,
    K8sHost,
    K8sOptions,
)
from ntp_opt.app.export.names import RANKS_NAME
from ntp_opt.planners.megatron import (
    MegatronError,
)
from ntp_opt.rules.validate import Violation

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


def ranks_table(hosts: Sequence[K8sHost]) -> str:
    """``k8s-ranks.tsv``: rank, node, ``CUDA_VISIBLE_DEVICES`` value, active; by rank."""
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


#: Where the ConfigMap is mounted in every pod.
MOUNT = "/ntp"


#: The extended resource of NVIDIA's device plugin.
GPU_RESOURCE = "nvidia.com/gpu"


#: Files that may be cut at line ends over several ConfigMaps.
_SPLITTABLE = (K8S_RANKS_NAME, RANKS_NAME)
