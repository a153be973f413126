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
from typing import TYPE_CHECKING

import numpy as np

from ntp_opt.rules.goodput import replica_speed
from ntp_opt.rules.tolerances import BOOST_MARGIN, POWER_TOL, WATT_SLACK

if TYPE_CHECKING:
    from ntp_opt.model.instance import Instance

__all__ = [
    "board_over",
    "boost_floor",
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
    (bisection in ``steps`` steps), or nothing.

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
    a = instance.arrays
    job = instance.job
    alpha = job.power_exponent
    powers = [list(p) for _, _, p in replicas]
    if not can_boost(instance):
        return powers, []
    rack_room = np.array(rack_room, dtype=float)
    target = 1.0 / job.seq_time_s
    keep = 1.0 - margin

    def need(i: int, goal: float) -> tuple[list[float], np.ndarray, float]:
        """Multipliers reaching speed ``goal``, extra watts per rack and in all."""
        t, gs, pws = replicas[i]
        factor = job.tp_factor(t) / job.seq_time_s
        mult, extra_rack, extra = [], np.zeros(len(a.rack_ids)), 0.0
        for g, pw in zip(gs, pws, strict=True):
            hi = stage_cap(instance, g)
            pi = (goal / (factor * float(a.speed[g].min()))) ** (1.0 / alpha)
            pi = min(max(pi, pw), max(hi, pw))
            watts = a.tdp[g] * (pi - pw)
            np.add.at(extra_rack, a.gpu_rack[g], watts)
            extra += float(watts.sum())
            mult.append(pi)
        return mult, extra_rack, extra

    def fits(extra_rack: np.ndarray, extra: float) -> bool:
        return bool(np.all(extra_rack <= rack_room * keep) and extra <= site_room * keep)

    def speed(i: int) -> float:
        t, gs, pws = replicas[i]
        return replica_speed(job, t, [float(a.speed[g].min()) for g in gs], list(pws))

    order = sorted(candidates, key=lambda i: (need(i, target)[2], i))
    boosted = []
    for i in order:
        mult, extra_rack, extra = need(i, target)
        if not fits(extra_rack, extra):
            lo, up = speed(i), target  # bisect on the reachable speed
            for _ in range(steps):
                mid = 0.5 * (lo + up)
                if fits(*need(i, mid)[1:]):
                    lo = mid
                else:
                    up = mid
            mult, extra_rack, extra = need(i, lo)
            if not fits(extra_rack, extra) or extra <= 0:
                continue
        powers[i] = mult
        rack_room = rack_room - extra_rack
        site_room -= extra
        boosted.append(i)
    return powers, boosted


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
    a = instance.arrays
    job = instance.job
    alpha = job.power_exponent
    ones = [[1.0] * len(m) for _, m in replicas]
    if not replicas or not can_boost(instance):
        return ones
    base = np.concatenate(
        [np.repeat([job.tp_factor(t) * float(a.speed[g].min()) for g in m], t) for t, m in replicas]
    )
    flat = np.concatenate([g for _, m in replicas for g in m])
    # per stage (and per GPU, repeated): the largest multiplier job and boards allow
    caps = np.concatenate([np.repeat([stage_cap(instance, g) for g in m], t) for t, m in replicas])
    # aggregate per (stage, rack): one power multiplier per stage
    sizes = np.concatenate([np.full(len(m), t) for t, m in replicas])
    stage = np.repeat(np.arange(len(sizes)), sizes)
    n_racks = len(a.rack_ids)
    key, inverse = np.unique(stage * n_racks + a.gpu_rack[flat], return_inverse=True)
    tdp = np.bincount(inverse, weights=a.tdp[flat], minlength=len(key))  # watts per group
    rack = key % n_racks
    first = np.searchsorted(stage, key // n_racks)
    u_base = base[first]  # the group's stage's base
    u_caps = caps[first]
    keep = 1 - margin

    def powers(tau: float, b: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return np.clip((tau / b) ** (1.0 / alpha), 1.0, hi)

    def fits(tau: float) -> bool:
        extra = tdp * (powers(tau, u_base, u_caps) - 1.0)  # tdp here: total watts of the group
        per_rack = np.bincount(rack, weights=extra, minlength=n_racks)
        return bool(np.all(per_rack <= rack_room * keep) and extra.sum() <= site_room * keep)

    lo = float(base.min())
    top = float((base * caps**alpha).min())  # the fastest the slowest stage can get
    if not fits(lo):
        return ones
    for _ in range(steps):
        mid = 0.5 * (lo + top)
        if fits(mid):
            lo = mid
        else:
            top = mid
    pw = powers(lo, base, caps)
    out, k = [], 0
    for t, m in replicas:
        out.append([float(pw[k + i * t]) for i in range(len(m))])
        k += t * len(m)
    return out
