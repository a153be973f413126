"""Power limits and power draw, shared by the validator and the planners.

A stage's power multiplier ``pi`` must lie in ``[1, 1 + max_boost]`` and keep
every GPU of the stage within the power limit its board accepts:
``pi * tdp_w <= max_power_w`` (docs/model.md, "Board power limits"). So the
largest multiplier of a stage is the minimum, over its GPUs, of

    cap_g = min(1 + max_boost, max_power_w / tdp_w)

(``max_power_w`` absent: ``cap_g = 1 + max_boost`` exactly, so instances
written before the attribute existed keep their meaning bit for bit). The
per-GPU caps are compiled once per instance
(:attr:`ntp_opt.model.instance.Instance.max_multiplier`).

Draw (docs/model.md, spec section 3): a used GPU draws ``tdp_w * pi``, an unused healthy
GPU ``tdp_w * idle_power_fraction``, a failed GPU nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ntp_opt.rules.goodput import replica_speed
from ntp_opt.rules.tolerances import BOOST_MARGIN, POWER_TOL, WATT_SLACK

if TYPE_CHECKING:
    from ntp_opt.model.instance import Instance

__all__ = [
    "Stages",
    "board_over",
    "boost_floor",
    "boost_floor_stages",
    "boost_stages",
    "boost_toward",
    "can_boost",
    "gpu_draw",
    "headroom",
    "largest_cap",
    "over_budget",
    "rack_and_site_draw",
    "stage_cap",
]

#: Per replica: its degree, the GPU indices of each stage, each stage's multiplier.
BoostReplica = tuple[int, Sequence[np.ndarray], Sequence[float]]


def stage_cap(instance: Instance, gpus: np.ndarray | list[int]) -> float:
    """The largest multiplier a stage on GPUs ``gpus`` (indices) may run at.

    ``1 + max_boost`` for an empty stage.
    """
    idx = np.asarray(gpus, dtype=np.int64)
    if idx.size == 0:
        return 1.0 + instance.job.max_boost
    return float(instance.max_multiplier[idx].min())


def gpu_draw(
    instance: Instance, power_of: np.ndarray, alive: np.ndarray | None = None
) -> np.ndarray:
    """Watts every GPU draws when GPU ``i`` runs at multiplier ``power_of[i]`` (0 = unused).

    Parameters
    ----------
    instance
        The instance.
    power_of
        Per GPU: its stage's multiplier, or 0 when it is in no stage.
    alive
        Per GPU: may it draw idle power (default: the instance's healthy GPUs).

    Returns
    -------
    numpy.ndarray
        ``tdp * power_of`` for used GPUs, ``tdp * idle_power_fraction`` for
        unused healthy ones, 0 for failed ones.
    """
    a = instance.arrays
    idle = instance.job.idle_power_fraction
    ok = a.healthy if alive is None else alive
    draw: np.ndarray = np.where(power_of > 0, power_of, np.where(ok, idle, 0.0)) * a.tdp
    return draw


def rack_and_site_draw(
    instance: Instance, power_of: np.ndarray, alive: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """Watts per rack (rack order) and for the site; see :func:`gpu_draw`."""
    a = instance.arrays
    per_gpu = gpu_draw(instance, power_of, alive)
    rack = np.bincount(a.gpu_rack, weights=per_gpu, minlength=len(a.rack_ids))
    return rack, float(per_gpu.sum())


def can_boost(instance: Instance) -> bool:
    """Can any stage run above multiplier 1 (``alpha > 0`` and some board with headroom)?

    Equal to ``max_boost > 0 and power_exponent > 0`` for every instance
    whose GPUs carry no ``max_power_w``.
    """
    job = instance.job
    if job.max_boost <= 0 or job.power_exponent <= 0:
        return False
    caps = instance.max_multiplier
    return bool(caps.size == 0 or caps.max() > 1.0)


def largest_cap(instance: Instance, healthy_only: bool = True) -> float:
    """The largest multiplier any (healthy) GPU allows; ``1 + max_boost`` if there is none."""
    caps = instance.max_multiplier
    if healthy_only:
        caps = caps[instance.arrays.healthy]
    return float(caps.max()) if caps.size else 1.0 + instance.job.max_boost


def headroom(
    instance: Instance, power_of: np.ndarray, alive: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """Watts left per rack (rack order) and at the site at the draw of :func:`gpu_draw`."""
    a = instance.arrays
    rack, site = rack_and_site_draw(instance, power_of, alive)
    return a.rack_budget - rack, a.site_budget - site


def over_budget(
    instance: Instance,
    rack_w: np.ndarray,
    site_w: float,
    *,
    tol: float = POWER_TOL,
    slack: float = WATT_SLACK,
) -> tuple[np.ndarray, bool]:
    """Which racks, and whether the site, draw more than their budget.

    Parameters
    ----------
    instance
        The instance.
    rack_w, site_w
        Watts per rack (rack order) and for the site (:func:`rack_and_site_draw`).
    tol, slack
        A draw above ``budget * (1 + tol) + slack`` is over budget. The defaults are
        the validator's; the planners' own power-1 fit tests pass
        ``tol=BUDGET_SLACK, slack=0`` (stricter).

    Returns
    -------
    tuple of (numpy.ndarray, bool)
        Boolean mask of the racks over budget, and the site flag.
    """
    a = instance.arrays
    racks = rack_w > a.rack_budget * (1 + tol) + slack
    return racks, bool(site_w > a.site_budget * (1 + tol) + slack)


def board_over(instance: Instance, power_of: np.ndarray) -> np.ndarray:
    """Boolean per GPU: its multiplier asks for more than its board's ``max_power_w``."""
    a = instance.arrays
    over: np.ndarray = power_of * a.tdp > a.max_power * (1 + POWER_TOL)
    return over


@dataclass(frozen=True, eq=False)
class Stages:
    """Stages of replicas in array form (the boosts' input).

    Stage ``s`` belongs to replica ``replica[s]`` (non-decreasing: a
    replica's stages are consecutive, in pipeline order) and runs on the GPU
    indices ``gpus[start[s]:start[s + 1]]`` (at least one each).
    """

    replica: np.ndarray
    gpus: np.ndarray
    start: np.ndarray

    @classmethod
    def from_lists(cls, per_replica: Sequence[Sequence[np.ndarray]]) -> Stages:
        """Stages from, per replica, the GPU indices of each stage."""
        flat = [np.asarray(g, dtype=np.int64) for gs in per_replica for g in gs]
        sizes = np.array([len(g) for g in flat], dtype=np.int64)
        counts = np.array([len(gs) for gs in per_replica], dtype=np.int64)
        return cls(
            replica=np.repeat(np.arange(len(per_replica), dtype=np.int64), counts),
            gpus=np.concatenate(flat) if flat else np.empty(0, dtype=np.int64),
            start=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        )

    @property
    def sizes(self) -> np.ndarray:
        """GPUs per stage."""
        sizes: np.ndarray = np.diff(self.start)
        return sizes

    def stage_min(self, per_gpu: np.ndarray) -> np.ndarray:
        """Per stage, the minimum of ``per_gpu`` over its GPUs."""
        if len(self.replica) == 0:
            return np.empty(0)
        out: np.ndarray = np.minimum.reduceat(per_gpu[self.gpus], self.start[:-1])
        return out

    def stage_sums(self, per_gpu: np.ndarray) -> np.ndarray:
        """Per stage, ``per_gpu`` (a value per entry of ``gpus``) summed as ``numpy.sum`` would.

        Stages of one size are summed as the rows of one matrix: the same
        pairwise summation, so bit for bit the sum of each stage on its own.
        """
        sizes = self.sizes
        out = np.zeros(len(sizes))
        for t in np.unique(sizes):
            idx = np.flatnonzero(sizes == t)
            out[idx] = per_gpu[self.start[idx][:, None] + np.arange(t)].sum(axis=1)
        return out


def _stages_of(replicas: Sequence[tuple[int, Sequence[np.ndarray]]]) -> tuple[Stages, np.ndarray]:
    stages = Stages.from_lists([gs for _, gs in replicas])
    return stages, np.array([t for t, _ in replicas], dtype=np.int64)


def _per_replica(stages: Stages, values: np.ndarray, n: int) -> list[list[float]]:
    cuts = np.searchsorted(stages.replica, np.arange(n + 1))
    flat = values.tolist()
    return [flat[cuts[r] : cuts[r + 1]] for r in range(n)]


def boost_toward(
    instance: Instance,
    replicas: Sequence[BoostReplica],
    candidates: Sequence[int],
    rack_room: np.ndarray,
    site_room: float,
    *,
    steps: int,
    margin: float = BOOST_MARGIN,
) -> tuple[list[list[float]], list[int]]:
    """Raise the stages of replicas ``candidates`` toward nominal speed within the rooms.

    The one boost of the heuristics, recourse and replanning: each candidate's
    stages get the least multiplier reaching the nominal speed ``1 / c``
    (never above ``1 + max_boost`` or the stage's board limit, never below the
    stage's current multiplier), the candidate needing the fewest extra watts
    first; a candidate that does not fit gets the fastest speed that does
    (bisection in ``steps`` steps), or nothing. :func:`boost_stages` on
    lists.

    Parameters
    ----------
    instance
        The instance.
    replicas
        Per replica: degree, GPU indices per stage, current multiplier per stage.
    candidates
        Indices into ``replicas`` that may boost.
    rack_room, site_room
        Watts left per rack and at the site (:func:`headroom`); not modified.
    steps
        Bisection steps (heuristics 50, recourse 60: their results are kept).
    margin
        Share of the rooms left unspent.

    Returns
    -------
    tuple of (list of list of float, list of int)
        New multipliers per replica and stage, and the replicas that boosted.
    """
    if not can_boost(instance):
        return [list(p) for _, _, p in replicas], []
    stages, tp = _stages_of([(t, gs) for t, gs, _ in replicas])
    powers = np.array([float(x) for _, _, p in replicas for x in p], dtype=float)
    out, boosted = boost_stages(
        instance, stages, tp, powers, candidates, rack_room, site_room, steps=steps, margin=margin
    )
    return _per_replica(stages, out, len(replicas)), boosted


def boost_stages(
    instance: Instance,
    stages: Stages,
    tp: np.ndarray,
    powers: np.ndarray,
    candidates: Sequence[int],
    rack_room: np.ndarray,
    site_room: float,
    *,
    steps: int,
    margin: float = BOOST_MARGIN,
) -> tuple[np.ndarray, list[int]]:
    """:func:`boost_toward` on arrays: replicas of degrees ``tp``, multipliers ``powers`` per stage.

    Every candidate's need at nominal speed is computed at once; the
    candidates are then taken in order (fewest extra watts first), each
    checked against the racks it touches and the racks already over their
    room. Bit for bit the per-replica computation: the same products, the
    stage sums of ``numpy.sum`` (:meth:`Stages.stage_sums`), the per-rack sums
    in stage and GPU order.

    Returns
    -------
    tuple of (numpy.ndarray, list of int)
        New multiplier per stage, and the replicas that boosted.
    """
    out = np.array(powers, dtype=float)
    cand = [int(i) for i in candidates]
    if not can_boost(instance) or not cand or len(stages.replica) == 0:
        return out, []
    booster = _Booster(instance, stages, tp, powers, rack_room, site_room, steps, margin)
    return out, booster.run(cand, out)


class _Booster:
    """The state of one :func:`boost_stages`: per-stage and per-(replica, rack) arrays,
    every replica's need at nominal speed, and the rooms left (updated as replicas boost)."""

    def __init__(
        self,
        instance: Instance,
        stages: Stages,
        tp: np.ndarray,
        powers: np.ndarray,
        rack_room: np.ndarray,
        site_room: float,
        steps: int,
        margin: float,
    ) -> None:
        a = instance.arrays
        job = instance.job
        self.job = job
        self.stages = stages
        self.tp = tp
        self.steps = steps
        n_rep = len(tp)
        self.n_rep = n_rep
        n_racks = len(a.rack_ids)
        self.rack_room = np.array(rack_room, dtype=float)
        self.site_room = site_room
        self.target = 1.0 / job.seq_time_s
        self.keep = 1.0 - margin
        self.inv_alpha = 1.0 / job.power_exponent
        self.pw = np.array(powers, dtype=float)
        sizes = stages.sizes
        self.sizes = sizes
        self.sptr = np.searchsorted(stages.replica, np.arange(n_rep + 1))
        per_degree = {t: job.tp_factor(t) / job.seq_time_s for t in set(tp.tolist())}
        factor = np.array([per_degree[t] for t in tp.tolist()], dtype=float)
        self.slowest = stages.stage_min(a.speed)
        self.fs = factor[stages.replica] * self.slowest  # factor * slowest speed, per stage
        self.top = np.maximum(stages.stage_min(instance.max_multiplier), self.pw)
        self.tdp = a.tdp[stages.gpus]
        gpu_rep = np.repeat(stages.replica, sizes)
        keys, inverse = np.unique(gpu_rep * n_racks + a.gpu_rack[stages.gpus], return_inverse=True)
        self.inverse = inverse.ravel()
        self.key_rack = keys % n_racks
        self.kptr = np.searchsorted(keys // n_racks, np.arange(n_rep + 1))
        # every replica's need at nominal speed
        with np.errstate(divide="ignore", invalid="ignore"):  # speed 0: never a candidate
            self.mult_all = self.mults(self.target, 0, len(sizes))
        watts_all = self.tdp * np.repeat(self.mult_all - self.pw, sizes)
        self.extra_all = self.replica_sums(stages.stage_sums(watts_all), 0, len(sizes))
        self.rack_all = np.bincount(self.inverse, weights=watts_all, minlength=len(keys))
        self.room_keep = self.rack_room * self.keep
        self.n_neg = int(np.count_nonzero(self.room_keep < 0))

    def mults(self, goal: float, lo: int, hi: int) -> np.ndarray:
        """Multipliers of stages ``lo:hi`` reaching speed ``goal`` (within their limits)."""
        pi = (goal / self.fs[lo:hi]) ** self.inv_alpha
        res: np.ndarray = np.minimum(np.maximum(pi, self.pw[lo:hi]), self.top[lo:hi])
        return res

    def replica_sums(self, stage_sum: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Per replica, its stages' sums added one after the other (0.0 first)."""
        rep = self.stages.replica[lo:hi]
        first = self.sptr[rep]
        pos = np.arange(lo, hi) - first
        total = np.zeros(self.n_rep)
        for k in range(int(pos.max()) + 1 if hi > lo else 0):
            sel = pos == k
            total[rep[sel]] += stage_sum[sel]
        return total

    def need(self, i: int, goals: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Multipliers, extra watts per touched rack and in all, at each speed of ``goals``."""
        stages, sizes, tdp, pw = self.stages, self.sizes, self.tdp, self.pw
        s0, s1 = int(self.sptr[i]), int(self.sptr[i + 1])
        g0, g1 = int(stages.start[s0]), int(stages.start[s1])
        k0, k1 = int(self.kptr[i]), int(self.kptr[i + 1])
        n_s, n_g = s1 - s0, len(goals)
        local = self.inverse[g0:g1] - k0
        mult = np.minimum(
            np.maximum((np.array(goals)[:, None] / self.fs[s0:s1]) ** self.inv_alpha, pw[s0:s1]),
            self.top[s0:s1],
        )
        step = mult - pw[s0:s1]
        if sizes[s0] * n_s == g1 - g0 and (sizes[s0:s1] == sizes[s0]).all():
            # one size: stages are the rows of a matrix, summed as each alone
            watts = tdp[g0:g1].reshape(n_s, -1)[None] * step[:, :, None]
            sums = watts.sum(axis=2)
        else:
            watts = tdp[g0:g1][None] * np.repeat(step, sizes[s0:s1], axis=1)
            start = stages.start[s0 : s1 + 1] - g0
            sub = Stages(stages.replica[s0:s1], stages.gpus[g0:g1], start)
            sums = np.array([sub.stage_sums(w) for w in watts]).reshape(n_g, n_s)
        extra = np.cumsum(sums, axis=1)[:, -1]  # stage after stage
        slot = (np.arange(n_g)[:, None] * (k1 - k0) + local[None, :]).ravel()
        per_rack = np.bincount(slot, weights=watts.ravel(), minlength=n_g * (k1 - k0))
        return mult, per_rack.reshape(n_g, k1 - k0), extra

    def fits(self, i: int, per_rack: np.ndarray, extra: np.ndarray) -> np.ndarray:
        """Per row: do the extra watts fit the racks' and the site's rooms?"""
        room = self.room_keep[self.key_rack[self.kptr[i] : self.kptr[i + 1]]]
        ok: np.ndarray = np.all(per_rack <= room, axis=-1) & (extra <= self.site_room * self.keep)
        return ok

    def others_over(self, i: int) -> bool:
        """Is a rack replica ``i`` does not touch already over its room (nothing fits then)?"""
        room = self.room_keep[self.key_rack[self.kptr[i] : self.kptr[i + 1]]]
        return self.n_neg != int(np.count_nonzero(room < 0))

    def bisect(self, i: int, lo: float, up: float) -> float:
        """``steps`` bisection steps on the reachable speed, four levels of mids at a time."""
        left = self.steps
        while left > 0:
            depth = min(4, left)
            bounds, mids = [(lo, up)], []
            for _ in range(depth):  # the mids of the next levels, level by level
                nxt = []
                for x, y in bounds:
                    m = 0.5 * (x + y)
                    mids.append(m)
                    nxt += [(x, m), (m, y)]
                bounds = nxt
            ok = self.fits(i, *self.need(i, mids)[1:])
            node = 0
            for _ in range(depth):
                if ok[node]:
                    lo, node = mids[node], 2 * node + 2
                else:
                    up, node = mids[node], 2 * node + 1
            left -= depth
        return lo

    def run(self, cand: list[int], out: np.ndarray) -> list[int]:
        """Boost the candidates, fewest extra watts first; write their multipliers into
        ``out`` and return the replicas that boosted."""
        order = sorted(cand, key=lambda i: (float(self.extra_all[i]), i))
        boosted = []
        for i in order:
            s0, s1 = int(self.sptr[i]), int(self.sptr[i + 1])
            if self.others_over(i):
                continue  # nothing fits, not even the reachable speed
            mult = self.mult_all[s0:s1]
            per_rack = self.rack_all[self.kptr[i] : self.kptr[i + 1]]
            extra = float(self.extra_all[i])
            if not self.fits(i, per_rack, np.array(extra)):
                slowest, pw = self.slowest[s0:s1].tolist(), self.pw[s0:s1].tolist()
                now = replica_speed(self.job, int(self.tp[i]), slowest, pw)
                lo = self.bisect(i, now, self.target)
                got = self.need(i, [lo])
                mult, per_rack, extra = got[0][0], got[1][0], float(got[2][0])
                if not self.fits(i, per_rack, np.array(extra)) or extra <= 0:
                    continue
            out[s0:s1] = mult
            self.take(i, per_rack, extra)
            boosted.append(i)
        return boosted

    def take(self, i: int, per_rack: np.ndarray, extra: float) -> None:
        """Spend replica ``i``'s extra watts from the rooms."""
        racks = self.key_rack[self.kptr[i] : self.kptr[i + 1]]
        room_keep, rack_room = self.room_keep, self.rack_room
        self.n_neg -= int(np.count_nonzero(room_keep[racks] < 0))
        rack_room[racks] = rack_room[racks] - per_rack
        room_keep[racks] = rack_room[racks] * self.keep
        self.n_neg += int(np.count_nonzero(room_keep[racks] < 0))
        self.site_room -= extra


def boost_floor(
    instance: Instance,
    replicas: Sequence[tuple[int, Sequence[np.ndarray]]],
    rack_room: np.ndarray,
    site_room: float,
    *,
    margin: float = BOOST_MARGIN,
    steps: int = 60,
) -> list[list[float]]:
    """Multipliers raising every replica to the highest common speed the rooms allow.

    Bisection on the target speed ``tau``: each stage gets the least power
    reaching ``tau`` (capped at ``1 + max_boost`` and at its boards' limits,
    :func:`stage_cap`); the largest ``tau`` whose extra draw (over power 1)
    fits every rack and the site is kept. All ones when nothing fits.
    :func:`boost_floor_stages` on lists.

    Parameters
    ----------
    instance
        The instance.
    replicas
        Per replica: degree and the GPU indices of each stage (at power 1).
    rack_room, site_room
        Watts left per rack and at the site at power 1 (:func:`headroom`).
    margin, steps
        Share of the rooms left unspent; bisection steps.

    Returns
    -------
    list of list of float
        Multiplier per replica and stage.
    """
    if not replicas or not can_boost(instance):
        return [[1.0] * len(m) for _, m in replicas]
    stages, tp = _stages_of(replicas)
    out = boost_floor_stages(instance, stages, tp, rack_room, site_room, margin=margin, steps=steps)
    return _per_replica(stages, out, len(replicas))


def boost_floor_stages(
    instance: Instance,
    stages: Stages,
    tp: np.ndarray,
    rack_room: np.ndarray,
    site_room: float,
    *,
    margin: float = BOOST_MARGIN,
    steps: int = 60,
) -> np.ndarray:
    """:func:`boost_floor` on arrays: replicas of degrees ``tp`` (stages of ``tp`` GPUs each).

    Returns
    -------
    numpy.ndarray
        Multiplier per stage (all ones when nothing fits).
    """
    a = instance.arrays
    job = instance.job
    alpha = job.power_exponent
    ones = np.ones(len(stages.replica))
    if len(stages.replica) == 0 or not can_boost(instance):
        return ones
    sizes = stages.sizes
    per_degree = {t: job.tp_factor(t) for t in set(tp.tolist())}
    factor = np.array([per_degree[t] for t in tp.tolist()], dtype=float)
    stage_base = factor[stages.replica] * stages.stage_min(a.speed)
    stage_caps = stages.stage_min(instance.max_multiplier)
    base = np.repeat(stage_base, sizes)
    flat = stages.gpus
    # per stage (and per GPU, repeated): the largest multiplier job and boards allow
    caps = np.repeat(stage_caps, sizes)
    # aggregate per (stage, rack): one power multiplier per stage
    stage = np.repeat(np.arange(len(sizes)), sizes)
    n_racks = len(a.rack_ids)
    key, inverse = np.unique(stage * n_racks + a.gpu_rack[flat], return_inverse=True)
    tdp = np.bincount(inverse.ravel(), weights=a.tdp[flat], minlength=len(key))  # watts per group
    rack = key % n_racks
    first = np.searchsorted(stage, key // n_racks)
    groups = _FloorGroups(
        tdp, base[first], caps[first], rack, n_racks, rack_room, site_room, 1 - margin, alpha
    )
    lo = float(base.min())
    top = float((base * caps**alpha).min())  # the fastest the slowest stage can get
    if not groups.fits(lo):
        return ones
    for _ in range(steps):
        mid = 0.5 * (lo + top)
        if groups.fits(mid):
            lo = mid
        else:
            top = mid
    return _floor_powers(lo, stage_base, stage_caps, alpha)


def _floor_powers(tau: float, b: np.ndarray, hi: np.ndarray, alpha: float) -> np.ndarray:
    """``np.clip((tau / b) ** (1 / alpha), 1, hi)``, the power taken only where ``b < tau``:
    elsewhere it is at most 1 and clipped to ``min(1, hi)`` exactly."""
    out = np.minimum(1.0, hi)
    low = np.flatnonzero(b < tau)
    out[low] = np.clip((tau / b[low]) ** (1.0 / alpha), 1.0, hi[low])
    return out


@dataclass(frozen=True, eq=False)
class _FloorGroups:
    """The (stage, rack) groups of :func:`boost_floor_stages` and the rooms they share.

    ``tdp``: total watts of each group at power 1; ``base`` and ``caps``: its
    stage's speed base and largest multiplier; ``rack``: its rack.
    """

    tdp: np.ndarray
    base: np.ndarray
    caps: np.ndarray
    rack: np.ndarray
    n_racks: int
    rack_room: np.ndarray
    site_room: float
    keep: float
    alpha: float

    def fits(self, tau: float) -> bool:
        """Does the extra draw of every stage at speed ``tau`` fit the racks and the site?"""
        extra = self.tdp * (_floor_powers(tau, self.base, self.caps, self.alpha) - 1.0)
        per_rack = np.bincount(self.rack, weights=extra, minlength=self.n_racks)
        keep = self.keep
        return bool(
            np.all(per_rack <= self.rack_room * keep) and extra.sum() <= self.site_room * keep
        )


def boost_floor_grouped(
    instance: Instance,
    stages: Stages,
    tp: np.ndarray,
    rack_room: np.ndarray,
    site_room: float,
    *,
    margin: float = BOOST_MARGIN,
    steps: int = 60,
) -> np.ndarray:
    """:func:`boost_floor_stages`, bit for bit, with less work per bisection step.

    A stage's multiplier at a target speed depends only on its speed base
    and its cap (:func:`_floor_powers` is element-wise), so each distinct
    pair is powered once per step and gathered back to the (stage, rack)
    groups; the groups are found without a sort when every stage lies in
    one rack (checked). The rest is :func:`boost_floor_stages` itself: the
    same watts, sums and comparisons.

    Returns
    -------
    numpy.ndarray
        Multiplier per stage (all ones when nothing fits).
    """
    a = instance.arrays
    job = instance.job
    alpha = job.power_exponent
    ones = np.ones(len(stages.replica))
    if len(stages.replica) == 0 or not can_boost(instance):
        return ones
    sizes = stages.sizes
    per_degree = {t: job.tp_factor(t) for t in set(tp.tolist())}
    factor = np.array([per_degree[t] for t in tp.tolist()], dtype=float)
    stage_base = factor[stages.replica] * stages.stage_min(a.speed)
    stage_caps = stages.stage_min(instance.max_multiplier)
    flat = stages.gpus
    n_racks = len(a.rack_ids)
    gpu_rack = a.gpu_rack[flat]
    first_gpu = stages.start[:-1]
    if bool((gpu_rack == np.repeat(gpu_rack[first_gpu], sizes)).all()):
        # one rack per stage: the groups are the stages, in order (np.unique's keys)
        tdp = np.bincount(
            np.repeat(np.arange(len(sizes)), sizes), weights=a.tdp[flat], minlength=len(sizes)
        )
        rack = gpu_rack[first_gpu]
        g_base, g_caps = stage_base, stage_caps
    else:
        stage = np.repeat(np.arange(len(sizes)), sizes)
        key, inverse = np.unique(stage * n_racks + gpu_rack, return_inverse=True)
        tdp = np.bincount(inverse.ravel(), weights=a.tdp[flat], minlength=len(key))
        rack = key % n_racks
        g_stage = key // n_racks
        g_base, g_caps = stage_base[g_stage], stage_caps[g_stage]
    b_vals, b_of = np.unique(g_base, return_inverse=True)
    c_vals, c_of = np.unique(g_caps, return_inverse=True)
    pairs, pair_of = np.unique(
        b_of.reshape(-1) * len(c_vals) + c_of.reshape(-1), return_inverse=True
    )
    pair_of = pair_of.reshape(-1)
    p_base, p_caps = b_vals[pairs // len(c_vals)], c_vals[pairs % len(c_vals)]
    rack_keep = rack_room * (1 - margin)
    site_keep = site_room * (1 - margin)

    def fits(tau: float) -> bool:
        extra = tdp * (_floor_powers(tau, p_base, p_caps, alpha)[pair_of] - 1.0)
        per_rack = np.bincount(rack, weights=extra, minlength=n_racks)
        return bool(np.all(per_rack <= rack_keep) and extra.sum() <= site_keep)

    lo = float(stage_base.min())
    top = float((stage_base * stage_caps**alpha).min())
    if not fits(lo):
        return ones
    for _ in range(steps):
        mid = 0.5 * (lo + top)
        if fits(mid):
            lo = mid
        else:
            top = mid
    return _floor_powers(lo, stage_base, stage_caps, alpha)
