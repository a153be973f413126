"""The ``fast`` planner: sort-and-pack candidates, the best one validated, with a bound.

Made for instances too large for the exact planner (32k–131k GPUs) and for
re-planning: it builds a few candidate plans in array form, scores each with
the exact batch split, turns only the best into a :class:`~ntp_opt.plan.Plan`
(validated) and reports :func:`ntp_opt.milp.bounds.capacity_bound` next to it.

Candidates (each packed by sorted grouping, see ``docs/milp.md``):

* ``dp-drop``: full-degree slots only (no resharding overhead);
* ``ntp``: the paper's slots (full slots plus one reduced slot per domain);
* ``speed-aware``: each domain cut greedily into the stages of largest
  ``f(t) * slowest speed``: a straggler is left out as a spare when a
  smaller degree on faster GPUs is worth more, which the paper's heuristic
  never does;

each also in a *degree-fit* variant when the budgets force replicas out
(:func:`fit_power_by_degree`: one replica fewer dropped, degrees lowered
instead), and each without power boost, with the boost of
:func:`ntp_opt.baselines.ntp_pw`
(slow replicas lifted to nominal speed, cheapest first) and with
:func:`boost_floor` (every replica lifted to the highest common speed).
Deterministic: no randomness, ties broken by index.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.exact.bounds import capacity_bound
from ntp_opt.planners.heuristics import (
    Slot,
    boost_slowest,
    domain_slots,
    draw_at_power_one,
    fit_power,
    fits_at_power_one,
    pack_replicas,
    split_groups,
    to_replicas,
    used_mask,
)
from ntp_opt.rules.power import boost_floor as power_boost_floor
from ntp_opt.rules.power import can_boost, headroom, over_budget
from ntp_opt.rules.tolerances import BUDGET_SLACK
from ntp_opt.rules.validate import certified

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A plan in array form and its goodput (exact batch split)."""

    name: str
    groups: list[tuple[int, list[Slot]]]
    powers: list[list[float]]
    batches: tuple[int, ...]
    goodput: float


def speed_aware_slots(instance: Instance) -> list[Slot]:
    """Cut each domain into the stages worth the most, fastest GPUs first.

    From a domain's healthy GPUs (fastest first), repeatedly take the degree
    ``t`` (allowed, at most what is left) maximising ``f(t) * s_t`` where
    ``s_t`` is the ``t``-th fastest remaining speed; larger ``t`` on ties.

    Parameters
    ----------
    instance
        The instance.

    Returns
    -------
    list of Slot
    """
    a = instance.arrays
    job = instance.job
    factors = {t: job.tp_factor(t) for t in job.allowed}
    slots: list[Slot] = []
    for d, members in enumerate(a.domain_gpus):
        ok = members[a.healthy[members]]
        ok = ok[np.argsort(-a.speed[ok], kind="stable")]
        sp = a.speed[ok]
        start = 0
        while True:
            left = len(ok) - start
            best_t, best_v = 0, 0.0
            for t in job.allowed:
                if t <= left:
                    v = factors[t] * float(sp[start + t - 1])
                    if v >= best_v:
                        best_t, best_v = t, v
            if best_t == 0:
                break
            slots.append(Slot(d, ok[start : start + best_t], best_t))
            start += best_t
    return slots


def boost_floor(instance: Instance, groups: list[tuple[int, list[Slot]]]) -> list[list[float]]:
    """Power multipliers raising every replica to the highest common speed the budgets allow.

    :func:`ntp_opt.rules.power.boost_floor` from power 1. Under the ``fixed``
    policy goodput is set by the slowest replica, so this is the boost that
    counts; it complements :func:`ntp_opt.planners.heuristics.boost_slowest`,
    which only lifts slow replicas up to nominal speed.
    """
    if not groups or not can_boost(instance):
        return [[1.0] * len(m) for _, m in groups]
    rack_room, site_room = headroom(instance, used_mask(instance, groups).astype(float))
    reps = [(t, [s.gpus[:t] for s in m]) for t, m in groups]
    return power_boost_floor(instance, reps, rack_room, site_room)


