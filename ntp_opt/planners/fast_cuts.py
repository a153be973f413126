"""The ``fast`` planner's cuts: domains cut into stages, and packings fitted to the budgets.

The slot tables the candidates of :mod:`ntp_opt.planners.fast_candidates` pack
(:func:`speed_aware_table`, :func:`even_table`, :func:`count_fit_table`), the
degree fits (:func:`fit_by_degree`) and the common-speed boost of a packing
(:func:`boost_floor_packed`).
"""

from __future__ import annotations

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.planners.packing import (
    Packing,
    Slot,
    SlotTable,
    domain_slot_table,
    draw_at_power_one,
    fastest_first,
    fit_packing,
    fits_at_power_one,
    used_mask,
)
from ntp_opt.rules.boost import boost_floor_stages
from ntp_opt.rules.power import budget_limit, can_boost, extra_draw, headroom, over_budget
from ntp_opt.rules.tolerances import BUDGET_SLACK


def speed_aware_table(instance: Instance) -> SlotTable:
    """:func:`speed_aware_slots` as a :class:`~ntp_opt.planners.packing.SlotTable`.

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


def even_table(instance: Instance, spread: bool = False) -> SlotTable:
    """Each domain cut into as many stages as the paper's cut, all of one degree.

    A domain of ``h`` healthy GPUs (fastest first) whose paper cut gives ``k``
    slots (``h // T`` full ones and a reduced one) is cut into ``k`` stages of
    the allowed degree ``t`` (``k t <= h``) maximising ``f(t) * s_{k t}``
    (``s_i``: the ``i``-th fastest speed; larger ``t`` on ties): a domain of
    66 GPUs under TP36 gives two TP33 stages rather than TP36 and TP30, and
    stragglers are left out when a smaller degree on faster GPUs is worth
    more. The replicas then run at even degrees and speeds, which the
    ``fixed`` policy (the slowest replica sets the pace) and the budgets
    (fewer watts per replica) both favour.
    """
    a = instance.arrays
    job = instance.job
    big_t = job.tp
    g, counts, first = fastest_first(instance, spread)
    lookup = np.array([job.largest_allowed(r) or 0 for r in range(big_t)], dtype=np.int64)
    k = counts // big_t + (lookup[counts % big_t] > 0)
    sp = a.speed[g] if len(g) else np.zeros(1)
    best_t = np.zeros(len(counts), dtype=np.int64)
    best_v = np.full(len(counts), -1.0)
    for t in sorted(job.allowed):
        ok = (k > 0) & (k * t <= counts)
        last = np.where(ok, first + k * t - 1, 0)
        v = job.tp_factor(t) * sp[last]
        better = ok & (v >= best_v)
        best_t[better] = t
        best_v[better] = v[better]
    has = best_t > 0
    dom = np.repeat(np.flatnonzero(has), k[has])
    deg = np.repeat(best_t[has], k[has])
    rank = np.arange(len(dom)) - np.repeat(np.cumsum(k[has]) - k[has], k[has])
    start = first[dom] + rank * deg
    cols = np.arange(big_t)
    idx = np.minimum(start[:, None] + cols, max(len(g) - 1, 0))
    gpus = np.where(cols < deg[:, None], g[idx] if len(g) else -1, -1)
    return SlotTable.build(a.speed, dom, deg, gpus)


def boost_floor(instance: Instance, groups: list[tuple[int, list[Slot]]]) -> list[list[float]]:
    """Power multipliers raising every replica to the highest common speed the budgets allow.

    :func:`ntp_opt.rules.boost.boost_floor_stages` from power 1. Under the ``fixed``
    policy goodput is set by the slowest replica, so this is the boost that
    counts; it complements :func:`ntp_opt.planners.packing.boost_slowest`,
    which only lifts slow replicas up to nominal speed.
    """
    if not groups or not can_boost(instance):
        return [[1.0] * len(m) for _, m in groups]
    powers: list[list[float]] = boost_floor_packed(
        instance, Packing.from_groups(instance, groups)
    ).tolist()
    return powers


def boost_floor_packed(instance: Instance, packing: Packing) -> np.ndarray:
    """:func:`boost_floor` on a :class:`~ntp_opt.planners.packing.Packing` (R x pp)."""
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

    :func:`ntp_opt.planners.packing.fit_power` drops the worst replicas until the
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


def fit_by_degree(
    instance: Instance, packing: Packing, kept: Packing, level: bool = False
) -> Packing | None:
    """:func:`fit_power_by_degree` on a packing and its :func:`fit_packing` ``kept``.

    The draws are updated on the racks a degree step touches only. With
    ``level``, each step lowers a replica of the highest degree (the worst of
    them) instead of going round from the worst: the degrees end up even
    (two TP15 replicas rather than TP16 and TP14), and under the ``fixed``
    policy the slowest replica is what counts.
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
    saving = extra_draw(a.tdp, 1.0, job.idle_power_fraction)  # a GPU going from used to idle
    racks_over, site_over = over_budget(instance, rack, site, tol=BUDGET_SLACK, slack=0.0)
    n_over = int(racks_over.sum())
    rack_cap = budget_limit(a.rack_budget, tol=BUDGET_SLACK, slack=0.0)  # as over_budget's
    site_cap = budget_limit(a.site_budget, tol=BUDGET_SLACK, slack=0.0)

    r = len(out) - 1  # worst replica first, one degree step each, round after round
    stuck = 0
    while n_over or site_over:
        if level:
            r = len(out) - 1 - int(np.argmax(tp[::-1]))  # the last of the highest degree
            if lower.get(int(tp[r])) is None:
                return None  # every replica at the smallest degree and still over budget
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


def paper_slots(instance: Instance) -> int:
    """How many slots the paper's cut makes: per domain, one per ``T`` healthy GPUs and
    one reduced slot when the rest allows a degree (:func:`domain_slot_table`)."""
    a = instance.arrays
    job = instance.job
    healthy = np.bincount(a.gpu_domain[a.healthy], minlength=a.n_domains)
    lookup = np.array([job.largest_allowed(r) or 0 for r in range(job.tp)], dtype=np.int64)
    rest = lookup[healthy % job.tp]
    return int((healthy // job.tp).sum() + np.count_nonzero(rest))


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
    if paper_slots(instance) >= need:
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
        # the raised stages take the slowest GPUs: a replica run at ``t_k`` leaves
        # out the slowest of them, not GPUs faster than those its other stages use
        degree.sort()
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
