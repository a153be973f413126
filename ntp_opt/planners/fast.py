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
* ``count-fit`` and ``count-max`` (only when the paper's slots are too few for
  the replicas a ``fixed`` batch needs, or for as many as may run): domains
  cut into more, smaller stages (:func:`count_fit_table`), so that ``fast``
  does not pause a job that smaller stages can run;

each also in a *degree-fit* variant when the budgets force replicas out
(:func:`fit_power_by_degree`: one replica fewer dropped, degrees lowered
instead), and each without power boost, with the boost of
:func:`ntp_opt.baselines.ntp_pw`
(slow replicas lifted to nominal speed, cheapest first) and with
:func:`boost_floor` (every replica lifted to the highest common speed).
The winner's multipliers are lowered to what its batch split uses
(:func:`ntp_opt.planners.heuristics.trim_packed`): the same goodput, no power
spent for nothing. Deterministic: no randomness, ties broken by index.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.exact.bounds import capacity_bound
from ntp_opt.planners.heuristics import (
    Packing,
    Slot,
    SlotTable,
    boost_slowest_packed,
    domain_slot_table,
    draw_at_power_one,
    fastest_first,
    fit_packing,
    fits_at_power_one,
    pack,
    packing_replicas,
    split_packing,
    trim_packed,
    used_mask,
)
from ntp_opt.rules.goodput import BatchSplit
from ntp_opt.rules.power import boost_floor_stages, can_boost, headroom, over_budget
from ntp_opt.rules.tolerances import BUDGET_SLACK
from ntp_opt.rules.validate import certified

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Candidate:
    """A plan in array form (replicas, multipliers per stage), its goodput (exact split)."""

    name: str
    packing: Packing
    powers: np.ndarray
    batches: tuple[int, ...]
    goodput: float


def speed_aware_table(instance: Instance) -> SlotTable:
    """:func:`speed_aware_slots` as a :class:`~ntp_opt.planners.heuristics.SlotTable`.

    Every domain takes its next stage in the same round: one pass over the
    allowed degrees per round, vectorised over the domains.
    """
    a = instance.arrays
    job = instance.job
    g, counts, first = fastest_first(instance)
    sp = a.speed[g]
    factors = {t: job.tp_factor(t) for t in job.allowed}
    start = np.zeros(len(counts), dtype=np.int64)
    active = np.arange(len(counts), dtype=np.int64)
    doms, starts, degrees, rounds = [], [], [], []
    rnd = 0
    while len(active):
        left = counts[active] - start[active]
        at = first[active] + start[active]
        best_t = np.zeros(len(active), dtype=np.int64)
        best_v = np.zeros(len(active))
        for t in job.allowed:
            ok = t <= left
            v = factors[t] * sp[np.where(ok, at + t - 1, 0)] if len(sp) else np.zeros(len(ok))
            better = ok & (v >= best_v)
            best_t[better] = t
            best_v[better] = v[better]
        take = best_t > 0
        doms.append(active[take])
        starts.append(at[take])
        degrees.append(best_t[take])
        rounds.append(np.full(int(take.sum()), rnd))
        start[active[take]] += best_t[take]
        active = active[take]
        rnd += 1
    dom, st, deg = np.concatenate(doms), np.concatenate(starts), np.concatenate(degrees)
    order = np.lexsort((np.concatenate(rounds), dom))
    dom, st, deg = dom[order], st[order], deg[order]
    width = max(job.allowed)
    cols = np.arange(width)
    idx = np.minimum(st[:, None] + cols, max(len(g) - 1, 0))
    gpus = np.where(cols < deg[:, None], g[idx] if len(g) else -1, -1)
    return SlotTable.build(a.speed, dom, deg, gpus)


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
    return speed_aware_table(instance).slots()


def boost_floor(instance: Instance, groups: list[tuple[int, list[Slot]]]) -> list[list[float]]:
    """Power multipliers raising every replica to the highest common speed the budgets allow.

    :func:`ntp_opt.rules.power.boost_floor_stages` from power 1. Under the ``fixed``
    policy goodput is set by the slowest replica, so this is the boost that
    counts; it complements :func:`ntp_opt.planners.heuristics.boost_slowest`,
    which only lifts slow replicas up to nominal speed.
    """
    if not groups or not can_boost(instance):
        return [[1.0] * len(m) for _, m in groups]
    powers: list[list[float]] = boost_floor_packed(
        instance, Packing.from_groups(instance, groups)
    ).tolist()
    return powers