def fit_power_by_degree(
    instance: Instance, groups: list[tuple[int, list[Slot]]]
) -> list[tuple[int, list[Slot]]] | None:
    """Fit the budgets at power 1 by dropping whole replicas, then one fewer plus lower degrees.

    :func:`ntp_opt.baselines.fit_power` drops the worst replicas until the
    used GPUs (and the idle draw of the others) fit; the last drop usually
    frees more watts than needed. This keeps one more replica and instead
    lowers the degree of replicas, worst first, one allowed step at a time,
    until the draw fits: a degree step frees ``pp (t - t')`` GPUs. Returns
    ``None`` when :func:`fit_power` drops nothing (nothing to refine) or the
    degree steps cannot make it fit.
    """
    kept = fit_power(instance, groups)
    if len(kept) == len(groups):
        return None
    a = instance.arrays
    job = instance.job
    out = [(t, list(m)) for t, m in groups[: len(kept) + 1]]
    lower = {t: max((u for u in job.allowed if u < t), default=None) for t in job.allowed}
    rack, site = draw_at_power_one(instance, used_mask(instance, out))
    saving = a.tdp * (1.0 - job.idle_power_fraction)  # a GPU going from used to idle

    def over() -> bool:
        racks, site_over = over_budget(instance, rack, site, tol=BUDGET_SLACK, slack=0.0)
        return bool(racks.any() or site_over)

    r = len(out) - 1  # worst replica first, one degree step each, round after round
    stuck = 0
    while over():
        t, members = out[r]
        step = lower.get(t)
        if step is not None:
            freed = np.concatenate([slot.gpus[step:t] for slot in members])
            rack -= np.bincount(a.gpu_rack[freed], weights=saving[freed], minlength=len(rack))
            site -= float(saving[freed].sum())
            out[r] = (step, members)
            stuck = 0
        else:
            stuck += 1
            if stuck >= len(out):
                return None  # every replica at the smallest degree and still over budget
        r = r - 1 if r > 0 else len(out) - 1
    # the running sums drift by rounding only: confirm with the exact check
    return out if fits_at_power_one(instance, used_mask(instance, out)) else None


def _score(
    instance: Instance, name: str, groups: list[tuple[int, list[Slot]]], boost: str
) -> Candidate | None:
    groups = fit_power(instance, groups)
    if boost == "slow":
        powers = boost_slowest(instance, groups)
    elif boost == "floor":
        powers = boost_floor(instance, groups)
    else:
        powers = [[1.0] * len(m) for _, m in groups]
    split = split_groups(instance, groups, powers)
    if split is None:
        return None
    return Candidate(name, groups, powers, split.batches, split.goodput)


def _to_plan(instance: Instance, c: Candidate) -> Plan:
    replicas = to_replicas(instance, c.groups, c.powers, c.batches)
    return Plan(instance.name, replicas, {"policy": "fast", "candidate": c.name})


def candidates(instance: Instance, *, cancel: threading.Event | None = None) -> list[Candidate]:
    """Score every candidate (see the module docstring), best first.

    Parameters
    ----------
    instance
        The instance.
    cancel
        Once set, no further packing is started after the first scored
        candidate: the best of those scored so far wins.

    Returns
    -------
    list of Candidate
        Sorted by goodput, best first; candidates with no feasible batch
        split (a paused ``fixed`` job) are left out.
    """
    boost = can_boost(instance)
    makers: dict[str, Callable[[], list[tuple[int, list[Slot]]]]] = {
        "dp-drop": lambda: pack_replicas(instance, domain_slots(instance, reduced=False)),
        "ntp": lambda: pack_replicas(instance, domain_slots(instance, reduced=True)),
        "speed-aware": lambda: pack_replicas(instance, speed_aware_slots(instance), by_value=True),
    }
    packs: dict[str, list[tuple[int, list[Slot]]]] = {}
    out: list[Candidate] = []

    def score(name: str, groups: list[tuple[int, list[Slot]]]) -> None:
        for b in ("", "slow", "floor") if boost else ("",):
            c = _score(instance, f"{name}+{b}" if b else name, groups, b)
            if c is not None:
                out.append(c)

    def stop() -> bool:
        return cancel is not None and cancel.is_set() and bool(out)

    # scored in the same order as ever, so that ties go the same way
    for name, make in makers.items():
        if stop():
            break
        packs[name] = make()
        score(name, packs[name])
    for name in list(packs):  # tight budgets: lower degrees instead of a whole replica
        if stop():
            break
        fitted = fit_power_by_degree(instance, packs[name])
        if fitted is not None:
            score(f"{name}+degree-fit", fitted)
    out.sort(key=lambda c: -c.goodput)
    return out


def plan_fast(
    instance: Instance, *, validate: bool = True, cancel: threading.Event | None = None
) -> tuple[Plan, float]:
    """The best candidate plan, validated, and an upper bound on goodput.

    Parameters
    ----------
    instance
        The instance.
    validate
        Check the plan and attach the validator's metrics (default). Only
        :func:`ntp_opt.solve.solve`, which checks every plan itself, turns it
        off.
    cancel
        Stop packing once set (:func:`candidates`); the plan is then the
        best candidate scored so far.

    Returns
    -------
    (Plan, float)
        The plan (empty when every candidate pauses) and
        :func:`~ntp_opt.milp.bounds.capacity_bound`.
    """
    found = candidates(instance, cancel=cancel)
    logger.debug("fast: %d candidates%s", len(found), f", best {found[0].name}" if found else "")
    if found:
        plan = _to_plan(instance, found[0])
    else:
        plan = Plan(instance.name, (), {"policy": "fast", "paused": True})
    return (certified(instance, plan) if validate else plan), capacity_bound(instance)
