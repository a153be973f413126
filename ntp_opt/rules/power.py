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

Budgets: every comparison of a draw with a rack or site budget goes through
:func:`fits` / :func:`exceeds` (watts, a relative and an absolute slack: the
validator's by default) or :func:`fits_mw` (the exact planner's integer
milliwatts, draws rounded up with :func:`ceil_mw`, budgets down with
:func:`floor_mw`); ``tests/test_power_once.py`` fails on a budget compared
anywhere else in the package.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ntp_opt.rules.goodput import replica_speed
from ntp_opt.rules.tolerances import (
    BOOST_MARGIN,
    MW_ROUND_SLACK,
    POWER_TOL,
    WATT_SLACK,
    WHOLE_WATT_NOISE,
)

if TYPE_CHECKING:
    from ntp_opt.model.instance import Instance

__all__ = [
    "MW",
    "Drawn",
    "Stages",
    "board_over",
    "boost_floor_stages",
    "boost_stages",
    "budget_limit",
    "budget_slack",
    "can_boost",
    "ceil_mw",
    "ceil_mw_array",
    "exceeds",
    "extra_draw",
    "fits",
    "fits_mw",
    "floor_mw",
    "gpu_draw",
    "headroom",
    "idle_draw",
    "largest_cap",
    "over_budget",
    "rack_and_site_draw",
    "redraw",
    "site_idle_draw",
    "stage_cap",
    "trim_powers",
    "whole_watts",
]


#: Milliwatts per watt: power enters the exact planner's integer programs in mW.
MW = 1000.0


def budget_slack(budget: Any) -> Any:
    """Watts over ``budget`` (scalar or array) the validator forgives.

    ``budget * POWER_TOL + WATT_SLACK``: what :func:`budget_limit` adds to a budget
    with its defaults (an upper bound that must hold for every plan the validator
    accepts adds it to the budget's room).
    """
    return budget * POWER_TOL + WATT_SLACK


def budget_limit(budget: Any, *, tol: float = POWER_TOL, slack: float = WATT_SLACK) -> Any:
    """The largest draw within ``budget`` (watts, scalar or array): ``budget * (1 + tol) + slack``.

    The defaults are the validator's; the planners' own power-1 fit tests pass
    ``tol=BUDGET_SLACK, slack=0`` (stricter), the exact model's step-time
    tightening ``tol=TIGHTEN_TOL, slack=0``.
    """
    return budget * (1 + tol) + slack


def fits(draw: Any, budget: Any, *, tol: float = POWER_TOL, slack: float = WATT_SLACK) -> Any:
    """``draw <= budget_limit(budget, tol=tol, slack=slack)``, elementwise for arrays.

    Parameters
    ----------
    draw, budget
        Watts (scalars or arrays of one shape).
    tol, slack
        Relative and absolute slack (:func:`budget_limit`); the validator's by default.

    Returns
    -------
    bool or numpy.ndarray
        Whether (each) draw is within its budget.
    """
    return draw <= budget_limit(budget, tol=tol, slack=slack)


def exceeds(draw: Any, budget: Any, *, tol: float = POWER_TOL, slack: float = WATT_SLACK) -> Any:
    """``draw > budget_limit(budget, tol=tol, slack=slack)``: the negation of :func:`fits`."""
    return draw > budget_limit(budget, tol=tol, slack=slack)


def whole_watts(tdp: float, power: float = 1.0) -> int:
    """A GPU's draw at multiplier ``power`` in whole watts, rounded down (an exported limit).

    ``floor(tdp * power + WHOLE_WATT_NOISE)``.
    """
    return math.floor(float(tdp) * float(power) + WHOLE_WATT_NOISE)


def ceil_mw(watts: float) -> int:
    """Watts as integer milliwatts, rounded up (draws are rounded up, budgets down).

    :data:`~ntp_opt.rules.tolerances.MW_ROUND_SLACK` milliwatts are forgiven, so a
    draw exactly at a budget is not excluded by float noise.
    """
    return math.ceil(watts * MW - MW_ROUND_SLACK)


def ceil_mw_array(watts: np.ndarray) -> np.ndarray:
    """:func:`ceil_mw` elementwise, as floats (the same integers)."""
    out: np.ndarray = np.ceil(watts * MW - MW_ROUND_SLACK)
    return out


