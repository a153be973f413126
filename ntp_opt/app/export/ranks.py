"""Placement of the inactive (placeholder) ranks on free healthy GPUs or on placeholder hosts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ntp_opt.app.export.rows import RankRow
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.megatron import (
    MegatronError,
)
from ntp_opt.rules.validate import Violation


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


def _take_fresh(fresh: list[dict[int, list[str]]], length: int) -> str | None:
    """Take a host without ranks for a run of ``length``: the smallest that holds it, else the
    largest; cluster hosts first (``fresh``: per tier, hosts by their free slots)."""
    for tier in fresh:
        if tier:
            fits = [c for c in tier if c >= length]
            c = min(fits) if fits else max(tier)
            h = tier[c].pop(0)
            if not tier[c]:
                del tier[c]
            return h
    return None


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
            fresh_host = _take_fresh(fresh, y - x)
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


def placeholder_rows(
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
                    f"of the {n_reduced} reduced replicas (tp_spares {spares(plan, big_t)} "
                    "per stage) each need a healthy GPU of their own, and the cluster has "
                    f"{cluster_free} healthy GPUs no active rank uses"
                    + (f" plus {extra} on the named placeholder hosts" if extra else "")
                    + ": name (more) extra hosts with --placeholder-hosts",
                )
            ]
        )
    return [_placeholder_row(instance, r, h, dev, gi) for r, h, dev, gi in best[0]]


def _placeholder_row(instance: Instance, r: int, h: str, dev: int, gi: int | None) -> RankRow:
    """The row of inactive rank ``r`` on device ``dev`` of host ``h`` (GPU ``gi`` if known)."""
    a = instance.arrays
    b, tp = divmod(r, instance.job.tp)
    dp, pp = divmod(b, instance.job.pp)
    return RankRow(
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


def spares(plan: Plan, big_t: int) -> int:
    """``tp_spares``: inactive ranks per stage of a reduced replica (0 when none is reduced)."""
    reduced = [r for r in plan.replicas if r.tp < big_t]
    return big_t - (reduced[0].tp if reduced else big_t)