def boost_floor_packed(instance: Instance, packing: Packing) -> np.ndarray:
    """:func:`boost_floor` on a :class:`~ntp_opt.planners.heuristics.Packing` (R x pp)."""
    shape = packing.members.shape
    if len(packing) == 0 or not can_boost(instance):
        return np.ones(shape)
    rack_room, site_room = headroom(instance, used_mask(instance, packing).astype(float))
    out = boost_floor_stages(instance, packing.stages(), packing.tp, rack_room, site_room)
    return out.reshape(shape)


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
    packed = Packing.from_groups(instance, groups)
    out = fit_by_degree(instance, packed, fit_packing(instance, packed))
    if out is None:
        return None
    return [(t, list(m)) for t, (_, m) in zip(out.tp.tolist(), groups, strict=False)]


def fit_by_degree(instance: Instance, packing: Packing, kept: Packing) -> Packing | None:
    """:func:`fit_power_by_degree` on a packing and its :func:`fit_packing` ``kept``.

    The draws are updated on the racks a degree step touches only.
    """
    if len(kept) == len(packing):
        return None
    a = instance.arrays
    job = instance.job
    out = packing.head(len(kept) + 1)
    tp = out.tp.copy()
    members = out.members
    gpus = out.slots.gpus
    lower = {t: max((u for u in job.allowed if u < t), default=None) for t in job.allowed}
    rack, site = draw_at_power_one(instance, used_mask(instance, out))
    rack = rack.copy()
    saving = a.tdp * (1.0 - job.idle_power_fraction)  # a GPU going from used to idle
    racks_over, site_over = over_budget(instance, rack, site, tol=BUDGET_SLACK, slack=0.0)
    n_over = int(racks_over.sum())
    rack_cap = a.rack_budget * (1 + BUDGET_SLACK) + 0.0  # as over_budget(slack=0) compares
    site_cap = a.site_budget * (1 + BUDGET_SLACK) + 0.0

    r = len(out) - 1  # worst replica first, one degree step each, round after round
    stuck = 0
    while n_over or site_over:
        t = int(tp[r])
        step = lower.get(t)
        if step is not None:
            freed = gpus[members[r], step:t].ravel()
            touched, inverse = np.unique(a.gpu_rack[freed], return_inverse=True)
            n_over -= int(np.count_nonzero(rack[touched] > rack_cap[touched]))
            rack[touched] -= np.bincount(inverse.ravel(), weights=saving[freed])
            n_over += int(np.count_nonzero(rack[touched] > rack_cap[touched]))
            site -= float(saving[freed].sum())
            site_over = bool(site > site_cap)
            tp[r] = step
            stuck = 0
        else:
            stuck += 1
            if stuck >= len(out):
                return None  # every replica at the smallest degree and still over budget
        r = r - 1 if r > 0 else len(out) - 1
    # the running sums drift by rounding only: confirm with the exact check
    fitted = out.with_tp(tp)
    return fitted if fits_at_power_one(instance, used_mask(instance, fitted)) else None