def floor_mw(watts: float) -> int:
    """A budget in watts as integer milliwatts, rounded down (see :func:`ceil_mw`)."""
    return math.floor(watts * MW + MW_ROUND_SLACK)


def fits_mw(draw_w: Any, budget_mw: Any) -> Any:
    """Does a draw (watts) fit a budget in integer milliwatts (:func:`floor_mw`)?

    The draw is rounded up as :func:`ceil_mw` rounds it; arrays elementwise.
    """
    if isinstance(draw_w, np.ndarray):
        return ceil_mw_array(draw_w) <= budget_mw
    return ceil_mw(draw_w) <= budget_mw


def idle_draw(instance: Instance, alive: np.ndarray | None = None) -> np.ndarray:
    """Watts every GPU draws idle: ``tdp * idle_power_fraction`` if alive, else 0.

    ``alive``: per GPU (default: the instance's healthy GPUs).
    """
    a = instance.arrays
    ok = a.healthy if alive is None else alive
    draw: np.ndarray = np.where(ok, a.tdp * instance.job.idle_power_fraction, 0.0)
    return draw


def site_idle_draw(instance: Instance) -> float:
    """Watts the site draws with every healthy GPU idle.

    The healthy GPUs' TDPs summed, times ``idle_power_fraction`` (the exact
    planner's integer programs round this figure to milliwatts: its order of
    operations is kept).
    """
    a = instance.arrays
    return float((a.tdp * a.healthy).sum() * instance.job.idle_power_fraction)


def extra_draw(tdp: Any, power: Any, idle: Any) -> Any:
    """Watts a GPU of ``tdp`` draws at multiplier ``power`` beyond its idle draw.

    ``tdp * (power - idle)`` (``idle``: the idle power fraction): a stage's
    extra-draw coefficient per GPU; scalars or arrays.
    """
    return tdp * (power - idle)


def stage_cap(instance: Instance, gpus: np.ndarray | list[int]) -> float:
    """The largest multiplier a stage on GPUs ``gpus`` (indices) may run at.

    ``1 + max_boost`` for an empty stage.
    """
    idx = np.asarray(gpus, dtype=np.int64)
    if idx.size == 0:
        return 1.0 + instance.job.max_boost
    return float(instance.max_multiplier[idx].min())


