"""The Megatron-LM NTP export.

:func:`megatron_export` builds it in memory, :func:`export_megatron` writes it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from ntp_opt.app.export.launchers import launch_files, torchrun_hosts
from ntp_opt.app.export.names import (
    CONFIG_NAME,
    EXTRAS_FORMAT,
    HOST_RE,
    ID_RE,
    MAX_PLACEHOLDER_GPUS,
    MAX_PLACEHOLDER_HOSTS,
    MAX_WORLD,
    RANK_ORDER,
    RANKS_NAME,
    TORCHRUN_HOSTS_NAME,
)
from ntp_opt.app.export.ranks import placeholder_rows, spares
from ntp_opt.app.export.rows import Export, active_rows, gpu_hosts
from ntp_opt.app.export.writing import write_launch_set
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.megatron import (
    MegatronError,
    megatron_compatible,
    megatron_order,
)
from ntp_opt.rules.validate import Violation, check


def megatron_export(
    instance: Instance,
    plan: Plan,
    *,
    reorder: bool = False,
    placeholder_hosts: Sequence[str] = (),
    placeholder_gpus: int | None = None,
) -> Export:
    """Everything needed to launch ``plan`` with Megatron-LM's NTP code.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan that passes the validator.
    reorder
        Move reduced replicas first (:func:`megatron_order`) before checking.
    placeholder_hosts
        Host names outside the cluster that may run inactive ranks, used
        only when the cluster has fewer free healthy GPUs than inactive ranks
        or when they make every host's ranks contiguous (torchrun); naming a
        host that runs an active rank is refused.
    placeholder_gpus
        Devices per placeholder host (default: the most GPUs any cluster host has).

    Returns
    -------
    Export
        The configuration, the rank table, the launcher and power files.

    Raises
    ------
    ntp_opt.rules.validate.PlanError
        If the plan breaks a rule of the model (a plan for another instance included).
    MegatronError
        If Megatron-LM cannot run it as it is; the message names the limitation.
    """
    plan = _exportable(instance, plan, reorder, placeholder_hosts, placeholder_gpus)
    job = instance.job
    big_t, n_pp, n_dp = job.tp, job.pp, len(plan.replicas)
    hosts, device = gpu_hosts(instance)
    rows, placeholders = active_rows(instance, plan, hosts, device)
    rows += placeholder_rows(
        instance, plan, rows, placeholders, hosts, device, placeholder_hosts, placeholder_gpus
    )
    rows.sort(key=lambda row: row.rank)
    assert [row.rank for row in rows] == list(range(n_dp * n_pp * big_t))
    hosts_table, note = torchrun_hosts(rows)
    extras = _extras(plan, n_pp, big_t, sum(n for _, n, _ in placeholders), hosts_table, note)
    ex = Export(
        _ntp_kwargs(plan, big_t, n_pp),
        _megatron_args(plan, n_pp, big_t, job.micro_batch),
        rows,
        extras,
        hosts_table,
        note,
    )
    ex.files = launch_files(instance, ex)
    return ex


def _exportable(
    instance: Instance,
    plan: Plan,
    reorder: bool,
    placeholder_hosts: Sequence[str],
    placeholder_gpus: int | None,
) -> Plan:
    """``plan`` (reordered if asked) once it passes the validator and Megatron's restrictions.

    The counts are bounded first (nothing of their size is built before):
    ``placeholder_gpus`` (1 .. :data:`MAX_PLACEHOLDER_GPUS`), the number of
    ``placeholder_hosts`` (at most :data:`MAX_PLACEHOLDER_HOSTS`) and the
    world, ``DP x PP x tp_base`` ranks (at most :data:`MAX_WORLD`).
    """
    if placeholder_gpus is not None and not 1 <= placeholder_gpus <= MAX_PLACEHOLDER_GPUS:
        raise ValueError(
            f"placeholder_gpus (--placeholder-gpus): must be 1 .. {MAX_PLACEHOLDER_GPUS} "
            f"GPUs per placeholder host, got {placeholder_gpus}"
        )
    if len(placeholder_hosts) > MAX_PLACEHOLDER_HOSTS:
        raise ValueError(
            f"placeholder_hosts (--placeholder-hosts): at most {MAX_PLACEHOLDER_HOSTS} "
            f"hosts, got {len(placeholder_hosts)}"
        )
    if len(placeholder_hosts) * (placeholder_gpus or 1) > MAX_WORLD:
        raise ValueError(
            f"placeholder_hosts x placeholder_gpus (--placeholder-hosts x --placeholder-gpus): "
            f"{len(placeholder_hosts)} x {placeholder_gpus} placeholder GPUs, more than the "
            f"largest world the export writes ({MAX_WORLD} ranks)"
        )
    world = len(plan.replicas) * instance.job.pp * instance.job.tp
    if world > MAX_WORLD:
        raise MegatronError(
            [
                Violation(
                    "megatron-slots",
                    f"the world of {len(plan.replicas)} DP x {instance.job.pp} PP x "
                    f"{instance.job.tp} tp_base = {world} ranks is above the export's cap "
                    f"of {MAX_WORLD}",
                )
            ]
        )
    check(instance, plan)
    if reorder:
        plan = megatron_order(plan, instance.job.tp)
    # The world-size check of megatron_compatible is replaced by the placeholder
    # placement below (placeholders may run on hosts outside the cluster).
    problems = [
        v
        for v in megatron_compatible(instance, plan, uniform_batch=True)
        if v.rule != "megatron-slots"
    ]
    if problems:
        raise MegatronError(problems)
    for node in (*instance.arrays.gpu_ids, *instance.arrays.domain_ids):
        if not ID_RE.fullmatch(str(node)):
            raise MegatronError(
                [
                    Violation(
                        "megatron-ids",
                        f"node id {node!r} cannot be written: not [A-Za-z0-9._:/@-]",
                    )
                ]
            )
    for h in placeholder_hosts:
        if not HOST_RE.fullmatch(h):
            raise MegatronError(
                [Violation("megatron-hosts", f"placeholder host {h!r} is not [A-Za-z0-9._-]")]
            )
    return plan


def _ntp_kwargs(plan: Plan, big_t: int, n_pp: int) -> dict[str, Any]:
    """The keyword arguments of Megatron's ``NonuniformTPConfig``."""
    n_reduced = sum(rep.tp < big_t for rep in plan.replicas)
    non_active: dict[tuple[int, int, int], list[int]] | None = None
    if n_reduced:
        non_active = {
            (r, 0, k): list(range(rep.tp, big_t))
            for r, rep in enumerate(plan.replicas)
            if rep.tp < big_t
            for k in range(n_pp)
        }
    return {
        "tp_base": big_t,
        "tp_spares": spares(plan, big_t),
        "num_reduced_tp_dp_ranks": n_reduced * n_pp,
        "non_active_ranks_per_dp": non_active,
    }


