"""Export a plan to Megatron-LM's nonuniform TP runtime, its launchers and power limits.

Megatron-LM's NTP code (``megatron/core/distributed/nonuniform_tp.py`` on its
``dev`` branch) reads one object, ``NonuniformTPConfig(tp_base, tp_spares,
num_reduced_tp_dp_ranks, non_active_ranks_per_dp)``, with
``non_active_ranks_per_dp`` keyed by ``(dp, cp, pp)`` tuples, and its
process-group helper ``initialize_nonuniform_tp_process_groups`` assumes that
global ranks form blocks of ``tp_base`` consecutive ranks, that block ``b =
rank // tp_base`` (no context parallelism) is rebuilt when ``b <
num_reduced_tp_dp_ranks``, and that the active local ranks of block ``b`` are
those of key ``(b, 0, 0)`` (or, without that key, the first ``tp_base -
tp_spares``). :func:`export_megatron` writes what those functions read, in
their types, and the files a launcher needs (``docs/export.md``):

``ntp_config.py``
    Builds the ``NonuniformTPConfig`` (tuple keys); nothing else.
``megatron-args.txt``
    The Megatron-LM flags the layout needs (parallel sizes, rank order,
    global batch).
``ranks.txt``
    One line per global rank: host, device index, GPU, coordinates, power.
``slurm-hostfile``, ``bind.sh``, ``gpu-uuids.txt``
    ``SLURM_HOSTFILE`` for ``srun --distribution=arbitrary`` and the per-rank
    wrapper that sets ``CUDA_VISIBLE_DEVICES`` (also used under torchrun): the
    GPU's UUID from ``gpu-uuids.txt`` (written when the instance has UUIDs), else
    its index with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
``torchrun-hosts.tsv``, ``torchrun.sh``
    Per-host node rank, process count and first rank (only when every host's
    ranks are contiguous; otherwise :attr:`Export.torchrun_note` says why).
``power-limits.sh``, ``power-restore.sh``
    Per host, ``nvidia-smi -i INDEX -pl WATTS`` for the boosted GPUs and back.
``ntp-opt-extras.json``
    Everything Megatron does not read (local batch, power, sizes, metrics).
``LAUNCH.md``
    The launch recipe with this export's numbers.

:func:`write_launch_set` writes such a set all at once (staged and
fsynced, then committed by renames that are undone on any error; the user's
own files in the target are left alone). Only whitelisted
names (:data:`HOST_RE`, :data:`ID_RE`) reach the scripts and tables;
``ntp_config.py`` holds integers only and ``LAUNCH.md`` shows the instance
name through :func:`md_code`.

Layout. The rank order is Megatron's ``tp-cp-ep-pp-dp`` (``--use-tp-pp-dp-mapping``;
for PP = 1 it equals the default ``tp-cp-ep-dp-pp``): ``rank = tp + T * (pp +
PP * dp)``. Replica ``r`` of the plan is DP rank ``r`` (reduced replicas first),
its stage ``k`` is PP rank ``k`` and occupies block ``k + PP * r``; the stage's
GPUs are its local ranks ``0 .. t-1`` and ``t .. T-1`` are inactive. So the
reduced stages are exactly blocks ``0 .. PP * n_reduced - 1``, which is what
the helper rebuilds when ``num_reduced_tp_dp_ranks = PP * n_reduced``; every
reduced ``(dp, 0, pp)`` is a key of ``non_active_ranks_per_dp`` (the runtime's
per-rank checks use the real coordinates), and the inactive local ranks are
always the last ``tp_spares``, so blocks whose ``(b, 0, 0)`` key names another
replica's stage still get the right active ranks.

Inactive ranks must be launched (the world is ``DP * PP * T`` ranks; they exit
once the groups exist). Each gets a healthy GPU of its own that no active rank
uses, on any host of the cluster; the ``placeholder_hosts`` the caller names
only when those are too few or when they keep every host's ranks contiguous;
without enough of them the export is refused. The placement keeps each host's
ranks contiguous whenever it can (torchrun); otherwise
:attr:`Export.torchrun_note` says which host breaks it and why.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import signal
import stat
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ntp_opt.model.files import InputError
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.model.safeio import UnsafeTargetError, check_target
from ntp_opt.planners.megatron import (
    MegatronError,
    launch_batch,
    megatron_compatible,
    megatron_order,
)
from ntp_opt.rules.validate import Violation, check, evaluate

#: ``format`` of the sidecar file.
EXTRAS_FORMAT = "ntp-opt/megatron-extras@1"
#: Megatron-LM's rank order (``initialize_model_parallel(order=...)``) the export follows.
RANK_ORDER = "tp-cp-ep-pp-dp"
#: File names written by :func:`export_megatron`.
CONFIG_NAME = "ntp_config.py"
EXTRAS_NAME = "ntp-opt-extras.json"
ARGS_NAME = "megatron-args.txt"
RANKS_NAME = "ranks.txt"
HOSTFILE_NAME = "slurm-hostfile"
BIND_NAME = "bind.sh"
TORCHRUN_HOSTS_NAME = "torchrun-hosts.tsv"
TORCHRUN_NAME = "torchrun.sh"
POWER_SET_NAME = "power-limits.sh"
POWER_RESTORE_NAME = "power-restore.sh"
LAUNCH_NAME = "LAUNCH.md"
#: Columns of the rank file, in order.
COLUMNS = (
    "rank",
    "host",
    "device",
    "gpu",
    "domain",
    "dp",
    "pp",
    "tp",
    "active",
    "power",
    "power_w",
)
#: Names a host may have in the generated files (no shell or file-format metacharacters).
HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: Node ids (GPUs, domains) the rank file may name: also ``host:gpu0`` and ``block/nvlink``
#: as ``ntp-opt import`` writes them; no whitespace, quotes or shell metacharacters.
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]*")

__all__ = [
    "COLUMNS",
    "EXTRAS_FORMAT",
    "Export",
    "MegatronError",
    "RankRow",
    "equal_batch",
    "export_megatron",
    "gpu_hosts",
    "import_megatron",
    "megatron_compatible",
    "megatron_export",
    "megatron_order",
    "power_commands",
    "write_launch_set",
]


@dataclass(frozen=True)
class RankRow:
    """One global rank of the Megatron world.

    Attributes
    ----------
    rank
        Global rank.
    host
        Host name the process runs on.
    device
        CUDA device index on that host (``nvidia-smi -i``, ``CUDA_VISIBLE_DEVICES``).
    gpu
        Node id of the GPU, or ``None`` for a placeholder on a host outside the cluster.
    domain
        Node id of the GPU's NVLink domain (``None`` outside the cluster).
    dp, pp, tp
        Data-parallel, pipeline and local tensor-parallel rank.
    active
        The rank computes; inactive (placeholder) ranks exit after process-group set-up.
    power
        Power multiplier of an active rank (``None`` for placeholders).
    power_w
        The power limit to set, whole watts (``None`` for placeholders).
    """

    rank: int
    host: str
    device: int
    gpu: Hashable | None
    domain: Hashable | None
    dp: int
    pp: int
    tp: int
    active: bool
    power: float | None
    power_w: int | None

    def line(self) -> str:
        """The row as one line of the rank file."""
        cells = [
            self.rank,
            self.host,
            self.device,
            "-" if self.gpu is None else self.gpu,
            "-" if self.domain is None else self.domain,
            self.dp,
            self.pp,
            self.tp,
            int(self.active),
            "-" if self.power is None else repr(self.power),
            "-" if self.power_w is None else self.power_w,
        ]
        return " ".join(str(c) for c in cells)

    def as_dict(self) -> dict[str, Any]:
        """The row as a JSON object (keys :data:`COLUMNS`)."""
        return {c: getattr(self, c) for c in COLUMNS}


@dataclass
class Export:
    """Everything :func:`export_megatron` writes, before it is written.

    Attributes
    ----------
    ntp_kwargs
        Keyword arguments of ``NonuniformTPConfig`` (tuple keys).
    megatron_args
        Megatron-LM command-line flags the layout needs.
    rows
        One :class:`RankRow` per global rank, in rank order.
    extras
        The sidecar (JSON-ready): what Megatron does not read.
    torchrun_hosts
        ``(node_rank, host, nproc, first_rank)`` per host, or ``None`` when
        some host's ranks are not contiguous.
    torchrun_note
        Why there is no torchrun variant (empty when there is one).
    files
        File name -> text of every file to write.
    """

    ntp_kwargs: dict[str, Any]
    megatron_args: list[str]
    rows: list[RankRow]
    extras: dict[str, Any]
    torchrun_hosts: list[tuple[int, str, int, int]] | None
    torchrun_note: str
    files: dict[str, str] = field(default_factory=dict)

    def config_json(self) -> dict[str, Any]:
        """``ntp_kwargs`` for JSON: the tuple keys become ``"dp,cp,pp"`` strings."""
        na = self.ntp_kwargs["non_active_ranks_per_dp"]
        return {
            **self.ntp_kwargs,
            "non_active_ranks_per_dp": None
            if na is None
            else {",".join(map(str, k)): v for k, v in na.items()},
        }


def gpu_hosts(instance: Instance) -> tuple[list[str], np.ndarray]:
    """Host name and device index of every GPU (graph order).

    The host is the GPU's ``host`` attribute, else its tray's ``host``
    attribute, else the tray's node id. The device index is the GPU's
    ``index`` attribute, else its position in its tray (graph order).

    Parameters
    ----------
    instance
        The instance.

    Returns
    -------
    tuple
        Host names (one per GPU) and device indices (int array).

    Raises
    ------
    MegatronError
        When a host name is unusable in a launcher file or two GPUs share a
        host and device index.
    """
    a = instance.arrays
    g = instance.cluster
    hosts: list[str] = []
    device = np.zeros(a.n_gpus, dtype=np.int64)
    count: dict[int, int] = {}
    seen: dict[tuple[str, int], Hashable] = {}
    problems: list[Violation] = []
    for i, gid in enumerate(a.gpu_ids):
        tray = a.tray_ids[a.gpu_tray[i]]
        attrs = g.nodes[gid]
        host = attrs.get("host") or g.nodes[tray].get("host") or str(tray)
        pos = count.get(int(a.gpu_tray[i]), 0)
        count[int(a.gpu_tray[i])] = pos + 1
        index = attrs.get("index")
        try:
            dev = pos if index is None else int(index)
        except (TypeError, ValueError):
            dev = -1
        if dev < 0:
            problems.append(
                Violation("megatron-hosts", f"GPU {gid!r}: device index {index!r} is not >= 0")
            )
        if not HOST_RE.fullmatch(str(host)):
            problems.append(
                Violation(
                    "megatron-hosts", f"GPU {gid!r}: host name {host!r} is not [A-Za-z0-9._-]"
                )
            )
        if (str(host), dev) in seen:
            problems.append(
                Violation(
                    "megatron-hosts",
                    f"GPUs {seen[(str(host), dev)]!r} and {gid!r} are both device {dev} of "
                    f"host {host!r}",
                )
            )
        seen[(str(host), dev)] = gid
        hosts.append(str(host))
        device[i] = dev
    if problems:
        raise MegatronError(problems)
    return hosts, device


def power_watts(instance: Instance, gpu: int, power: float) -> int:
    """The power limit of GPU index ``gpu`` at multiplier ``power``, whole watts.

    ``floor(power * tdp_w)``, never above the GPU's ``max_power_w`` attribute
    when it has one.
    """
    a = instance.arrays
    watts = math.floor(float(a.tdp[gpu]) * float(power) + 1e-9)
    cap = instance.cluster.nodes[a.gpu_ids[gpu]].get("max_power_w")
    if cap is not None:
        watts = min(watts, math.floor(float(cap)))
    return int(watts)


def _active_row(
    instance: Instance,
    hosts: list[str],
    device: np.ndarray,
    i: int,
    stage: Stage,
    rank: int,
    dp: int,
    pp: int,
    tp: int,
) -> RankRow:
    """The rank row of GPU index ``i`` computing local rank ``tp`` of ``stage`` (dp, pp)."""
    return RankRow(
        rank=rank,
        host=hosts[i],
        device=int(device[i]),
        gpu=instance.arrays.gpu_ids[i],
        domain=stage.domain,
        dp=dp,
        pp=pp,
        tp=tp,
        active=True,
        power=float(stage.power),
        power_w=power_watts(instance, i, stage.power),
    )


def _stage_order(
    gpus: Sequence[int],
    hosts: list[str],
    device: np.ndarray,
    prev: set[str],
    nxt: set[str],
    spare: set[str] | None = None,
) -> list[int]:
    """A stage's GPUs in local-rank order: grouped by host, each host's GPUs by device.

    Hosts shared with the previous block come first and hosts shared with the
    next block last, so that a host shared by consecutive blocks holds
    consecutive ranks; among the others, hosts in ``spare`` (with a free
    healthy GPU) go last, so that the block's inactive ranks, which follow
    its last active rank, can stay on the same host.
    """
    first: dict[str, int] = {}
    for i in gpus:
        first.setdefault(hosts[i], i)

    def key(i: int) -> tuple[int, int, int, int]:
        h = hosts[i]
        side = 0 if h in prev else (2 if h in nxt else 1)
        return (side, int(side == 1 and spare is not None and h in spare), first[h], int(device[i]))

    return sorted(gpus, key=key)


def _free_slots(
    instance: Instance, used: np.ndarray, hosts: list[str], device: np.ndarray
) -> dict[str, list[tuple[int, int | None]]]:
    """Healthy GPUs no active rank uses, per host (hosts in graph order): ``(device, index)``."""
    a = instance.arrays
    out: dict[str, list[tuple[int, int | None]]] = {}
    for i in np.flatnonzero(a.healthy & ~used).tolist():
        out.setdefault(hosts[i], []).append((int(device[i]), i))
    for v in out.values():
        v.sort(key=lambda x: x[0])
    return out


def equal_batch(instance: Instance, plan: Plan, *, iterations: int = 50) -> Plan:
    """The same placement with one local batch for every replica, power re-balanced.

    Megatron-LM gives every DP rank the same local batch ``b``. With one ``b``
    the step time is ``b / min_r v_r`` (times the resharding overhead), so the
    goodput ``R b / theta`` no longer depends on ``b`` but only on the slowest
    replica: ``b`` is :func:`ntp_opt.megatron.launch_batch` (``elastic``: the
    largest multiple of ``micro_batch`` up to ``min(max_local_batch, B // R)``;
    ``fixed``: ``B / R``, which must divide, fit and be such a multiple), and the power
    multipliers are re-chosen to maximise the slowest replica's speed: the
    largest target speed (bisection, ``iterations`` steps) whose required
    multipliers -- per stage the smallest ``pi >= 1`` reaching it, within
    ``1 + max_boost`` and every GPU's ``max_power_w`` -- pass the validator's
    rack and site budgets. If that is not better than keeping the plan's
    multipliers, they are kept.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan that passes the validator.
    iterations
        Bisection steps on the target speed.

    Returns
    -------
    Plan
        The plan with equal local batches, metrics from the validator and
        ``policy`` suffixed ``+equal-batch``.

    Raises
    ------
    MegatronError
        When no equal local batch fits.
    ntp_opt.validate.PlanError
        If the plan breaks a rule of the model.
    """
    check(instance, plan)
    job = instance.job
    n = len(plan.replicas)
    if n == 0 or len({r.local_batch for r in plan.replicas}) == 1:
        return plan
    equal = launch_batch(job, n)
    if equal is None:
        raise MegatronError(
            [
                Violation(
                    "megatron-batch",
                    f"the {job.batch_policy} global batch {job.global_batch} cannot be split "
                    f"equally over {n} replicas with at most {job.local_batch_max} each, "
                    f"a multiple of micro_batch {job.micro_batch}",
                )
            ]
        )
    b = equal
    policy = f"{plan.metrics.get('policy', 'plan')}+equal-batch"
    kept = Plan(plan.instance, tuple(replace(r, local_batch=b) for r in plan.replicas), {})
    best = kept.with_metrics(**check(instance, kept).as_metrics())
    a = instance.arrays
    alpha = job.power_exponent
    # per stage: relative speed at pi = 1 and the largest multiplier its GPUs accept
    base: list[list[float]] = []
    cap: list[list[float]] = []
    for rep in plan.replicas:
        base.append([])
        cap.append([])
        for st in rep.stages:
            idx = [a.gpu_index[g] for g in st.gpus]
            base[-1].append(job.tp_factor(rep.tp) * min(float(a.speed[i]) for i in idx))
            top = 1.0 + job.max_boost
            for i in idx:
                mx = instance.cluster.nodes[a.gpu_ids[i]].get("max_power_w")
                if mx is not None:
                    top = min(top, float(mx) / float(a.tdp[i]))
            cap[-1].append(max(1.0, top))

    def at(target: float) -> Plan | None:
        reps = []
        for r, rep in enumerate(plan.replicas):
            stages = []
            for k, st in enumerate(rep.stages):
                need = max(1.0, (target / base[r][k]) ** (1.0 / alpha)) if base[r][k] > 0 else 1.0
                if need > cap[r][k] * (1 + 1e-12):
                    return None
                stages.append(replace(st, power=min(need, cap[r][k])))
            reps.append(replace(rep, local_batch=b, stages=tuple(stages)))
        cand = Plan(plan.instance, tuple(reps), {})
        ev = evaluate(instance, cand)
        return cand.with_metrics(**ev.as_metrics()) if ev.feasible else None

    lo = min(min(s) for s in base)  # everyone at pi = 1
    hi = max(
        max(x * c**alpha for x, c in zip(s, cs, strict=True))
        for s, cs in zip(base, cap, strict=True)
    )
    low_plan = at(lo)
    if low_plan is not None:
        found = low_plan
        for _ in range(iterations):
            mid = (lo + hi) / 2
            cand = at(mid)
            if cand is None:
                hi = mid
            else:
                lo, found = mid, cand
        if found.metrics["goodput"] > best.metrics["goodput"]:
            best = found
    return best.with_metrics(policy=policy)


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
    ntp_opt.validate.PlanError
        If the plan breaks a rule of the model (a plan for another instance included).
    MegatronError
        If Megatron-LM cannot run it as it is; the message names the limitation.
    """
    plan = _exportable(instance, plan, reorder, placeholder_hosts, placeholder_gpus)
    job = instance.job
    big_t, n_pp, n_dp = job.tp, job.pp, len(plan.replicas)
    hosts, device = gpu_hosts(instance)
    rows, placeholders = _active_rows(instance, plan, hosts, device)
    rows += _placeholder_rows(
        instance, plan, rows, placeholders, hosts, device, placeholder_hosts, placeholder_gpus
    )
    rows.sort(key=lambda row: row.rank)
    assert [row.rank for row in rows] == list(range(n_dp * n_pp * big_t))
    torchrun_hosts, note = _torchrun_hosts(rows)
    extras = _extras(plan, n_pp, big_t, sum(n for _, n, _ in placeholders), torchrun_hosts, note)
    ex = Export(
        _ntp_kwargs(plan, big_t, n_pp),
        _megatron_args(plan, n_pp, big_t, job.micro_batch),
        rows,
        extras,
        torchrun_hosts,
        note,
    )
    ex.files = _files(instance, ex)
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


def _active_rows(
    instance: Instance, plan: Plan, hosts: list[str], device: np.ndarray
) -> tuple[list[RankRow], list[tuple[int, int, int]]]:
    """The rows of the active ranks, and ``(first rank, length, block)`` of every inactive run."""
    a = instance.arrays
    big_t, n_pp = instance.job.tp, instance.job.pp
    stage_gpus = [[a.gpu_index[g] for g in st.gpus] for rep in plan.replicas for st in rep.stages]
    stage_hosts = [{hosts[i] for i in s} for s in stage_gpus]
    used = np.zeros(a.n_gpus, dtype=bool)
    for s in stage_gpus:
        used[s] = True
    spare = {hosts[i] for i in np.flatnonzero(a.healthy & ~used).tolist()}
    rows: list[RankRow] = []
    placeholders: list[tuple[int, int, int]] = []  # (first rank, length, block)
    for r, rep in enumerate(plan.replicas):
        for k, st in enumerate(rep.stages):
            b = k + n_pp * r
            prev = stage_hosts[b - 1] if b > 0 else set()
            nxt = stage_hosts[b + 1] if b + 1 < len(stage_hosts) else set()
            order = _stage_order(stage_gpus[b], hosts, device, prev, nxt, spare)
            for j, i in enumerate(order):
                rows.append(_active_row(instance, hosts, device, i, st, b * big_t + j, r, k, j))
            if rep.tp < big_t:
                placeholders.append((b * big_t + rep.tp, big_t - rep.tp, b))
    return rows, placeholders


class _Hosts:
    """Ranks placed so far per host (span and count) and the free GPU slots left."""

    def __init__(self, free: dict[str, list[tuple[int, int | None]]]) -> None:
        self.free = free
        self.lo: dict[str, int] = {}
        self.hi: dict[str, int] = {}
        self.count: dict[str, int] = {}

    def add_rank(self, host: str, rank: int) -> None:
        self.lo[host] = min(self.lo.get(host, rank), rank)
        self.hi[host] = max(self.hi.get(host, rank), rank)
        self.count[host] = self.count.get(host, 0) + 1

    def gaps(self, host: str) -> int:
        n = self.count.get(host, 0)
        return self.hi[host] - self.lo[host] + 1 - n if n else 0

    def keeps_contiguous(self, host: str, x: int, y: int) -> bool:
        """Placing ranks ``x .. y-1`` on ``host`` adds no gap to its ranks."""
        n = self.count.get(host, 0)
        if n == 0:
            return True
        lo, hi = min(self.lo[host], x), max(self.hi[host], y - 1)
        return hi - lo + 1 - (n + y - x) <= self.gaps(host)

    def place(self, host: str, x: int, y: int) -> list[tuple[int, str, int, int | None]]:
        """Ranks ``x .. y-1`` on the first free devices of ``host``."""
        out = []
        for r in range(x, y):
            dev, gi = self.free[host].pop(0)
            self.add_rank(host, r)
            out.append((r, host, dev, gi))
        return out


def _place_runs(
    active: list[RankRow],
    runs: list[tuple[int, int, int]],
    free: dict[str, list[tuple[int, int | None]]],
    cluster_hosts: set[str],
    world: int,
) -> tuple[list[tuple[int, str, int, int | None]], bool] | None:
    """Ranks of the inactive ``runs`` on the ``free`` slots: ``(rank, host, device, GPU)``.

    Each block's run goes, while the host keeps one contiguous run of ranks,
    first to the host of the block's last active rank, its end to the host of
    the next block's first rank, the rest to hosts without any rank (the
    smallest that takes it whole; cluster hosts first); what is left takes any
    free slot (cluster hosts first). Returns the placement and whether every
    host's ranks are contiguous, or ``None`` when the slots are too few.
    """
    state = _Hosts(free)
    host_of: dict[int, str] = {}
    for row in active:
        state.add_rank(row.host, row.rank)
        host_of[row.rank] = row.host
    fresh: list[dict[int, list[str]]] = [{}, {}]  # by free slots: cluster hosts, named hosts
    for h, slots in free.items():
        if slots and h not in state.count:
            fresh[h not in cluster_hosts].setdefault(len(slots), []).append(h)

    def take_fresh(length: int) -> str | None:
        for tier in fresh:
            if tier:
                fits = [c for c in tier if c >= length]
                c = min(fits) if fits else max(tier)
                h = tier[c].pop(0)
                if not tier[c]:
                    del tier[c]
                return h
        return None

    placed: list[tuple[int, str, int, int | None]] = []
    deferred: list[int] = []
    for first, n, _ in runs:
        x, y = first, first + n
        h1 = host_of[x - 1]  # the block's last active rank
        p = min(len(free.get(h1, ())), y - x)
        if p and state.keeps_contiguous(h1, x, x + p):
            placed += state.place(h1, x, x + p)
            x += p
        h2 = host_of.get(y) if y < world else None  # the next block's first rank
        if x < y and h2 is not None:
            q = min(len(free.get(h2, ())), y - x)
            if q and state.keeps_contiguous(h2, y - q, y):
                placed += state.place(h2, y - q, y)
                y -= q
        while x < y:
            fresh_host = take_fresh(y - x)
            if fresh_host is None:
                deferred += range(x, y)
                break
            k = min(len(free[fresh_host]), y - x)
            placed += state.place(fresh_host, x, x + k)
            x += k
    order = [h for h in free if h in cluster_hosts] + [h for h in free if h not in cluster_hosts]
    leftover = [(h, slot) for h in order for slot in free[h]]
    if len(leftover) < len(deferred):
        return None
    for r, (h, (dev, gi)) in zip(deferred, leftover, strict=False):
        free[h].remove((dev, gi))
        state.add_rank(h, r)
        placed.append((r, h, dev, gi))
    return placed, all(state.gaps(h) == 0 for h in state.count)


def _placeholder_rows(
    instance: Instance,
    plan: Plan,
    active: list[RankRow],
    placeholders: list[tuple[int, int, int]],
    hosts: list[str],
    device: np.ndarray,
    placeholder_hosts: Sequence[str],
    placeholder_gpus: int | None,
) -> list[RankRow]:
    """The rows of the inactive ranks, each on a healthy GPU no other rank uses.

    Slots: the healthy GPUs no active rank uses, on any host of the cluster
    (:func:`_place_runs`). The named placeholder hosts are used only when those
    are too few, or when with them every host's ranks are contiguous
    (torchrun) and without them not.
    """
    a = instance.arrays
    big_t, n_pp, n_dp = instance.job.tp, instance.job.pp, len(plan.replicas)
    used_hosts = {row.host for row in active}
    if bad := sorted(set(placeholder_hosts) & used_hosts):
        raise MegatronError(
            [Violation("megatron-hosts", f"placeholder hosts {bad[:3]} run active ranks")]
        )
    used = np.zeros(a.n_gpus, dtype=bool)
    for row in active:
        used[a.gpu_index[row.gpu]] = True
    free = _free_slots(instance, used, hosts, device)
    cluster_free = sum(len(v) for v in free.values())
    need = sum(n for _, n, _ in placeholders)
    cluster_hosts = set(hosts)
    extra_hosts = list(dict.fromkeys(h for h in placeholder_hosts if h not in cluster_hosts))
    per_host = max(np.bincount(a.gpu_tray).max(initial=1), 1)
    n_extra = int(placeholder_gpus if placeholder_gpus is not None else per_host)
    world = n_dp * n_pp * big_t
    best = None
    for with_named in (False, True):
        if with_named and not extra_hosts:
            break
        slots = {h: list(v) for h, v in free.items()}
        if with_named:
            slots.update({h: [(d, None) for d in range(n_extra)] for h in extra_hosts})
        found = _place_runs(active, placeholders, slots, cluster_hosts, world)
        if found is not None and (best is None or found[1]):
            best = found
        if best is not None and best[1]:
            break
    if best is None:
        n_reduced = sum(rep.tp < big_t for rep in plan.replicas)
        extra = len(extra_hosts) * n_extra
        raise MegatronError(
            [
                Violation(
                    "megatron-placeholders",
                    f"Megatron's helper launches all {world} ranks of the nominal world "
                    f"(dp {n_dp} x pp {n_pp} x tp_base {big_t}); the {need} inactive ranks "
                    f"of the {n_reduced} reduced replicas (tp_spares {_spares(plan, big_t)} "
                    "per stage) each need a healthy GPU of their own, and the cluster has "
                    f"{cluster_free} healthy GPUs no active rank uses"
                    + (f" plus {extra} on the named placeholder hosts" if extra else "")
                    + ": name (more) extra hosts with --placeholder-hosts",
                )
            ]
        )
    rows = []
    for r, h, dev, gi in best[0]:
        b, tp = divmod(r, big_t)
        dp, pp = divmod(b, n_pp)
        rows.append(
            RankRow(
                rank=r,
                host=h,
                device=dev,
                gpu=None if gi is None else a.gpu_ids[gi],
                domain=None if gi is None else a.domain_ids[a.gpu_domain[gi]],
                dp=dp,
                pp=pp,
                tp=tp,
                active=False,
                power=None,
                power_w=None,
            )
        )
    return rows


def _spares(plan: Plan, big_t: int) -> int:
    """``tp_spares``: inactive ranks per stage of a reduced replica (0 when none is reduced)."""
    reduced = [r for r in plan.replicas if r.tp < big_t]
    return big_t - (reduced[0].tp if reduced else big_t)


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
        "tp_spares": _spares(plan, big_t),
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


def _torchrun_hosts(rows: list[RankRow]) -> tuple[list[tuple[int, str, int, int]] | None, str]:
    """Per host ``(node_rank, host, nproc, first_rank)`` if every host's ranks are contiguous.

    Otherwise ``None`` and why: the first host whose ranks have gaps, what it
    runs, and how many hosts are like it.
    """
    spans: dict[str, list[RankRow]] = {}
    for row in rows:
        spans.setdefault(row.host, []).append(row)
    broken = [h for h, rs in spans.items() if rs[-1].rank - rs[0].rank + 1 != len(rs)]
    if broken:
        host = broken[0]
        rs = spans[host]
        blocks = list(dict.fromkeys((row.dp, row.pp) for row in rs))
        inactive = list(dict.fromkeys((row.dp, row.pp) for row in rs if not row.active))
        named = ", ".join(f"dp={d} pp={p}" for d, p in blocks[:4])
        if inactive:
            why = (
                f"it runs ranks of {len(blocks)} TP groups ({named}"
                f"{', ...' if len(blocks) > 4 else ''}), "
                "inactive ranks among them: not enough free healthy GPUs next to their "
                "groups (on the host of the group's last active rank, the host of the next "
                "group's first rank, or a host running no rank) to keep every host's ranks "
                "in one run"
            )
        else:
            why = (
                f"its GPUs serve TP groups {named} that are not neighbours in the rank "
                "order (rank = tp + tp_base * (pp + PP * dp))"
            )
        more = f" ({len(broken) - 1} more hosts like it)" if len(broken) > 1 else ""
        return None, (
            f"no torchrun variant: host {host} holds ranks {rs[0].rank}..{rs[-1].rank} with "
            f"gaps{more}; {why}. torchrun numbers each host's ranks contiguously; launch with "
            "srun (slurm-hostfile)"
        )
    out = sorted((rs[0].rank, h, len(rs)) for h, rs in spans.items())
    return [(n, h, c, f) for n, (f, h, c) in enumerate(out)], ""


def power_commands(rows: Sequence[RankRow], restore: bool, tdp: dict[tuple[str, int], int]) -> str:
    """The power-limit script: per host, ``nvidia-smi -i INDEX -pl WATTS`` lines.

    Parameters
    ----------
    rows
        The rank table.
    restore
        Write the commands restoring the nominal limits instead.
    tdp
        Nominal limit (whole watts) per ``(host, device)``.

    Returns
    -------
    str
        A shell script with one ``case`` branch per host that has a boosted GPU.
    """
    by_host: dict[str, list[tuple[int, int]]] = {}
    for row in rows:
        if not row.active or row.power is None or row.power <= 1.0 or row.power_w is None:
            continue
        nominal = tdp[(row.host, row.device)]
        if row.power_w <= nominal:
            continue
        watts = nominal if restore else row.power_w
        by_host.setdefault(row.host, []).append((row.device, watts))
    what = "restore the nominal power limits" if restore else "set the boosted power limits"
    lines = [
        "#!/bin/sh",
        f"# Written by ntp-opt: {what}. Run once on every host (as root), for example",
        "#   srun --ntasks-per-node=1 sh " + (POWER_RESTORE_NAME if restore else POWER_SET_NAME),
        "set -e",
        'host="${NTP_HOST:-${SLURMD_NODENAME:-$(hostname -s)}}"',
        'case "$host" in',
    ]
    _check_rows(rows, ids=False)
    for host in sorted(by_host):
        lines.append(f"{host})")
        lines += [f"  nvidia-smi -i {int(d)} -pl {int(w)}" for d, w in sorted(by_host[host])]
        lines.append("  ;;")
    lines += ["*) ;;", "esac", ""]
    return "\n".join(lines)


def _config_module(ex: Export) -> str:
    """The text of ``ntp_config.py``: integers only, each written by ``int``; no names.

    Nothing of the instance (its name, node ids, hosts) reaches the module, so
    no name can break out of a docstring or a literal and run when the
    training script imports it.
    """
    kw = ex.ntp_kwargs
    lines = [
        '"""Megatron-LM NonuniformTPConfig for an ntp-opt plan (see ntp-opt-extras.json).',
        "",
        "Written by ntp-opt; the training script calls ntp_config() (see LAUNCH.md).",
        '"""',
        "",
        "NTP_CONFIG_KWARGS = {",
        f'    "tp_base": {int(kw["tp_base"])},',
        f'    "tp_spares": {int(kw["tp_spares"])},',
        f'    "num_reduced_tp_dp_ranks": {int(kw["num_reduced_tp_dp_ranks"])},',
    ]
    if kw["non_active_ranks_per_dp"] is None:
        lines.append('    "non_active_ranks_per_dp": None,')
    else:
        lines.append('    "non_active_ranks_per_dp": {')
        for key, v in kw["non_active_ranks_per_dp"].items():
            tup = ", ".join(str(int(x)) for x in key)
            lst = ", ".join(str(int(x)) for x in v)
            lines.append(f"        ({tup}): [{lst}],")
        lines.append("    },")
    lines += [
        "}",
        "",
        "",
        "def ntp_config():",
        '    """The NonuniformTPConfig to pass to initialize_nonuniform_tp_process_groups."""',
        "    from megatron.core.distributed.nonuniform_tp import NonuniformTPConfig",
        "",
        "    return NonuniformTPConfig(**NTP_CONFIG_KWARGS)",
        "",
    ]
    return "\n".join(lines)


def md_code(text: str) -> str:
    """``text`` as one Markdown inline code span that nothing in it can leave.

    Characters that are not printable (line breaks, U+2028/U+2029, NUL, other
    controls and format characters) are written as ``\\uXXXX`` escapes, so
    the span stays on one line and cannot open or close a fence; the span's
    backtick run is longer than any run of backticks inside.

    Parameters
    ----------
    text
        Any string (a user's instance name).

    Returns
    -------
    str
        The code span, backticks included.
    """
    shown = "".join(
        c if c.isprintable() else (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
        for c in text
    )
    runs = [len(m) for m in re.findall("`+", shown)]
    fence = "`" * (max(runs, default=0) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") or not shown.strip() else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


#: The data file of ``bind.sh``: ``host device uuid`` of every GPU of the rank file whose
#: UUID the instance knows (written only when there is one).
UUIDS_NAME = "gpu-uuids.txt"
#: What ``bind.sh`` accepts as a CUDA device UUID (``nvidia-smi -L``): ``GPU-<hex groups>``,
#: ``MIG-<hex groups>`` or the older ``MIG-GPU-<uuid>/<gi>/<ci>``; nothing a shell or
#: ``CUDA_VISIBLE_DEVICES`` (commas) would read otherwise.
UUID_RE = re.compile(r"(?:GPU|MIG)-[0-9A-Za-z-]+(?:/[0-9]+/[0-9]+)?")

BIND_SCRIPT = r"""#!/bin/sh
# Written by ntp-opt. Per-rank wrapper: sets RANK, WORLD_SIZE, LOCAL_RANK=0 and the
# rank's GPU from ranks.txt next to this script, checks that the process runs on
# the planned host, then runs the command.
#   srun:     SLURM_HOSTFILE=slurm-hostfile srun --distribution=arbitrary -n WORLD ./bind.sh CMD
#   torchrun: torchrun ... --no-python ./bind.sh CMD   (via torchrun.sh)
# The host is SLURMD_NODENAME under srun (the node name slurm-hostfile uses, also
# when several nodes share one machine), else NTP_HOST (torchrun.sh sets it), else
# `hostname -s`. CUDA_VISIBLE_DEVICES is the GPU's UUID when gpu-uuids.txt names
# it, else its device index; CUDA_DEVICE_ORDER=PCI_BUS_ID makes an index mean
# what it means to nvidia-smi (CUDA's default order is fastest first).
set -e
dir="$(cd "$(dirname "$0")" && pwd)"
if [ -n "${SLURM_PROCID:-}" ] && [ -z "${TORCHELASTIC_RUN_ID:-}" ]; then
  rank="$SLURM_PROCID"
  host="${SLURMD_NODENAME:-}"
  if [ -z "$host" ]; then echo "bind.sh: srun set no SLURMD_NODENAME" >&2; exit 1; fi
else
  host="${NTP_HOST:-$(hostname -s)}"
  first="$(awk -v h="$host" '$2 == h {print $4; exit}' "$dir/torchrun-hosts.tsv")"
  if [ -z "$first" ]; then echo "bind.sh: host $host is not in torchrun-hosts.tsv" >&2; exit 1; fi
  rank=$((first + ${LOCAL_RANK:?LOCAL_RANK not set}))
fi
line="$(awk -v r="$rank" '$1 == r {print $2, $3; exit}' "$dir/ranks.txt")"
want="${line% *}"
dev="${line#* }"
if [ -z "$line" ]; then echo "bind.sh: rank $rank is not in ranks.txt" >&2; exit 1; fi
if [ "$want" != "$host" ]; then
  echo "bind.sh: rank $rank runs on $host but is planned on $want" >&2
  exit 1
fi
if [ -n "${RANK:-}" ] && [ "$RANK" != "$rank" ]; then
  echo "bind.sh: warning: the launcher set RANK=$RANK, the plan says $rank; using $rank" >&2
fi
gpu="$dev"
if [ -f "$dir/gpu-uuids.txt" ]; then
  uuid="$(awk -v h="$want" -v d="$dev" '$1 == h && $2 == d {print $3; exit}' "$dir/gpu-uuids.txt")"
  case "$uuid" in
    "") ;;
    *[!A-Za-z0-9/-]*) echo "bind.sh: gpu-uuids.txt: bad UUID for $want device $dev" >&2; exit 1 ;;
    GPU-* | MIG-*) gpu="$uuid" ;;
    *) echo "bind.sh: gpu-uuids.txt: bad UUID for $want device $dev" >&2; exit 1 ;;
  esac
fi
export RANK="$rank" WORLD_SIZE="$(($(grep -vc '^#' "$dir/ranks.txt")))" LOCAL_RANK=0
export CUDA_VISIBLE_DEVICES="$gpu" CUDA_DEVICE_ORDER=PCI_BUS_ID
exec "$@"
"""


def _uuid_file(instance: Instance, rows: Sequence[RankRow]) -> str | None:
    """``gpu-uuids.txt``: ``host device uuid`` per GPU of ``rows`` with a UUID, or ``None``.

    Raises
    ------
    MegatronError
        When a UUID is not of the form :data:`UUID_RE` (it would reach a shell).
    """
    g = instance.cluster
    lines = []
    for row in rows:
        uuid = None if row.gpu is None else g.nodes[row.gpu].get("uuid")
        if uuid is None:
            continue
        if not isinstance(uuid, str) or not UUID_RE.fullmatch(uuid):
            raise MegatronError(
                [
                    Violation(
                        "megatron-uuids",
                        f"GPU {row.gpu}: uuid {str(uuid)[:80]!r} is not a CUDA device UUID "
                        "(GPU-... or MIG-..., letters, digits and '-')",
                    )
                ]
            )
        lines.append(f"{row.host} {row.device} {uuid}\n")
    return "".join(["# host device uuid\n", *lines]) if lines else None


def _torchrun_script(hosts: list[tuple[int, str, int, int]], world: int) -> str:
    return "\n".join(
        [
            "#!/bin/sh",
            "# Written by ntp-opt. Run on every host of torchrun-hosts.tsv (one process per host):",
            "#   MASTER_ADDR=<host of rank 0> MASTER_PORT=29500 ./torchrun.sh CMD ARGS...",
            "# Each host starts its own number of processes; bind.sh sets RANK = first rank",
            f"# of the host + LOCAL_RANK and WORLD_SIZE = {world}, and the device.",
            "set -e",
            'dir="$(cd "$(dirname "$0")" && pwd)"',
            'host="${NTP_HOST:-$(hostname -s)}"',
            'set -- "$dir/bind.sh" "$@"',
            'line="$(awk -v h="$host" \'$2 == h {print $1, $3; exit}\' "$dir/torchrun-hosts.tsv")"',
            'if [ -z "$line" ]; then echo "torchrun.sh: $host runs no rank" >&2; exit 0; fi',
            'export NTP_HOST="$host"',
            f'exec torchrun --nnodes={len(hosts)} --node-rank="${{line% *}}" '
            '--nproc-per-node="${line#* }" \\',
            '  --master-addr="${MASTER_ADDR:?}" --master-port="${MASTER_PORT:-29500}" '
            '--no-python "$@"',
            "",
        ]
    )


def _launch_md(ex: Export, instance_name: str) -> str:
    e = ex.extras
    world = e["world_size"]
    args = " ".join(ex.megatron_args)
    tr = (
        "./torchrun.sh python pretrain_gpt_ntp.py $(cat megatron-args.txt) ...   # on every host"
        if ex.torchrun_hosts is not None
        else f"(not available: {ex.torchrun_note})"
    )
    world_line = (
        f"World: {world} ranks = DP {e['data_parallel_size']} x PP "
        f"{e['pipeline_model_parallel_size']} x tp_base {e['tensor_model_parallel_size']}; "
        f"{e['reduced_replicas']} reduced replicas at TP "
        f"{e['tensor_model_parallel_size'] - ex.ntp_kwargs['tp_spares']}; "
        f"{e['placeholder_ranks']} placeholder ranks that exit after the process groups "
        "are built."
    )
    return f"""# Launching the ntp-opt plan of {md_code(instance_name)} with Megatron-LM NTP

{world_line}
Rank order `{RANK_ORDER}`: rank = tp + tp_base * (pp + PP * dp).

1. Training script: a copy of `pretrain_gpt.py` that, after
   `initialize_model_parallel`, runs (Megatron-LM
   `megatron/core/distributed/README_NONUNIFORM_TP.md`):

   ```python
   from ntp_config import ntp_config   # this directory on PYTHONPATH
   from megatron.core.distributed.nonuniform_tp import (
       NonuniformTPDistributedDataParallel, initialize_nonuniform_tp_process_groups,
       ntp_init, ntp_map)
   cfg = ntp_config()
   initialize_nonuniform_tp_process_groups(cfg)   # placeholder ranks exit here
   # after building the model: ntp_init(layer, cfg) per TransformerLayer,
   # ntp_map(embedding / output layer, cfg, vocab_size); wrap with
   # NonuniformTPDistributedDataParallel(..., ntp_config=cfg)
   ```

2. Megatron flags (`megatron-args.txt`): `{args}`, plus the model's flags
   (local batch {e["local_batch"]}).

3. Power (as root, before the job; `power-restore.sh` after it):
   `srun --ntasks-per-node=1 sh power-limits.sh`

4. Launch, Slurm:

   ```sh
   SLURM_HOSTFILE=slurm-hostfile srun --distribution=arbitrary --ntasks={world} \\
       ./bind.sh python pretrain_gpt_ntp.py $(cat megatron-args.txt) ...
   ```

   torchrun: {tr}

`ntp-opt-extras.json` holds what Megatron does not read (local batch, power,
metrics); `ranks.txt` is the rank -> host, device, GPU table.
"""


def _check_rows(rows: Sequence[RankRow], ids: bool = True) -> None:
    """Every host and id a launcher file would carry passes its whitelist (else refused).

    The last gate before text is generated: :data:`HOST_RE` for hosts, an int
    ``>= 0`` for devices, :data:`ID_RE` for GPU and domain ids (with ``ids``;
    the power scripts write no ids).
    """
    problems: list[Violation] = []
    for row in rows:
        if not (isinstance(row.host, str) and HOST_RE.fullmatch(row.host)):
            problems.append(
                Violation(
                    "megatron-hosts",
                    f"rank {row.rank}: host name {row.host!r} is not [A-Za-z0-9._-]",
                )
            )
        if not (isinstance(row.device, int) and row.device >= 0):
            problems.append(
                Violation(
                    "megatron-hosts", f"rank {row.rank}: device {row.device!r} is not an index"
                )
            )
        for node in (row.gpu, row.domain) if ids else ():
            if node is not None and not ID_RE.fullmatch(str(node)):
                problems.append(
                    Violation(
                        "megatron-ids", f"rank {row.rank}: node id {node!r} cannot be written"
                    )
                )
        if len(problems) >= 5:
            break
    if problems:
        raise MegatronError(problems)


def _files(instance: Instance, ex: Export) -> dict[str, str]:
    _check_rows(ex.rows)
    a = instance.arrays
    hosts, device = gpu_hosts(instance)
    tdp = {(hosts[i], int(device[i])): math.floor(float(a.tdp[i]) + 1e-9) for i in range(a.n_gpus)}
    name = str(ex.extras["instance"])
    files = {
        CONFIG_NAME: _config_module(ex),
        ARGS_NAME: " ".join(ex.megatron_args) + "\n",
        RANKS_NAME: "\n".join(["# " + " ".join(COLUMNS), *(row.line() for row in ex.rows)]) + "\n",
        HOSTFILE_NAME: "".join(f"{row.host}\n" for row in ex.rows),
        BIND_NAME: BIND_SCRIPT,
        POWER_SET_NAME: power_commands(ex.rows, False, tdp),
        POWER_RESTORE_NAME: power_commands(ex.rows, True, tdp),
        EXTRAS_NAME: json.dumps(ex.extras, indent=1, allow_nan=False) + "\n",
        LAUNCH_NAME: _launch_md(ex, name),
    }
    if (uuids := _uuid_file(instance, ex.rows)) is not None:
        files[UUIDS_NAME] = uuids
    if ex.torchrun_hosts is not None:
        files[TORCHRUN_HOSTS_NAME] = "".join(
            ["# node_rank host nproc first_rank\n"]
            + [f"{n} {h} {c} {f}\n" for n, h, c, f in ex.torchrun_hosts]
        )
        files[TORCHRUN_NAME] = _torchrun_script(ex.torchrun_hosts, len(ex.rows))
    return files


#: Every name :func:`export_megatron` may write (a directory holding the sidecar of an
#: export made before the manifest existed owns these).
LAUNCH_NAMES = (
    CONFIG_NAME,
    ARGS_NAME,
    RANKS_NAME,
    HOSTFILE_NAME,
    BIND_NAME,
    TORCHRUN_HOSTS_NAME,
    TORCHRUN_NAME,
    POWER_SET_NAME,
    POWER_RESTORE_NAME,
    EXTRAS_NAME,
    LAUNCH_NAME,
)
#: The manifest :func:`write_launch_set` leaves in the directory: the names it wrote.
MANIFEST_NAME = ".ntp-opt-export.json"
MANIFEST_FORMAT = "ntp-opt/launch-set@1"
#: A file name of a launch set: one plain name, no path, not hidden or special.
FILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Caps on the export's counts (checked before anything is built).
MAX_WORLD = 1 << 20
MAX_PLACEHOLDER_GPUS = 1024
MAX_PLACEHOLDER_HOSTS = 1 << 14


def _previous_names(out: Path) -> set[str] | None:
    """The names a previous export wrote into ``out`` (``None``: not an export).

    Its manifest's list, or for an export made before manifests existed (its
    sidecar is of :data:`EXTRAS_FORMAT`) :data:`LAUNCH_NAMES`.
    """
    try:
        data = json.loads(_read_small(out / MANIFEST_NAME))
    except FileNotFoundError:
        data = None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if data is not None:
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            return None
        names = data.get("files")
        if not isinstance(names, list):
            return None
        return {n for n in names if isinstance(n, str) and FILE_NAME_RE.fullmatch(n)}
    try:
        extras = json.loads(_read_small(out / EXTRAS_NAME))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(extras, dict) and extras.get("format") == EXTRAS_FORMAT:
        return set(LAUNCH_NAMES)
    return None


def _read_small(path: Path, limit: int = 1 << 20) -> str:
    """The text of a regular file of at most ``limit`` bytes (else ``OSError``)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, "too large for a manifest", str(path))
    return data.decode()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` (never existing: ``O_EXCL | O_NOFOLLOW``), write ``data``, fsync."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait while inside, then reach their handlers: the commit is whole.

    Python-level (the handlers are swapped for one that notes the signal,
    which is raised again on exit), so it holds whichever thread the kernel
    picks; only in the main thread (elsewhere no handler can be swapped).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def note(signum: int, frame: object) -> None:
        pending.append(signum)

    previous: dict[int, Any] = {}
    for held in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(held)
        if handler is None or handler == signal.SIG_IGN:
            continue
        previous[held] = handler
        signal.signal(held, note)
    try:
        yield
    finally:
        for num, handler in previous.items():
            signal.signal(num, handler)
        for num in dict.fromkeys(pending):
            signal.raise_signal(num)


def write_launch_set(
    files: dict[str, str],
    target_dir: str | os.PathLike[str],
    *,
    inputs: Sequence[str | os.PathLike[str]] = (),
    executable: Sequence[str] | None = None,
    prune: bool = True,
) -> list[str]:
    """Write a set of launch files into ``target_dir`` all at once, or not at all.

    Everything is checked before anything is touched, and every file is
    written and fsynced in a staging directory first: a new target is built
    beside it (``.NAME.RANDOM.tmp``) and renamed into place; in an existing
    target the staging directory is ``.ntp-opt-stage.RANDOM`` inside it, and
    the commit renames the old files out and the new ones in, with SIGINT and
    SIGTERM held (delivered after it) and undone in reverse on any error. An
    error (a full disk), Ctrl-C or SIGTERM therefore leaves the target as it
    was and no staging directory behind (only ``kill -9`` during the renames
    can leave a mix, with the old files in the staging directory). Replaced
    files keep their permission bits (scripts stay executable); the target
    directory itself is never replaced (its owner, group, mode stay).

    What happens to what is already in the target:

    - files a previous export wrote there (listed in its manifest,
      :data:`MANIFEST_NAME`; for an export made before the manifest,
      :data:`LAUNCH_NAMES` when its sidecar is of :data:`EXTRAS_FORMAT`) are
      replaced, or removed when the new set lacks them (``prune``);
    - everything else (the user's files and folders) is left alone;
    - refused, before anything is written: a name of the new set that
      exists but was not written by an export, is a symbolic link or a
      directory, or is one of ``inputs``; a target that is a symbolic link
      or not a directory.

    Parameters
    ----------
    files
        File name (plain, :data:`FILE_NAME_RE`) -> text (written as UTF-8).
    target_dir
        The directory (created when missing, with its parents).
    inputs
        Files the command read (never replaced).
    executable
        Names created with mode ``0o777`` minus the umask (default: the names
        ending in ``.sh``); the others get ``0o666`` minus the umask.
    prune
        Remove the previous export's files that ``files`` does not name
        (``False``: keep them; they stay in the manifest).

    Returns
    -------
    list of str
        The names written (the keys of ``files``).

    Raises
    ------
    UnsafeTargetError
        When the target or one of its entries must not be replaced (nothing
        is written).
    OSError
        When writing fails (disk full, no permission); it names the target,
        which is as it was.
    """
    out = Path(os.path.abspath(target_dir))
    names = list(files)
    for name in names:
        if not FILE_NAME_RE.fullmatch(name) or name == MANIFEST_NAME:
            raise ValueError(f"launch file name {name!r} is not a plain file name")
    runnable = {n for n in names if n.endswith(".sh")} if executable is None else set(executable)
    payload = {name: files[name].encode() for name in names}
    old_modes: dict[str, int] = {}
    stale: list[str] = []
    exists = os.path.lexists(out)
    if exists:
        st = os.lstat(out)
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeTargetError(out, "refusing to write: the directory is a symbolic link")
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeTargetError(out, "refusing to write: the path is not a directory")
        previous = (_previous_names(out) or set()) - {MANIFEST_NAME}
        for name in names:
            old = check_target(out / name, inputs)
            if old is None:
                continue
            if name not in previous:
                raise UnsafeTargetError(
                    out / name,
                    "refusing to replace a file that no previous export wrote here: "
                    "move it away or choose another output directory",
                )
            old_modes[name] = stat.S_IMODE(old.st_mode)
        for name in sorted(previous - set(names)):
            try:
                mode = os.lstat(out / name).st_mode
            except FileNotFoundError:
                continue
            if prune and stat.S_ISREG(mode):
                check_target(out / name, inputs)
                stale.append(name)
        kept = {n for n in previous - set(names) - set(stale) if os.path.lexists(out / n)}
        owned = sorted(set(names) | kept)
    else:
        owned = sorted(names)
    manifest = json.dumps({"format": MANIFEST_FORMAT, "files": owned}, indent=1) + "\n"
    stage: Path | None = None
    try:
        try:
            parent = out if exists else out.parent
            parent.mkdir(parents=True, exist_ok=True)
            prefix = ".ntp-opt-stage." if exists else f".{out.name}."
            suffix = "" if exists else ".tmp"
            while True:
                cand = parent / f"{prefix}{secrets.token_hex(6)}{suffix}"
                try:
                    os.mkdir(cand, 0o700 if exists else 0o777)
                    stage = cand
                    break
                except FileExistsError:
                    continue
            for name in names:
                _write_new(stage / name, payload[name], 0o777 if name in runnable else 0o666)
                if name in old_modes:  # a replaced file keeps its bits; scripts stay runnable
                    mode = old_modes[name]
                    if name in runnable:
                        mode |= (mode & 0o444) >> 2
                    os.chmod(stage / name, mode)
            _write_new(stage / MANIFEST_NAME, manifest.encode(), 0o666)
            _fsync_dir(stage)
            if exists:
                os.mkdir(stage / "old", 0o700)
        except OSError as err:
            raise OSError(err.errno, err.strerror or str(err), str(out)) from None
        with _signals_held():
            try:
                if exists:
                    _commit(out, stage, [*names, MANIFEST_NAME], stale)
                    shutil.rmtree(stage, ignore_errors=True)  # now the old files
                else:
                    os.rename(stage, out)
            except OSError as err:
                raise OSError(err.errno, err.strerror or str(err), str(out)) from None
            stage = None
            with contextlib.suppress(OSError):
                _fsync_dir(out if exists else out.parent)
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    return names


def _commit(out: Path, stage: Path, names: list[str], stale: list[str]) -> None:
    """Move ``stage``'s files into ``out`` (old ones to ``stage/old``); undo all on error."""
    done: list[tuple[Path, Path]] = []  # renames made, (from, to), undone in reverse
    try:
        for name in [*names, *stale]:
            if os.path.lexists(out / name):
                os.rename(out / name, stage / "old" / name)
                done.append((out / name, stage / "old" / name))
            if name in stale:
                continue
            os.rename(stage / name, out / name)
            done.append((stage / name, out / name))
    except BaseException:
        for src, dst in reversed(done):
            with contextlib.suppress(OSError):
                os.rename(dst, src)
        raise


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
        objects of :mod:`ntp_opt.app.export_k8s`); its errors stop the export
        before any file is written.

    Returns
    -------
    Export
        What was written (``files`` names them).

    Raises
    ------
    ntp_opt.validate.PlanError, MegatronError
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


# --- reading an export back ------------------------------------------------------------


def read_config_module(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``NTP_CONFIG_KWARGS`` of an ``ntp_config.py``, read without running it.

    Raises
    ------
    InputError
        When the file is missing, not Python, or has no literal ``NTP_CONFIG_KWARGS``.
    """
    source = str(path)
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as err:
        raise InputError(source, [("", f"cannot read file: {err}")]) from None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "NTP_CONFIG_KWARGS"
        ):
            try:
                value = ast.literal_eval(node.value)
            except ValueError as err:
                raise InputError(source, [("NTP_CONFIG_KWARGS", f"not a literal: {err}")]) from None
            if isinstance(value, dict):
                return value
    raise InputError(source, [("NTP_CONFIG_KWARGS", "missing (not an ntp-opt export)")])


def _parse_rank_file(text: str, source: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    problems: list[tuple[str, str]] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        cells = line.split()
        if len(cells) != len(COLUMNS):
            problems.append((f"line {n}", f"{len(cells)} columns, expected {len(COLUMNS)}"))
            continue
        row: dict[str, Any] = dict(zip(COLUMNS, cells, strict=True))
        try:
            for c in ("rank", "device", "dp", "pp", "tp", "active"):
                row[c] = int(row[c])
            row["power"] = None if row["power"] == "-" else float(row["power"])
        except ValueError as err:
            problems.append((f"line {n}", f"not a number: {err}"))
            continue
        if row["active"] not in (0, 1):
            problems.append((f"line {n}", f"active must be 0 or 1, got {row['active']}"))
        if row["active"] and (
            row["power"] is None or not math.isfinite(row["power"]) or row["gpu"] == "-"
        ):
            problems.append((f"line {n}", "an active rank needs a GPU and a finite power"))
        row["line"] = n
        rows.append(row)
    if problems:
        raise InputError(source, problems)
    return rows


def import_megatron(path: str | os.PathLike[str], instance: Instance | None = None) -> Plan:
    """Rebuild a plan's replicas from an export (:func:`export_megatron`).

    Replica ``dp`` takes the sidecar's ``local_batch``; its stage ``pp`` takes
    the active ranks of ``(dp, pp)`` in local-rank order, their domain and
    power multiplier. Checked on the way: the rank numbering (``tp + tp_base
    (pp + PP dp)``), one row per rank, every TP group complete, the active
    ranks agreeing with ``ntp_config.py`` (the keys of
    ``non_active_ranks_per_dp`` and ``num_reduced_tp_dp_ranks = PP x reduced
    replicas``), one degree per replica, one domain and one power per stage.

    Parameters
    ----------
    path
        The export directory.
    instance
        The instance, to map node ids back to their type (a GPU id ``5``
        stays an integer); without it every id is a string.

    Returns
    -------
    Plan
        Metrics ``{"policy": "megatron-import"}``; judge it with
        :func:`ntp_opt.validate.evaluate`.

    Raises
    ------
    InputError
        Naming the file and the line or field of every inconsistency.
    """
    p = Path(path)
    extras_path = p / EXTRAS_NAME if p.is_dir() else p
    out_dir = extras_path.parent
    source = str(extras_path)
    extras = _read_sidecar(extras_path)
    csource = str(out_dir / CONFIG_NAME)
    kw = read_config_module(out_dir / CONFIG_NAME)
    try:
        big_t = int(kw["tp_base"])
        spares = int(kw["tp_spares"])
        n_blocks = int(kw["num_reduced_tp_dp_ranks"])
        non_active = {
            (int(key[0]), int(key[1]), int(key[2])): [int(x) for x in v]
            for key, v in (kw.get("non_active_ranks_per_dp") or {}).items()
        }
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise InputError(csource, [("", f"missing or malformed field: {err!r}")]) from None
    try:
        n_pp = int(extras["pipeline_model_parallel_size"])
        n_dp = int(extras["data_parallel_size"])
        batch = int(extras["local_batch"])
        name = str(extras["instance"])
    except (KeyError, TypeError, ValueError) as err:
        raise InputError(source, [("", f"missing or malformed field: {err!r}")]) from None
    if int(extras.get("tensor_model_parallel_size", big_t)) != big_t:
        raise InputError(source, [("tensor_model_parallel_size", f"differs from tp_base {big_t}")])
    ranks_path = out_dir / RANKS_NAME
    try:
        text = ranks_path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(str(ranks_path), [("", f"cannot read file: {err}")]) from None
    rsource = str(ranks_path)
    groups = _rank_groups(_parse_rank_file(text, rsource), n_dp, n_pp, big_t, rsource)
    n_reduced = len({dp for dp, _, _ in non_active})
    if n_blocks != n_reduced * n_pp:
        raise InputError(
            csource,
            [
                (
                    "num_reduced_tp_dp_ranks",
                    f"{n_blocks}, expected PP {n_pp} x {n_reduced} reduced replicas",
                )
            ],
        )
    problems: list[tuple[str, str]] = []
    node = _node_ids(instance, problems)
    replicas: list[Replica] = []
    for dp in range(n_dp):
        stages: list[Stage] = []
        degree = None
        for pp in range(n_pp):
            group = groups[(dp, pp)]
            inactive = sorted(tp for tp, row in group.items() if not row["active"])
            want = non_active.get((dp, 0, pp), [])
            if dp < n_reduced and len(want) != spares:
                problems.append((f"dp={dp} pp={pp}", f"{len(want)} inactive, tp_spares {spares}"))
            if inactive != sorted(want):
                problems.append(
                    (f"dp={dp} pp={pp}", f"inactive local ranks {inactive}, config says {want}")
                )
            active = [group[tp] for tp in range(big_t) if group[tp]["active"]]
            if degree is None:
                degree = len(active)
            elif len(active) != degree:
                problems.append(
                    (f"dp={dp} pp={pp}", f"{len(active)} active ranks, stage 0 has {degree}")
                )
            stage = _imported_stage(active, dp, pp, node, problems)
            if stage is not None:
                stages.append(stage)
        replicas.append(Replica(int(degree or 0), batch, tuple(stages)))
    if problems:
        raise InputError(rsource, problems)
    return Plan(name, tuple(replicas), {"policy": "megatron-import"})


def _read_sidecar(extras_path: Path) -> dict[str, Any]:
    """The export's sidecar JSON, checked to be of :data:`EXTRAS_FORMAT`."""
    source = str(extras_path)
    try:
        extras = json.loads(extras_path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(source, [("", f"cannot read file: {err}")]) from None
    except json.JSONDecodeError as err:
        raise InputError(source, [("", f"malformed JSON: {err}")]) from None
    if not isinstance(extras, dict) or extras.get("format") != EXTRAS_FORMAT:
        got = extras.get("format") if isinstance(extras, dict) else type(extras).__name__
        raise InputError(source, [("format", f"expected {EXTRAS_FORMAT!r}, got {got!r}")])
    return extras


def _rank_groups(
    rows: list[dict[str, Any]], n_dp: int, n_pp: int, big_t: int, rsource: str
) -> dict[tuple[int, int], dict[int, dict[str, Any]]]:
    """The rank file's rows by ``(dp, pp)`` and local rank, once the numbering checks out."""
    world = n_dp * n_pp * big_t
    problems: list[tuple[str, str]] = []
    if len(rows) != world:
        problems.append(("", f"{len(rows)} ranks, the world has {world}"))
    groups: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for row in rows:
        where = f"line {row['line']}"
        dp, pp, tp = row["dp"], row["pp"], row["tp"]
        if not (0 <= dp < n_dp and 0 <= pp < n_pp and 0 <= tp < big_t):
            problems.append((where, f"coordinates dp={dp} pp={pp} tp={tp} outside the world"))
            continue
        if row["rank"] != tp + big_t * (pp + n_pp * dp):
            problems.append(
                (where, f"rank {row['rank']} is not tp + tp_base * (pp + PP * dp) ({RANK_ORDER})")
            )
        group = groups.setdefault((dp, pp), {})
        if tp in group:
            problems.append((where, f"local rank {tp} of dp={dp} pp={pp} appears twice"))
        group[tp] = row
    if problems:
        raise InputError(rsource, problems)
    return groups


def _node_ids(
    instance: Instance | None, problems: list[tuple[str, str]]
) -> Callable[[str, str], Hashable]:
    """Maps a node id as written back to the instance's id (unknown ones go to ``problems``)."""
    ids: dict[str, Hashable] = {}
    if instance is not None:
        a = instance.arrays
        ids = {str(x): x for x in (*a.gpu_ids, *a.domain_ids)}

    def node(text: str, where: str) -> Hashable:
        if instance is None:
            return text
        if text not in ids:
            problems.append((where, f"{text!r} is not a GPU or domain of {instance.name!r}"))
        return ids.get(text, text)

    return node


def _imported_stage(
    active: list[dict[str, Any]],
    dp: int,
    pp: int,
    node: Callable[[str, str], Hashable],
    problems: list[tuple[str, str]],
) -> Stage | None:
    """The stage of the active rows of ``(dp, pp)``; None (and a problem) if they disagree."""
    domains = {row["domain"] for row in active}
    powers = {row["power"] for row in active}
    if len(domains) != 1 or len(powers) != 1:
        problems.append(
            (
                f"dp={dp} pp={pp}",
                f"active ranks span domains {sorted(domains)} or "
                f"powers {sorted(powers)}; a stage has one of each",
            )
        )
        return None
    where = f"line {active[0]['line']}"
    return Stage(
        node(active[0]["domain"], where),
        tuple(node(row["gpu"], f"line {row['line']}") for row in active),
        float(active[0]["power"]),
    )


def power_only(
    instance: Instance,
    plan: Plan,
    out_dir: str | os.PathLike[str],
    *,
    inputs: Sequence[str | os.PathLike[str]] = (),
) -> list[str]:
    """Write only ``power-limits.sh`` and ``power-restore.sh`` for any valid plan.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan that passes the validator (Megatron's restrictions do not apply).
    out_dir
        Output directory (created if missing).
    inputs
        Files the caller read (never overwritten).

    Returns
    -------
    list of str
        The names written.

    Raises
    ------
    ntp_opt.validate.PlanError
        If the plan breaks a rule of the model.
    MegatronError
        If a host name or device index is unusable.
    """
    check(instance, plan)
    a = instance.arrays
    hosts, device = gpu_hosts(instance)
    rows = [
        _active_row(instance, hosts, device, i, st, -1, r, k, j)
        for r, rep in enumerate(plan.replicas)
        for k, st in enumerate(rep.stages)
        for j, g in enumerate(st.gpus)
        for i in [a.gpu_index[g]]
    ]
    tdp = {(hosts[i], int(device[i])): math.floor(float(a.tdp[i]) + 1e-9) for i in range(a.n_gpus)}
    files = {
        POWER_SET_NAME: power_commands(rows, False, tdp),
        POWER_RESTORE_NAME: power_commands(rows, True, tdp),
    }
    return write_launch_set(files, out_dir, inputs=inputs, executable=tuple(files), prune=False)