def gpu_draw(
    instance: Instance,
    power_of: np.ndarray,
    alive: np.ndarray | None = None,
    *,
    at: np.ndarray | None = None,
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
    at
        GPU indices: the draws of these GPUs only (the same values).

    Returns
    -------
    numpy.ndarray
        ``tdp * power_of`` for used GPUs, ``tdp * idle_power_fraction`` for
        unused healthy ones, 0 for failed ones.
    """
    a = instance.arrays
    idle = instance.job.idle_power_fraction
    ok = a.healthy if alive is None else alive
    tdp = a.tdp
    if at is not None:
        power_of, ok, tdp = power_of[at], ok[at], tdp[at]
    draw: np.ndarray = np.where(power_of > 0, power_of, np.where(ok, idle, 0.0)) * tdp
    return draw


def rack_and_site_draw(
    instance: Instance, power_of: np.ndarray, alive: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """Watts per rack (rack order) and for the site; see :func:`gpu_draw`."""
    per_gpu = gpu_draw(instance, power_of, alive)
    return _rack_sums(instance, per_gpu), float(per_gpu.sum())


def _rack_sums(instance: Instance, per_gpu: np.ndarray) -> np.ndarray:
    """Watts per rack: each rack's GPUs added in index order (:func:`redraw` relies on it)."""
    a = instance.arrays
    rack: np.ndarray = np.bincount(a.gpu_rack, weights=per_gpu, minlength=len(a.rack_ids))
    return rack


@dataclass(frozen=True, eq=False)
class Drawn:
    """The draw of one set of multipliers on the instance's healthy GPUs (:func:`redraw`).

    Attributes
    ----------
    power_of
        Per GPU, its multiplier (0: unused).
    healthy
        The instance's healthy GPUs.
    per_gpu
        Watts per GPU (:func:`gpu_draw`).
    rack
        Watts per rack (rack order), as :func:`rack_and_site_draw`.
    site
        Watts at the site, as :func:`rack_and_site_draw`.
    cluster
        What the draw was read from besides the two masks: the TDP, rack and
        board arrays (the objects) and the idle power fraction.
    by_rack
        The GPU indices by rack (by index within a rack), and each rack's
        first position in it (one more entry than racks).
    """

    power_of: np.ndarray
    healthy: np.ndarray
    per_gpu: np.ndarray
    rack: np.ndarray
    site: float
    cluster: tuple[Any, ...]
    by_rack: tuple[np.ndarray, np.ndarray]


def redraw(
    instance: Instance, power_of: np.ndarray, last: Drawn | None = None
) -> tuple[Drawn, np.ndarray | None]:
    """:func:`rack_and_site_draw` (the healthy GPUs idle), from ``last`` where it can.

    Where ``last`` was drawn on the same TDP, rack and board arrays (the same
    objects) and idle fraction, only the GPUs whose multiplier or health
    differs are drawn again and only their racks summed again (each rack's
    GPUs in index order, as :func:`numpy.bincount` sums them): bit for bit
    the draw of :func:`rack_and_site_draw`.

    Parameters
    ----------
    instance
        The instance.
    power_of
        Per GPU: its stage's multiplier, or 0 when it is in no stage.
    last
        An earlier draw (of another plan, or on the instance before an event).

    Returns
    -------
    tuple of (Drawn, numpy.ndarray or None)
        The draw, and the GPUs drawn again (``None``: every GPU, ``last`` not
        usable).
    """
    a = instance.arrays
    cluster = (a.tdp, a.gpu_rack, a.max_power, instance.job.idle_power_fraction)
    usable = (
        last is not None
        and last.power_of.shape == power_of.shape
        and all(x is y for x, y in zip(last.cluster[:3], cluster[:3], strict=True))
        and last.cluster[3] == cluster[3]
    )
    if last is None or not usable:
        per_gpu = gpu_draw(instance, power_of)
        rack = _rack_sums(instance, per_gpu)
        order = np.argsort(a.gpu_rack, kind="stable")
        starts = np.searchsorted(a.gpu_rack[order], np.arange(len(a.rack_ids) + 1))
        drawn = Drawn(
            power_of, a.healthy, per_gpu, rack, float(per_gpu.sum()), cluster, (order, starts)
        )
        return drawn, None
    changed = np.flatnonzero((power_of != last.power_of) | (a.healthy != last.healthy))
    per_gpu = last.per_gpu.copy()
    per_gpu[changed] = gpu_draw(instance, power_of, at=changed)
    rack = last.rack.copy()
    racks = np.unique(a.gpu_rack[changed])
    if racks.size:
        order, starts = last.by_rack
        # each rack's GPUs by index, as the full sum adds them
        idx = np.concatenate([order[starts[r] : starts[r + 1]] for r in racks.tolist()])
        rack[racks] = np.bincount(
            np.searchsorted(racks, a.gpu_rack[idx]), weights=per_gpu[idx], minlength=racks.size
        )
    drawn = Drawn(power_of, a.healthy, per_gpu, rack, float(per_gpu.sum()), cluster, last.by_rack)
    return drawn, changed


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
    instance: Instance,
    power_of: np.ndarray,
    alive: np.ndarray | None = None,
    *,
    memo: dict[Any, Any] | None = None,
) -> tuple[np.ndarray, float]:
    """Watts left per rack (rack order) and at the site at the draw of :func:`gpu_draw`.

    ``memo`` (the healthy GPUs idle only): the draw is kept in it and the
    next call's drawn from it (:func:`redraw`); the same rooms without it.
    """
    a = instance.arrays
    if memo is not None and alive is None:
        drawn, _ = redraw(instance, power_of, memo.get("headroom"))
        memo["headroom"] = drawn
        rack, site = drawn.rack, drawn.site
    else:
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
    racks = exceeds(rack_w, a.rack_budget, tol=tol, slack=slack)
    return racks, bool(exceeds(site_w, a.site_budget, tol=tol, slack=slack))