def replicas_needed(instance: Instance) -> int:
    """Fewest replicas that can carry the batch: ``ceil(B / max_local_batch)`` under
    the ``fixed`` policy, 1 under ``elastic``."""
    job = instance.job
    if job.batch_policy != "fixed":
        return 1
    return -(-job.global_batch // job.local_batch_max)


def count_fit_table(instance: Instance, replicas: int | None = None) -> SlotTable | None:
    """The paper's slots, with domains cut into more, smaller stages until ``pp`` times
    ``replicas`` (default :func:`replicas_needed`) slots exist; ``None`` when the
    paper's slots suffice.

    A domain of ``h`` healthy GPUs cut into ``k`` stages runs them at the largest
    allowed degree ``t_k`` with ``k t_k <= h``, the GPUs left over raising as many
    of them as they can to ``T`` (then one to the largest degree the rest allows).
    The extra stages are taken where ``t_k`` is largest (fewest GPUs given up),
    domain by domain in index order on ties. Without it ``fast`` would pause a
    ``fixed`` job whose full and reduced slots are too few while smaller stages
    fit (a domain of 28 healthy GPUs under TP 16 holds one TP16 stage, or two TP14).
    """
    job = instance.job
    want = replicas_needed(instance) if replicas is None else replicas
    need = want * job.pp
    if want <= 0 or need > min(job.replicas_max, job.global_batch) * job.pp:
        return None
    a = instance.arrays
    healthy = np.bincount(a.gpu_domain[a.healthy], minlength=a.n_domains)
    lookup = np.array([job.largest_allowed(r) or 0 for r in range(job.tp)], dtype=np.int64)
    rest = lookup[healthy % job.tp]
    if int((healthy // job.tp).sum() + np.count_nonzero(rest)) >= need:
        return None  # the paper's slots (domain_slot_table) suffice: the usual case
    base = domain_slot_table(instance, reduced=True)
    g, counts, first = fastest_first(instance)
    big_t, t_min = job.tp, min(job.allowed)
    have = np.bincount(base.domain, minlength=len(counts))
    extra: list[tuple[int, int, int]] = []  # (-t_k, k, domain)
    for d, h in enumerate(counts.tolist()):
        for k in range(int(have[d]) + 1, h // t_min + 1):
            t_k = job.largest_allowed(h // k)
            if t_k is None:
                break
            extra.append((-t_k, k, d))
    if len(base) + len(extra) < need and replicas is None:
        return None  # no cut gives enough stages
    if not extra:
        return None
    extra.sort()
    cut = have.copy()
    for _, k, d in extra[: need - len(base)]:
        cut[d] = max(cut[d], k)
    changed = np.flatnonzero(cut > have)
    keep = ~np.isin(base.domain, changed)
    doms, rows, degs = [base.domain[keep]], [base.gpus[keep]], [base.degree[keep]]
    for d in changed.tolist():
        h, k = int(counts[d]), int(cut[d])
        t_k = job.largest_allowed(h // k) or t_min
        degree = [t_k] * k
        spare = h - k * t_k
        for j in range(k):
            up = job.largest_allowed(min(big_t, t_k + spare)) or t_k
            spare -= up - t_k
            degree[j] = up
        gpus = np.full((k, big_t), -1, dtype=np.int64)
        at = int(first[d])
        for j, t in enumerate(degree):
            gpus[j, :t] = g[at : at + t]
            at += t
        doms.append(np.full(k, d, dtype=np.int64))
        rows.append(gpus)
        degs.append(np.array(degree, dtype=np.int64))
    domain = np.concatenate(doms)
    order = np.argsort(domain, kind="stable")
    return SlotTable.build(
        instance.arrays.speed,
        domain[order],
        np.concatenate(degs)[order],
        np.concatenate(rows)[order],
    )


def _names(name: str, kinds: tuple[str, ...]) -> list[str]:
    return [f"{name}+{b}" if b else name for b in kinds]


def _score(
    instance: Instance,
    name: str,
    packing: Packing,
    boost: str,
    unboosted: list[Candidate | None] | None = None,
) -> Candidate | None:
    """``packing`` (fitted to the budgets) with boost ``boost``, split exactly.

    ``unboosted``: the packing's candidate without boost, already scored (as
    a list of one); a boost that changes no multiplier takes its split.
    """
    if boost == "slow":
        powers = boost_slowest_packed(instance, packing)
    elif boost == "floor":
        powers = boost_floor_packed(instance, packing)
    else:
        powers = np.ones(packing.members.shape)
    if boost and unboosted and bool((powers == 1.0).all()):
        c = unboosted[0]
        return None if c is None else Candidate(name, packing, powers, c.batches, c.goodput)
    split = split_packing(instance, packing, powers)
    if split is None:
        return None
    return Candidate(name, packing, powers, split.batches, split.goodput)


def _to_plan(instance: Instance, c: Candidate) -> Plan:
    powers = c.powers
    if c.goodput > 0 and not bool((powers == 1.0).all()):
        theta = float(sum(c.batches)) / c.goodput
        powers = trim_packed(instance, c.packing, powers, BatchSplit(c.batches, theta, c.goodput))
    replicas = packing_replicas(instance, c.packing, powers, c.batches)
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
    makers: dict[str, Callable[[], Packing]] = {
        "dp-drop": lambda: pack(instance, domain_slot_table(instance, reduced=False)),
        "ntp": lambda: pack(instance, domain_slot_table(instance, reduced=True)),
        "speed-aware": lambda: pack(instance, speed_aware_table(instance), by_value=True),
    }
    packs: dict[str, tuple[Packing, Packing]] = {}  # as packed, and fitted to the budgets
    out: list[Candidate] = []
    # a packing another maker already built (the same degrees on the same GPUs,
    # stage by stage) scores the same: its candidates are reused under the new name
    seen: dict[tuple[bytes, bytes], list[Candidate | None]] = {}

    def score(name: str, packing: Packing) -> None:
        kinds = ("", "slow", "floor") if boost else ("",)
        key = (packing.tp.tobytes(), packing.stages().gpus.tobytes())
        if key in seen:
            scored = [
                None if c is None else Candidate(n, packing, c.powers, c.batches, c.goodput)
                for c, n in zip(seen[key], _names(name, kinds), strict=True)
            ]
        else:
            scored = []
            for b, n in zip(kinds, _names(name, kinds), strict=True):
                if scored and scored[0] is None:
                    # no split without boost: too many replicas, too few for a
                    # fixed B, or a replica at speed 0; no multiplier changes that
                    scored.append(None)
                    continue
                scored.append(_score(instance, n, packing, b, unboosted=scored[:1]))
            seen[key] = scored
        out.extend(c for c in scored if c is not None)

    def stop() -> bool:
        return cancel is not None and cancel.is_set() and bool(out)

    # too few slots for the replicas the batch needs, or for as many as may run
    job = instance.job
    recut = count_fit_table(instance)
    if recut is not None:
        makers["count-fit"] = lambda: pack(instance, recut)
    most = min(job.replicas_max, job.global_batch)
    if most > replicas_needed(instance):
        more = count_fit_table(instance, most)
        if more is not None:
            makers["count-max"] = lambda: pack(instance, more)
    # scored in the same order as ever, so that ties go the same way
    for name, make in makers.items():
        if stop():
            break
        packed = make()
        packs[name] = (packed, fit_packing(instance, packed))
        score(name, packs[name][1])
    for name, (packed, kept) in packs.items():  # tight budgets: lower degrees, not a replica
        if stop():
            break
        fitted = fit_by_degree(instance, packed, kept)
        if fitted is not None:
            score(f"{name}+degree-fit", fit_packing(instance, fitted))
    out.sort(key=lambda c: -c.goodput)
    return out


def plan_fast(
    instance: Instance,
    *,
    validate: bool = True,
    cancel: threading.Event | None = None,
    bound: bool = True,
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
    bound
        Compute the bound (default). ``False`` (a caller with a bound of its
        own: :func:`ntp_opt.workflows.replan.replan`) returns ``inf`` instead.

    Returns
    -------
    (Plan, float)
        The plan (empty when every candidate pauses) and
        :func:`~ntp_opt.milp.bounds.capacity_bound` (``inf`` unless ``bound``).
    """
    with gc_paused():
        found = candidates(instance, cancel=cancel)
        logger.debug(
            "fast: %d candidates%s", len(found), f", best {found[0].name}" if found else ""
        )
        if found:
            plan = _to_plan(instance, found[0])
        else:
            plan = Plan(instance.name, (), {"policy": "fast", "paused": True})
        value = capacity_bound(instance) if bound else math.inf
    return (certified(instance, plan) if validate else plan), value


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (and back to its state after).

    ``fast`` creates one :class:`~ntp_opt.model.plan.Stage` per stage and
    lists of numbers, no reference cycles: collections triggered by those
    allocations would only scan the instance's long-lived objects again
    (tens of milliseconds at 131k GPUs). Reference counting still frees
    everything as usual.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
