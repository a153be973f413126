"""Boosts: stages' power multipliers raised within the racks' and the site's rooms.

The draws and budgets these boosts spend are in :mod:`ntp_opt.rules.power`
(every budget comparison goes through it). Three boosts, shared by the
heuristics, ``fast``, recourse and re-planning, all on :class:`Stages`
(replicas' stages in array form):

* :func:`boost_stages`: candidate replicas raised toward nominal speed,
  the cheapest first;
* :func:`boost_floor_stages`: every replica raised to the highest common
  speed the rooms allow;
* :func:`trim_powers`: multipliers lowered to what a batch split uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ntp_opt.rules.boost_needs import ReplicaPart, bisect_predicted, needs_at
from ntp_opt.rules.goodput import replica_speed
from ntp_opt.rules.power import can_boost
from ntp_opt.rules.tolerances import BOOST_MARGIN

if TYPE_CHECKING:
    from ntp_opt.model.instance import Instance

__all__ = [
    "TRIM_MARGIN",
    "Stages",
    "boost_floor_stages",
    "boost_stages",
    "trim_powers",
]


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
    memo: dict[Any, Any] | None = None,
) -> tuple[np.ndarray, list[int]]:
    """Raise the stages of replicas ``candidates`` toward nominal speed within the rooms.

    The one boost of the heuristics, recourse and re-planning: each
    candidate's stages get the least multiplier reaching its goal speed
    (never above ``1 + max_boost`` or the stage's board limit, never below
    the stage's current multiplier), the candidate needing the fewest extra
    watts first; a candidate that does not fit gets the fastest speed that
    does (bisection in ``steps`` steps), or nothing. The goal is the nominal
    speed ``1 / c``, or less when one of the replica's stages cannot reach it
    at its largest multiplier: a replica runs at its slowest stage's speed,
    so its other stages are raised only to that stage's best (a stage at its
    limit already leaves the replica unboosted).

    Only the candidates' stages are read: their needs at nominal speed are
    computed at once, then the candidates are taken in order, each checked
    against the racks it touches and the racks already over their room. Bit
    for bit the per-replica computation: the same products, the stage sums
    of ``numpy.sum`` (:meth:`Stages.stage_sums`), the per-rack sums in stage
    and GPU order.

    Parameters
    ----------
    instance
        The instance.
    stages
        The replicas' stages.
    tp
        Degree per replica.
    powers
        Current multiplier per stage.
    candidates
        Replicas (indices) that may boost.
    rack_room, site_room
        Watts left per rack and at the site (:func:`~ntp_opt.rules.power.headroom`); not modified.
    steps
        Bisection steps (heuristics and re-planning 50, recourse 60: their
        results are kept).
    margin
        Share of the rooms left unspent.
    memo
        A dict kept by the caller from one call to the next (re-planning):
        a candidate's needs at the speeds its bisection tries depend on its
        stages alone, not on the rooms, so a candidate whose stages did not
        change reuses them. The results are the same with or without it.

    Returns
    -------
    tuple of (numpy.ndarray, list of int)
        New multiplier per stage, and the replicas that boosted.
    """
    out = np.array(powers, dtype=float)
    cand = [int(i) for i in candidates]
    if not can_boost(instance) or not cand or len(stages.replica) == 0:
        return out, []
    chosen = sorted(set(cand))
    sub, at = _replicas_of(stages, chosen)
    local = {r: j for j, r in enumerate(chosen)}
    sub_pw = out[at]
    booster = _Booster(
        instance, sub, np.asarray(tp)[chosen], sub_pw, rack_room, site_room, steps, margin
    )
    if memo is not None:
        _check_memo(instance, memo)
        booster.memo = memo
    boosted = booster.run([local[i] for i in cand], sub_pw)
    out[at] = sub_pw
    return out, [chosen[j] for j in boosted]


def _replicas_of(stages: Stages, chosen: list[int]) -> tuple[Stages, np.ndarray]:
    """The stages of replicas ``chosen`` (increasing), renumbered ``0 ..``, and their
    indices among ``stages``."""
    sptr = np.searchsorted(stages.replica, np.array([chosen, [r + 1 for r in chosen]]))
    at = np.concatenate([np.arange(lo, hi) for lo, hi in sptr.T.tolist()]).astype(np.int64)
    sizes = stages.sizes[at]
    first = stages.start[at]
    offset = np.zeros(len(at) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offset[1:])
    flat = np.repeat(first - offset[:-1], sizes) + np.arange(int(offset[-1]))
    counts = sptr[1] - sptr[0]
    sub = Stages(
        replica=np.repeat(np.arange(len(chosen), dtype=np.int64), counts),
        gpus=stages.gpus[flat],
        start=offset,
    )
    return sub, at


def _runs(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(key, return_inverse=True)``, without the sort when ``key`` is sorted
    already (the usual case: stages in order, each one's GPUs in rack order)."""
    if key.size and bool((key[1:] >= key[:-1]).all()):
        new = np.empty(key.size, dtype=bool)
        new[0] = True
        np.not_equal(key[1:], key[:-1], out=new[1:])
        return key[new], np.cumsum(new) - 1
    keys, inverse = np.unique(key, return_inverse=True)
    return keys, inverse.ravel()