def board_over(
    instance: Instance, power_of: np.ndarray, *, at: np.ndarray | None = None
) -> np.ndarray:
    """Boolean per GPU: its multiplier asks for more than its board's ``max_power_w``.

    ``at``: GPU indices; the flags of these GPUs only.
    """
    a = instance.arrays
    tdp, cap = a.tdp, a.max_power
    if at is not None:
        power_of, tdp, cap = power_of[at], tdp[at], cap[at]
    over: np.ndarray = power_of * tdp > cap * (1 + POWER_TOL)
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
        Watts left per rack and at the site (:func:`headroom`); not modified.
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
        """:meth:`need`, computed."""
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
        """The bisection of :meth:`bisect`: its end, and per step the needs (extra watts
        per touched rack and in all) at its mid and whether they fit."""
        left = self.steps
        rows: list[np.ndarray] = []
        extras: list[np.ndarray] = []
        oks: list[np.ndarray] = []
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
            _, per_rack, extra = self.need(i, mids)
            ok = self.fits(i, per_rack, extra)
            node = 0
            path = []
            for _ in range(depth):
                path.append(node)
                if ok[node]:
                    lo, node = mids[node], 2 * node + 2
                else:
                    up, node = mids[node], 2 * node + 1
            rows.append(per_rack[path])
            extras.append(extra[path])
            oks.append(ok[path])
            left -= depth
        if not rows:
            width = int(self.kptr[i + 1] - self.kptr[i])  # no step: nothing to check
            return lo, np.zeros((0, width)), np.zeros(0), np.zeros(0, dtype=bool)
        return lo, np.concatenate(rows), np.concatenate(extras), np.concatenate(oks)

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
    :func:`stage_cap`); the largest ``tau`` whose extra draw (over power 1)
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
        Watts left per rack and at the site at power 1 (:func:`headroom`).
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
    job = instance.job
    alpha = job.power_exponent
    ones = np.ones(len(stages.replica))
    if len(stages.replica) == 0 or not can_boost(instance):
        return ones
    sizes = stages.sizes
    per_degree = {t: job.tp_factor(t) for t in set(tp.tolist())}
    factor = np.array([per_degree[t] for t in tp.tolist()], dtype=float)
    if slowest is None:
        slowest = stages.stage_min(a.speed)
    stage_base = factor[stages.replica] * slowest
    n_racks = len(a.rack_ids)
    if memo is not None:
        _check_memo(instance, memo)
    kept = None if memo is None else memo.get("floor")
    if (
        kept is not None
        and np.array_equal(kept[0], stages.gpus)
        and np.array_equal(kept[1], stages.start)
    ):
        stage_caps, tdp, of, rack = kept[2:]
    else:
        # per stage: the largest multiplier job and boards allow
        stage_caps = stages.stage_min(instance.max_multiplier) if caps is None else caps
        flat = stages.gpus
        # aggregate per (stage, rack): one power multiplier per stage
        stage = np.repeat(np.arange(len(sizes)), sizes)
        key, inverse = _runs(stage * n_racks + a.gpu_rack[flat])
        tdp = np.bincount(inverse, weights=a.tdp[flat], minlength=len(key))  # watts per group
        of = key // n_racks
        rack = key % n_racks
        if memo is not None:
            memo["floor"] = (stages.gpus.copy(), stages.start.copy(), stage_caps, tdp, of, rack)
    groups = _FloorGroups(
        tdp,
        stage_base[of],
        stage_caps[of],
        rack,
        n_racks,
        np.asarray(rack_room, dtype=float),
        site_room,
        1 - margin,
        alpha,
    )
    some = sizes > 0
    lo = float(stage_base[some].min())
    top = float((stage_base[some] * stage_caps[some] ** alpha).min())  # the slowest stage's best
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
                    min(max((tau / b) ** inv_alpha, 1.0), hi) if b < tau else min(1.0, hi)
                    for b, hi in self.few
                ]
            )
            step -= 1.0
        else:
            step = _floor_powers(tau, self.base, self.caps, self.alpha) - 1.0
        extra = self.tdp * step[self.inv]
        if self.single:
            racks_ok = self.empty_ok and bool((extra <= self.group_room).all())
        else:
            per_rack = np.bincount(self.rack, weights=extra, minlength=self.n_racks)
            racks_ok = bool(np.all(per_rack <= self.room))
        return racks_ok and bool(extra.sum() <= self.site)


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
    per_degree = {t: job.tp_factor(t) for t in set(np.asarray(tp).tolist())}
    factor = np.array([per_degree[t] for t in np.asarray(tp).tolist()], dtype=float)
    base = factor[stages.replica] * slowest / job.seq_time_s
    want = np.asarray(need, dtype=float)[stages.replica]
    with np.errstate(divide="ignore", invalid="ignore"):
        pi = (want / base) ** (1.0 / job.power_exponent) * (1.0 + TRIM_MARGIN)
    pi = np.where(np.isfinite(pi), pi, out)  # speed-0 stage: left as it is
    return np.minimum(out, np.maximum(pi, 1.0))