def _megatron_args(plan: Plan, n_pp: int, big_t: int, micro_batch: int) -> list[str]:
    """The Megatron-LM command-line flags the layout needs."""
    local = plan.replicas[0].local_batch
    args = [
        "--tensor-model-parallel-size",
        str(big_t),
        "--pipeline-model-parallel-size",
        str(n_pp),
        "--global-batch-size",
        str(local * len(plan.replicas)),
        "--micro-batch-size",
        str(micro_batch),
    ]
    if n_pp > 1:
        args.append("--use-tp-pp-dp-mapping")
    return args


def _extras(
    plan: Plan,
    n_pp: int,
    big_t: int,
    need: int,
    torchrun_hosts: list[tuple[int, str, int, int]] | None,
    note: str,
) -> dict[str, Any]:
    """The sidecar: what Megatron does not read (sizes, batch, placeholders, metrics)."""
    n_dp = len(plan.replicas)
    local = plan.replicas[0].local_batch
    metrics = {
        k: v
        for k, v in plan.metrics.items()
        if isinstance(v, str | int | bool) or (isinstance(v, float) and math.isfinite(v))
    }
    return {
        "format": EXTRAS_FORMAT,
        "instance": plan.instance,
        "megatron_config": CONFIG_NAME,
        "rank_order": RANK_ORDER,
        "tensor_model_parallel_size": big_t,
        "pipeline_model_parallel_size": n_pp,
        "context_parallel_size": 1,
        "data_parallel_size": n_dp,
        "world_size": n_dp * n_pp * big_t,
        "reduced_replicas": sum(rep.tp < big_t for rep in plan.replicas),
        "tp_per_dp": [rep.tp for rep in plan.replicas],
        "local_batch": local,
        "global_batch": local * n_dp,
        "placeholder_ranks": need,
        "power_boost": any(st.power > 1.0 for rep in plan.replicas for st in rep.stages),
        "rank_file": RANKS_NAME,
        "torchrun": TORCHRUN_HOSTS_NAME if torchrun_hosts is not None else note,
        "metrics": metrics,
    }


def export_megatron(
    instance: Instance,
    plan: Plan,
    out_dir: str | os.PathLike[str],
    *,
    reorder: bool = False,
    placeholder_hosts: Sequence[str] = (),
    placeholder_gpus: int | None = None,
    inputs: Sequence[str | os.PathLike[str]] = (),
    extra_files: Callable[[Export], dict[str, str]] | None = None,
) -> Export:
    """Write the files of :func:`megatron_export` into ``out_dir`` (:func:`write_launch_set`).

    Parameters
    ----------
    instance, plan, reorder, placeholder_hosts, placeholder_gpus
        As for :func:`megatron_export`.
    out_dir
        Output directory (created if missing). A previous export there is
        replaced as a whole (its ``torchrun.sh`` removed when the new export
        has none); other files in it are kept.
    inputs
        Files the caller read (never overwritten).
    extra_files
        More files to write with them, made from the export (the Kubernetes
        objects of :mod:`ntp_opt.app.export.k8s`); its errors stop the export
        before any file is written.

    Returns
    -------
    Export
        What was written (``files`` names them).

    Raises
    ------
    ntp_opt.rules.validate.PlanError, MegatronError
        As :func:`megatron_export` (and ``extra_files``); nothing is written then.
    UnsafeTargetError, OSError
        As :func:`write_launch_set`; the directory is then as it was.
    """
    ex = megatron_export(
        instance,
        plan,
        reorder=reorder,
        placeholder_hosts=placeholder_hosts,
        placeholder_gpus=placeholder_gpus,
    )
    if extra_files is not None:
        ex.files.update(extra_files(ex))
    write_launch_set(ex.files, out_dir, inputs=inputs)
    return ex
