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
from collections.abc import Sequence
from pathlib import Path

from ntp_opt.app.export.k8s_hosts import (
    K8S_LAUNCH_NAME,
    K8S_NAME,
    K8S_RANKS_NAME,
    K8sOptions,
    k8s_hosts,
)
from ntp_opt.app.export.k8s_manifest import LAUNCH_SCRIPT, k8s_manifest, ranks_table
from ntp_opt.app.export.megatron import export_megatron
from ntp_opt.app.export.names import ARGS_NAME, CONFIG_NAME, RANKS_NAME
from ntp_opt.app.export.rows import Export
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan


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
    table = ranks_table(hosts)
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
    ntp_opt.rules.validate.PlanError, MegatronError
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
