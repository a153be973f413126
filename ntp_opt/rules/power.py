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
:func:`floor_mw`); ``tests/rules/test_power_once.py`` fails on a budget compared
anywhere else in the package.

The boosts, which raise stages' multipliers within the rooms these draws
leave, are in :mod:`ntp_opt.rules.boost`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ntp_opt.rules.tolerances import (
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
    "board_over",
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
    the draw of :func:`rack_and_site_draw`. When none differs, the new draw
    shares ``last``'s arrays (a draw's arrays are only ever read).

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
    differs = power_of != last.power_of
    if a.healthy is not last.healthy:
        differs |= a.healthy != last.healthy
    changed = np.flatnonzero(differs)
    if changed.size == 0:  # the same draw (its arrays are only read)
        drawn = Drawn(
            power_of, a.healthy, last.per_gpu, last.rack, last.site, cluster, last.by_rack
        )
        return drawn, changed
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
