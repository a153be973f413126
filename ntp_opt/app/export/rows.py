"""The rank table: :class:`RankRow`, :class:`Export` and the active ranks of a plan."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ntp_opt.app.export.names import COLUMNS, HOST_RE, ID_RE
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Stage
from ntp_opt.planners.megatron import (
    MegatronError,
)
from ntp_opt.rules.power import whole_watts
from ntp_opt.rules.validate import Violation


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
    watts = whole_watts(float(a.tdp[gpu]), power)
    cap = instance.cluster.nodes[a.gpu_ids[gpu]].get("max_power_w")
    if cap is not None:
        watts = min(watts, math.floor(float(cap)))
    return int(watts)


def active_row(
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


def _order_key(
    hosts: list[str],
    prev: set[str],
    nxt: set[str],
    spare: set[str] | None,
    first: dict[str, int],
    device: np.ndarray,
    i: int,
) -> tuple[int, int, int, int]:
    """The sort key of GPU ``i`` in :func:`_stage_order`."""
    h = hosts[i]
    side = 0 if h in prev else (2 if h in nxt else 1)
    return (side, int(side == 1 and spare is not None and h in spare), first[h], int(device[i]))


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
    return sorted(gpus, key=functools.partial(_order_key, hosts, prev, nxt, spare, first, device))


def active_rows(
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
                rows.append(active_row(instance, hosts, device, i, st, b * big_t + j, r, k, j))
            if rep.tp < big_t:
                placeholders.append((b * big_t + rep.tp, big_t - rep.tp, b))
    return rows, placeholders


def check_rows(rows: Sequence[RankRow], ids: bool = True) -> None:
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