_MEMO_MAX = 4096
"""Entries of a :func:`boost_stages` memo beyond which it starts over."""


def _check_memo(instance: Instance, memo: dict[Any, Any]) -> None:
    """Empty ``memo`` when it was filled on another cluster (other TDP, rack or board
    arrays: a re-planning chain shares them) or has grown past :data:`_MEMO_MAX`."""
    a = instance.arrays
    ident = (a.tdp, a.gpu_rack, instance.max_multiplier)
    kept = memo.get("cluster")
    if (
        len(memo) > _MEMO_MAX
        or kept is None
        or any(x is not y for x, y in zip(kept, ident, strict=True))
    ):
        memo.clear()
        memo["cluster"] = ident


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
        keys, inverse = _runs(gpu_rep * n_racks + a.gpu_rack[stages.gpus])
        self.inverse = inverse
        self.key_rack = keys % n_racks
        self.kptr = np.searchsorted(keys // n_racks, np.arange(n_rep + 1))
        # every replica's goal: nominal speed, or the best speed its slowest-capped
        # stage reaches (a stage that cannot reach nominal speed caps the replica, so
        # its other stages are raised no further than that: power for no speed)
        reach = self.fs * self.top**job.power_exponent
        self.goal = (
            np.minimum(np.minimum.reduceat(reach, self.sptr[:-1]), self.target)
            if len(sizes)
            else np.zeros(n_rep)
        )
        with np.errstate(divide="ignore", invalid="ignore"):  # speed 0: never a candidate
            self.mult_all = self.mults(self.goal[stages.replica], 0, len(sizes))
        watts_all = self.tdp * np.repeat(self.mult_all - self.pw, sizes)
        self.extra_all = self.replica_sums(stages.stage_sums(watts_all), 0, len(sizes))
        self.rack_all = np.bincount(self.inverse, weights=watts_all, minlength=len(keys))
        self.room_keep = self.rack_room * self.keep
        self.n_neg = int(np.count_nonzero(self.room_keep < 0))
        self.memo: dict[Any, Any] | None = None
        self.idents: dict[int, tuple[Any, ...]] = {}
        self.parts: dict[int, ReplicaPart] = {}

    def mults(self, goal: float | np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Multipliers of stages ``lo:hi`` reaching speed ``goal`` (within their limits;
        one goal, or one per stage)."""
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

    def ident(self, i: int) -> tuple[Any, ...]:
        """What replica ``i``'s needs depend on: its stages, not its place."""
        ident = self.idents.get(i)
        if ident is None:
            s0, s1 = int(self.sptr[i]), int(self.sptr[i + 1])
            g0, g1 = int(self.stages.start[s0]), int(self.stages.start[s1])
            ident = self.idents[i] = (
                self.stages.gpus[g0:g1].tobytes(),
                self.sizes[s0:s1].tobytes(),
                self.pw[s0:s1].tobytes(),
                self.fs[s0:s1].tobytes(),
                self.top[s0:s1].tobytes(),
                self.inv_alpha,
            )
        return ident

    def need(self, i: int, goals: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Multipliers, extra watts per touched rack and in all, at each speed of ``goals``."""
        if self.memo is None:
            return self.needs(i, goals)
        key = (self.ident(i), tuple(goals))
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = self.needs(i, goals)
        return got

    def needs(self, i: int, goals: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`need`, computed (:func:`~ntp_opt.rules.boost_needs.needs_at`)."""
        part = self.parts.get(i)
        if part is None:
            part = self.parts[i] = self.part(i)
        return needs_at(part, goals, self.inv_alpha)

    def part(self, i: int) -> ReplicaPart:
        """Replica ``i``'s slices, read once for all its needs."""
        stages, sizes = self.stages, self.sizes
        s0, s1 = int(self.sptr[i]), int(self.sptr[i + 1])
        g0, g1 = int(stages.start[s0]), int(stages.start[s1])
        k0, k1 = int(self.kptr[i]), int(self.kptr[i + 1])
        n_s = s1 - s0
        tdp = self.tdp[g0:g1]
        one = sizes[s0] * n_s == g1 - g0 and (sizes[s0:s1] == sizes[s0]).all()
        start = stages.start[s0 : s1 + 1] - g0
        sub = Stages(stages.replica[s0:s1], stages.gpus[g0:g1], start)
        fs, pw, top = self.fs[s0:s1], self.pw[s0:s1], self.top[s0:s1]
        matrix = tdp.reshape(n_s, -1)[None] if one else None
        local = self.inverse[g0:g1] - k0
        return ReplicaPart(fs, pw, top, tdp, sizes[s0:s1], matrix, sub, local, k1 - k0, {})

    def fits(self, i: int, per_rack: np.ndarray, extra: np.ndarray) -> np.ndarray:
        """Per row: do the extra watts fit the racks' and the site's rooms?"""
        room = self.room_keep[self.key_rack[self.kptr[i] : self.kptr[i + 1]]]
        ok: np.ndarray = (per_rack <= room).all(axis=-1) & (extra <= self.site_room * self.keep)
        return ok

    def others_over(self, i: int) -> bool:
        """Is a rack replica ``i`` does not touch already over its room (nothing fits then)?"""
        room = self.room_keep[self.key_rack[self.kptr[i] : self.kptr[i + 1]]]
        return self.n_neg != int(np.count_nonzero(room < 0))

    def bisect(self, i: int, lo: float, up: float) -> float:
        """``steps`` bisection steps on the reachable speed, four levels of mids at a time.

        With a memo, the path (each step's mid, its needs and whether it fit) is
        kept per replica and start: a later call checks every step of it against
        the rooms at once and returns its end when each step decides as before
        (the same steps, so the same speed); otherwise it bisects again.
        """
        if self.memo is None:
            return self.walk(i, lo, up)[0]
        key = ("path", self.ident(i), lo, up, self.steps)
        kept = self.memo.get(key)
        if kept is not None:
            end, per_rack, extra, decided = kept
            if np.array_equal(self.fits(i, per_rack, extra), decided):
                return float(end)
        end, per_rack, extra, decided = self.walk(i, lo, up)
        self.memo[key] = (end, per_rack, extra, decided)
        return end

    def walk(
        self, i: int, lo: float, up: float
    ) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        """The bisection of :meth:`bisect` (:func:`~ntp_opt.rules.boost_needs.bisect_predicted`
        in the rooms of now): its end, and per step the needs (extra watts per touched
        rack and in all) at its mid and whether they fit."""
        room = self.room_keep[self.key_rack[self.kptr[i] : self.kptr[i + 1]]]
        need = partial(self.need, i)
        site = self.site_room * self.keep
        return bisect_predicted(need, room, site, lo, up, self.steps, power=self.inv_alpha)

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
                if self.goal[i] <= now:
                    continue  # a stage at its limit already sets the replica's speed
                lo = self.bisect(i, now, float(self.goal[i]))
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


def boost_floor_stages(
    instance: Instance,
    stages: Stages,
    tp: np.ndarray,
    rack_room: np.ndarray,
    site_room: float,
    *,
    margin: float = BOOST_MARGIN,
    steps: int = 60,
    slowest: np.ndarray | None = None,
    caps: np.ndarray | None = None,
    memo: dict[Any, Any] | None = None,
) -> np.ndarray:
    """Multipliers raising every replica to the highest common speed the rooms allow.

    Bisection on the target speed ``tau``: each stage gets the least power
    reaching ``tau`` (capped at ``1 + max_boost`` and at its boards' limits,
    :func:`~ntp_opt.rules.power.stage_cap`); the largest ``tau`` whose extra draw (over power 1)
    fits every rack and the site is kept. All ones when nothing fits.

    Each bisection step costs a few array operations on the (stage, rack)
    groups: the powers are computed once per distinct (speed base, cap)
    pair, and where no rack holds two groups the rack sums are the groups'
    own draws (bit for bit the sums of ``numpy.bincount``).

    Parameters
    ----------
    instance
        The instance.
    stages
        The replicas' stages (at power 1).
    tp
        Degree per replica.
    rack_room, site_room
        Watts left per rack and at the site at power 1 (:func:`~ntp_opt.rules.power.headroom`).
    margin, steps
        Share of the rooms left unspent; bisection steps.
    slowest
        Per stage, the speed of its slowest GPU, when known.
    caps
        Per stage, the least of its GPUs' largest multipliers
        (``stages.stage_min(instance.max_multiplier)``), when known.
    memo
        A dict kept by the caller from one call to the next (re-planning):
        the stages' caps and (stage, rack) groups are kept in it and reused
        while the stages' GPUs are the same. The same result without it.

    Returns
    -------
    numpy.ndarray
        Multiplier per stage (all ones when nothing fits).
    """
    a = instance.arrays
    alpha = instance.job.power_exponent
    ones = np.ones(len(stages.replica))
    if len(stages.replica) == 0 or not can_boost(instance):
        return ones
    if slowest is None:
        slowest = stages.stage_min(a.speed)
    stage_base = _degree_factors(instance, tp)[stages.replica] * slowest
    if memo is not None:
        _check_memo(instance, memo)
    stage_caps, tdp, of, rack = _stage_rack_groups(instance, stages, caps, memo)
    room = np.asarray(rack_room, dtype=float)
    n_racks = len(a.rack_ids)
    keep = 1 - margin
    groups = _FloorGroups(
        tdp, stage_base[of], stage_caps[of], rack, n_racks, room, site_room, keep, alpha
    )
    some = stages.sizes > 0
    lo = float(stage_base[some].min())
    top = float((stage_base[some] * stage_caps[some] ** alpha).min())  # the slowest stage's best
    if not groups.fits(lo):
        return ones
    return _floor_powers(groups.highest(lo, top, steps), stage_base, stage_caps, alpha)


def _degree_factors(instance: Instance, tp: np.ndarray) -> np.ndarray:
    """``f(t)`` per replica of degree ``tp[r]`` (each degree's factor computed once)."""
    job = instance.job
    per_degree = {t: job.tp_factor(t) for t in set(np.asarray(tp).tolist())}
    factor: np.ndarray = np.array([per_degree[t] for t in np.asarray(tp).tolist()], dtype=float)
    return factor


def _stage_rack_groups(
    instance: Instance,
    stages: Stages,
    caps: np.ndarray | None,
    memo: dict[Any, Any] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per stage its cap, and per (stage, rack) group its watts at power 1, stage and
    rack; from ``memo`` while the stages' GPUs are the same (kept in it otherwise).

    When only a few stages differ from the kept ones (as many stages, given
    ``caps``: a re-planning chain's next swap plan), the kept groups of the
    other stages are reused and the differing stages' groups computed: the
    same groups in the same order, each group's watts summed over its GPUs in
    the same order (:func:`_spliced_groups`).
    """
    kept = None if memo is None else memo.get("floor")
    if (
        kept is not None
        and np.array_equal(kept[0], stages.gpus)
        and np.array_equal(kept[1], stages.start)
    ):
        stage_caps, tdp, of, rack = kept[2:]
        return stage_caps, tdp, of, rack
    got = None if kept is None or caps is None else _spliced_groups(instance, stages, kept)
    if got is None:
        # per stage: the largest multiplier job and boards allow
        stage_caps = stages.stage_min(instance.max_multiplier) if caps is None else caps
        tdp, of, rack = _groups_of(
            instance, stages.gpus, np.arange(len(stages.sizes)), stages.sizes
        )
    else:
        stage_caps, (tdp, of, rack) = caps, got
    if memo is not None:
        memo["floor"] = (stages.gpus.copy(), stages.start.copy(), stage_caps, tdp, of, rack)
    return stage_caps, tdp, of, rack


def _groups_of(
    instance: Instance, flat: np.ndarray, ids: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (stage, rack) group of the stages ``ids`` (``sizes[k]`` GPUs each, listed in
    ``flat`` one stage after the other): its watts at power 1, stage and rack."""
    a = instance.arrays
    n_racks = len(a.rack_ids)
    stage = np.repeat(ids, sizes)
    key, inverse = _runs(stage * n_racks + a.gpu_rack[flat])
    tdp = np.bincount(inverse, weights=a.tdp[flat], minlength=len(key))  # watts per group
    return tdp, key // n_racks, key % n_racks


_SPLICE_SHARE = 8
""":func:`_spliced_groups` reuses kept groups while at most one stage in this many
differs."""


def _spliced_groups(
    instance: Instance, stages: Stages, kept: tuple[np.ndarray, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`_groups_of` of every stage from the kept groups (``memo["floor"]``) of the
    stages that did not change (same place, size and GPUs in order); ``None`` when
    the stage count differs or too many stages changed."""
    old_gpus, old_start, _, old_tdp, old_of, old_rack = kept
    start, sizes = stages.start, stages.sizes
    n = len(sizes)
    if len(old_start) != n + 1 or n == 0:
        return None
    same = sizes == np.diff(old_start)
    changed = _changed_stages(stages, old_gpus, old_start, same)
    if len(changed) * _SPLICE_SHARE > n:
        return None
    same[changed] = False
    n_racks = len(instance.arrays.rack_ids)
    keep = same[old_of]
    sub = sizes[changed]
    at = np.repeat(start[changed] - (np.cumsum(sub) - sub), sub) + np.arange(int(sub.sum()))
    tdp, of, rack = _groups_of(instance, stages.gpus[at], changed, sub)
    key = np.concatenate((old_of[keep] * n_racks + old_rack[keep], of * n_racks + rack))
    order = np.argsort(key, kind="stable")
    key = key[order]
    return np.concatenate((old_tdp[keep], tdp))[order], key // n_racks, key % n_racks


def _changed_stages(
    stages: Stages, old_gpus: np.ndarray, old_start: np.ndarray, same: np.ndarray
) -> np.ndarray:
    """The stages (increasing) whose size (``same``: as the kept stage's) or GPUs differ
    from the kept ones: slices compared where the kept stages sit as far off."""
    start = stages.start
    shift = old_start[:-1] - start[:-1]
    differs = np.ones(len(stages.gpus), dtype=bool)
    cuts = np.flatnonzero(shift[1:] != shift[:-1]) + 1
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(shift)], strict=True):
        top = hi  # the run's stages as large as the kept ones, from its first
        while top > lo and not same[top - 1]:
            top -= 1
        g0, g1, d = int(start[lo]), int(start[top]), int(shift[lo])
        differs[g0:g1] = old_gpus[g0 + d : g1 + d] != stages.gpus[g0:g1]
    stage_of = np.searchsorted(start, np.flatnonzero(differs), side="right") - 1
    return np.union1d(stage_of, np.flatnonzero(~same))


def _floor_powers(tau: float, b: np.ndarray, hi: np.ndarray, alpha: float) -> np.ndarray:
    """``np.clip((tau / b) ** (1 / alpha), 1, hi)``, the power taken only where ``b < tau``:
    elsewhere it is at most 1 and clipped to ``min(1, hi)`` exactly."""
    out = np.minimum(1.0, hi)
    low = np.flatnonzero(b < tau)
    out[low] = np.clip((tau / b[low]) ** (1.0 / alpha), 1.0, hi[low])
    return out


_FEW = 64
"""Distinct (base, cap) pairs up to which :class:`_FloorGroups` computes the powers of
a bisection step in Python (:func:`_floor_powers`' numbers: ``x ** y`` is the C
library's ``pow``, as numpy's)."""


class _FloorGroups:
    """The (stage, rack) groups of :func:`boost_floor_stages` and the rooms they share.

    ``tdp``: total watts of each group at power 1; ``base`` and ``caps``: its
    stage's speed base and largest multiplier; ``rack``: its rack. The
    powers are computed per distinct ``(base, caps)`` pair (``inv`` maps the
    groups to them); ``single``: no rack holds two groups.
    """

    def __init__(
        self,
        tdp: np.ndarray,
        base: np.ndarray,
        caps: np.ndarray,
        rack: np.ndarray,
        n_racks: int,
        rack_room: np.ndarray,
        site_room: float,
        keep: float,
        alpha: float,
    ) -> None:
        self.tdp = tdp
        self.rack = rack
        self.n_racks = n_racks
        self.alpha = alpha
        order = np.lexsort((caps, base))
        new = np.ones(len(order), dtype=bool)
        new[1:] = (base[order][1:] != base[order][:-1]) | (caps[order][1:] != caps[order][:-1])
        self.base = base[order][new]
        self.caps = caps[order][new]
        self.inv = np.empty(len(order), dtype=np.int64)
        self.inv[order] = np.cumsum(new) - 1
        self.room = rack_room * keep
        self.site = site_room * keep
        few = len(self.base) <= _FEW
        self.few = list(zip(self.base.tolist(), self.caps.tolist(), strict=True)) if few else None
        per_rack = np.bincount(rack, minlength=n_racks)
        self.single = bool(per_rack.max(initial=0) <= 1)
        if self.single:  # each group's draw is its rack's; the other racks draw 0
            self.group_room = self.room[rack]
            self.empty_ok = bool(np.all(0.0 <= self.room[per_rack == 0]))

    def fits(self, tau: float) -> bool:
        """Does the extra draw of every stage at speed ``tau`` fit the racks and the site?"""
        if self.few is not None:  # a handful of distinct stages: the same numbers, in Python
            inv_alpha = 1.0 / self.alpha
            step = np.array(
                [
                    (min(max((tau / b) ** inv_alpha, 1.0), hi) if b < tau else min(1.0, hi)) - 1.0
                    for b, hi in self.few
                ]
            )
        else:
            step = _floor_powers(tau, self.base, self.caps, self.alpha) - 1.0
        extra = self.tdp * step[self.inv]
        if self.single:
            racks_ok = self.empty_ok and bool((extra <= self.group_room).all())
        else:
            per_rack = np.bincount(self.rack, weights=extra, minlength=self.n_racks)
            racks_ok = bool(np.all(per_rack <= self.room))
        return racks_ok and bool(extra.sum() <= self.site)

    def highest(self, lo: float, top: float, steps: int) -> float:
        """``steps`` bisection steps between a speed that fits (``lo``) and ``top``.

        Stops early once a step cannot change ``lo`` any more: its mid is
        ``lo`` (which fits), or ``top`` after ``top`` failed (the same mid, the
        same answer, in every later step): the same result as all ``steps``.
        """
        top_failed = False
        for _ in range(steps):
            mid = 0.5 * (lo + top)
            if mid == lo or (top_failed and mid == top):
                break
            if self.fits(mid):
                lo = mid
            else:
                top, top_failed = mid, True
        return lo


TRIM_MARGIN = 1e-9
"""Relative margin :func:`trim_powers` adds to the multipliers it computes: far above
the rounding of ``x ** (1 / alpha)``, so a trimmed stage is never slower than asked."""


def trim_powers(
    instance: Instance,
    stages: Stages,
    tp: np.ndarray,
    powers: np.ndarray,
    need: np.ndarray,
    slowest: np.ndarray | None = None,
) -> np.ndarray:
    """Lower every stage's multiplier to the least that keeps its replica at speed ``need``.

    A boost beyond what the batch split uses buys no goodput: with batches
    ``b_r`` and step time ``theta``, replica ``r`` only needs the speed
    ``b_r (1 + rho) / theta``. Each stage gets ``max(1, (need / base) ** (1 /
    alpha))`` (``base``: its degree factor times its slowest GPU's speed over
    ``c``), with :data:`TRIM_MARGIN`, never more than it had.

    Parameters
    ----------
    instance
        The instance.
    stages
        The replicas' stages.
    tp
        Degree per replica.
    powers
        Multiplier per stage.
    need
        Speed per replica (sequences per second) to keep; 0 lets a replica's
        stages fall back to 1.
    slowest
        Per stage, the speed of its slowest GPU, when known.

    Returns
    -------
    numpy.ndarray
        Multiplier per stage, each at most its value in ``powers``.
    """
    job = instance.job
    out = np.array(powers, dtype=float)
    if len(stages.replica) == 0 or job.power_exponent <= 0:
        return out
    if slowest is None:
        slowest = stages.stage_min(instance.arrays.speed)
    base = _degree_factors(instance, tp)[stages.replica] * slowest / job.seq_time_s
    want = np.asarray(need, dtype=float)[stages.replica]
    with np.errstate(divide="ignore", invalid="ignore"):
        pi = (want / base) ** (1.0 / job.power_exponent) * (1.0 + TRIM_MARGIN)
    pi = np.where(np.isfinite(pi), pi, out)  # speed-0 stage: left as it is
    return np.minimum(out, np.maximum(pi, 1.0))
