"""The ``fast`` planner: sort-and-pack candidates, the best one validated, with a bound.

Made for instances too large for the exact planner (32k–131k GPUs) and for
re-planning: it builds a few candidate plans in array form, scores each with
the exact batch split, turns only the best into a :class:`~ntp_opt.model.plan.Plan`
(validated) and reports :func:`ntp_opt.planners.bounds.capacity.capacity_bound` next to it.

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
* ``even`` (:func:`even_table`): each domain cut into as many stages as the
  paper's cut, all of one degree (two TP33 rather than TP36 and TP30);
* ``ntp-spread`` and ``even-spread`` (only when a rack could not feed all
  its GPUs at their largest multiplier, :func:`racks_bind`): the same cuts
  with each domain's GPUs and slots taken from every rack alike, so that the
  replicas leave each rack room to boost;

each also in a *degree-fit* variant when the budgets force replicas out
(:func:`fit_power_by_degree`: one replica fewer dropped, degrees lowered
instead, worst replica first) and a *level-fit* one (the highest degrees
lowered first), and each without power boost, with the boost of
:func:`ntp_opt.baselines.ntp_pw`
(slow replicas lifted to nominal speed, cheapest first) and with
:func:`boost_floor` (every replica lifted to the highest common speed).
From the best candidate (and the best spread one), two local steps when
power can be boosted: :func:`capped_boosted` (every degree capped at a lower
one, the watts freed spent on the floor boost) and :func:`fewer_boosted`
(the worst replicas dropped, their watts spent on the others' boost), each
kept only when it raises goodput; the same drop after :func:`rack_regrouped`
(the stages regrouped into whole replicas per rack, the slowest left over
last). Last, :func:`lead_boosted` spends the watts the floor boost leaves in
roomy racks on the replicas of the largest batch, from the best candidate
and the best regrouped one.
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
from ntp_opt.planners.bounds import capacity_bound
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
    replica_speeds,
    split_packing,
    trim_packed,
    used_mask,
)
from ntp_opt.rules.goodput import BatchSplit, goodput
from ntp_opt.rules.power import (
    boost_floor_stages,
    budget_limit,
    can_boost,
    exceeds,
    extra_draw,
    gpu_draw,
    headroom,
    idle_draw,
    over_budget,
)
from ntp_opt.rules.tolerances import BUDGET_SLACK, FLOAT_NOISE, IMPROVE_TOL
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
    packing = c.packing
    if c.goodput > 0:
        theta = float(sum(c.batches)) / c.goodput
        split = BatchSplit(c.batches, theta, c.goodput)
        if not bool((powers == 1.0).all()):
            powers = trim_packed(instance, packing, powers, split)
        packing = trim_degrees(instance, packing, powers, split)
    replicas = packing_replicas(instance, packing, powers, c.batches)
    return Plan(instance.name, replicas, {"policy": "fast", "candidate": c.name})


def trim_degrees(
    instance: Instance, packing: Packing, powers: np.ndarray, split: BatchSplit
) -> Packing:
    """``packing`` with each replica at the smallest allowed degree that still carries
    its batch at the split's pace: the same goodput on fewer GPUs.

    Replica ``r`` needs the speed ``b_r (1 + rho) / theta`` only; one faster
    than that (a TP36 replica beside TP33 ones, all with the same batch)
    holds GPUs, and their watts, for nothing. Only where some replica with a
    batch already runs below ``T`` (so that ``1 + rho`` stays as it is), at
    the multipliers ``powers``; ``packing`` itself when nothing changes or the
    goodput would drop (rounding).
    """
    job = instance.job
    tp = packing.tp
    batches = np.array(split.batches, dtype=np.int64)
    if len(packing) == 0 or not np.isfinite(split.step_time) or split.step_time <= 0:
        return packing
    if not bool(((tp < job.tp) & (batches > 0)).any()):
        return packing
    need = batches * (1.0 + job.reshard_overhead) / split.step_time * (1.0 - FLOAT_NOISE)
    boost = powers**job.power_exponent
    new = tp.copy()
    for t in sorted(job.allowed, reverse=True):
        lower = t < new
        if not lower.any():
            continue
        speed = (packing.slots.prefix[packing.members, t - 1] * boost).min(axis=1)
        fast_enough = lower & (job.tp_factor(t) * speed / job.seq_time_s >= need)
        new[fast_enough] = t
    if np.array_equal(new, tp):
        return packing
    trimmed = packing.with_tp(new)
    kept = batches > 0  # the plan's replicas
    before = goodput(
        job,
        tp[kept].tolist(),
        batches[kept].tolist(),
        replica_speeds(instance, packing, powers)[kept].tolist(),
    )
    after = goodput(
        job,
        new[kept].tolist(),
        batches[kept].tolist(),
        replica_speeds(instance, trimmed, powers)[kept].tolist(),
    )
    return trimmed if after >= before * (1.0 - FLOAT_NOISE) else packing


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
    seen: dict[tuple[bytes, bytes, int], list[Candidate | None]] = {}

    def score(name: str, packing: Packing, slow: bool = True) -> None:
        kinds = (("", "slow", "floor") if slow else ("", "floor")) if boost else ("",)
        key = (packing.tp.tobytes(), packing.stages().gpus.tobytes(), len(kinds))
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
        # one replica more than the paper's slots hold, not as many as may run: the
        # domains cut less finely (six TP11 stages of 71 GPUs rather than seven TP10)
        one_more = paper_slots(instance) // job.pp + 1
        if replicas_needed(instance) < one_more < most:
            next_cut = count_fit_table(instance, one_more)
            if next_cut is not None:
                makers["count-next"] = lambda: pack(instance, next_cut)
    makers["even"] = lambda: pack(instance, even_table(instance), by_value=True)
    if boost and racks_bind(instance):
        makers["ntp-spread"] = lambda: pack(
            instance, domain_slot_table(instance, reduced=True, spread=True), spread=True
        )
        makers["even-spread"] = lambda: pack(
            instance, even_table(instance, spread=True), by_value=True, spread=True
        )
    # scored in the same order as ever, so that ties go the same way; a maker
    # whose packing an earlier one built (the paper's cut is often already even)
    # adds nothing, nor do its degree fits
    built: set[tuple[bytes, bytes]] = set()
    for name, make in makers.items():
        if stop():
            break
        packed = make()
        key = (packed.tp.tobytes(), packed.stages().gpus.tobytes())
        if key in built:
            continue
        built.add(key)
        packs[name] = (packed, fit_packing(instance, packed))
        score(name, packs[name][1])
    for name, (packed, kept) in packs.items():  # tight budgets: lower degrees, not a replica
        if stop():
            break
        fitted = fit_by_degree(instance, packed, kept)
        if fitted is not None:
            score(f"{name}+degree-fit", fit_packing(instance, fitted))
        level = fit_by_degree(instance, packed, kept, level=True)
        if level is not None:  # even degrees: the floor boost is the one that fits them
            score(f"{name}+level-fit", fit_packing(instance, level), slow=False)
    out.sort(key=lambda c: -c.goodput)
    if out and boost and not stop():
        # local steps from the best candidate, and from the best spread one (whose
        # racks have room for the boost a step frees watts for)
        starts = [out[0]]
        starts += [c for c in out if "-spread" in c.name and c is not out[0]][:1]
        better: list[Candidate] = []
        for c in starts:
            capped = capped_boosted(instance, c)
            fewer = fewer_boosted(instance, capped or c)
            better += [x for x in (capped, fewer) if x is not None]
            regrouped = rack_regrouped(instance, c)
            if regrouped is not None:  # replicas by rack: the roomy racks boost their own
                again = _score(instance, f"{c.name}+by-rack", regrouped, "floor")
                if again is not None:
                    better += [again]
                    better += [x for x in (fewer_boosted(instance, again),) if x is not None]
        out = sorted(out + better, key=lambda c: -c.goodput)  # stable: ties as before
        # the watts the floor boost leaves in roomy racks, spent on the replicas of
        # the largest batch: from the best candidate and the best regrouped one
        tops = [out[0], *[c for c in out if "+by-rack" in c.name and c is not out[0]][:1]]
        leads = [x for x in (lead_boosted(instance, c) for c in tops) if x is not None]
        out = sorted(leads + out, key=lambda c: -c.goodput)
    return out


def racks_bind(instance: Instance) -> bool:
    """Would some rack exceed its budget with all its healthy GPUs at their largest multiplier?

    Only then does it matter which racks a plan's stages draw on
    (``spread`` candidates).
    """
    a = instance.arrays
    draw = gpu_draw(instance, np.where(a.healthy, instance.max_multiplier, 0.0))
    per_rack = np.bincount(a.gpu_rack, weights=draw, minlength=len(a.rack_ids))
    return bool(exceeds(per_rack, a.rack_budget, tol=0.0, slack=0.0).any())


def capped_boosted(instance: Instance, best: Candidate) -> Candidate | None:
    """Lower degrees, more boost: ``best`` with every replica's degree capped at one of
    its smaller degrees, the watts freed spent on the floor boost; the best cap
    that raises goodput, or ``None``.

    Under a tight budget and the ``fixed`` policy, replicas of a degree above
    the slowest one's draw watts that raise no goodput: at one degree, every
    replica can be boosted instead (ten TP68 and six TP72 replicas become
    sixteen TP68 ones at 1.02).
    """
    tp = best.packing.tp
    found: Candidate | None = None
    value = best.goodput
    for t in sorted(set(tp.tolist()), reverse=True)[1:]:
        c = _score(
            instance, f"{best.name}+cap{t}", best.packing.with_tp(np.minimum(tp, t)), "floor"
        )
        if c is not None and c.goodput > value * (1 + IMPROVE_TOL):
            found, value = c, c.goodput
    return found


def fewer_boosted(instance: Instance, best: Candidate) -> Candidate | None:
    """Fewer replicas, more boost: ``best`` without its last replicas, the watts they
    drew spent on boosting the others, while goodput grows.

    Where a budget caps the boost, a replica dropped may be worth less than
    the boost its watts buy the others (a slow or reduced replica, ``alpha``
    near 1, no idle draw). Replicas are dropped one at a time, last (worst)
    first, each packing boosted both ways; the first drop that gains nothing
    stops it. ``None`` when no drop gains. A drop is only tried when the watts it
    frees (and the site's room), spread evenly over the others' GPUs, would
    raise their speed by more than the share of speed dropped: with hundreds
    of alike replicas (32k-131k GPUs) one replica's watts buy less than the
    replica, and nothing is scored.
    """
    a = instance.arrays
    job = instance.job
    packing = best.packing
    st = packing.stages()
    sizes = np.diff(st.start)
    per_gpu = np.repeat(best.powers.ravel(), sizes)
    power_of = np.zeros(a.n_gpus)
    power_of[st.gpus] = per_gpu
    draw = gpu_draw(instance, power_of, at=st.gpus)
    watts = np.bincount(np.repeat(st.replica, sizes), weights=draw, minlength=len(packing))
    idle = idle_draw(instance)[st.gpus]  # the stages' GPUs are healthy
    freed = watts - np.bincount(np.repeat(st.replica, sizes), weights=idle, minlength=len(packing))
    room = max(float(headroom(instance, power_of)[1]), 0.0)
    speeds = replica_speeds(instance, packing, best.powers)
    found: Candidate | None = None
    value = best.goodput
    total = float(speeds.sum())
    for k in range(len(packing) - 1, 0, -1):
        rest = float(watts[:k].sum())
        spare = room + float(freed[k:].sum())
        if rest <= 0 or total <= 0:
            break
        gain = (1.0 + spare / rest) ** job.power_exponent * float(speeds[:k].sum()) / total
        if gain <= 1 + IMPROVE_TOL:
            break
        head = packing.head(k)
        scored = [
            _score(instance, f"{best.name}+drop{len(best.packing) - k}", head, b)
            for b in ("floor", "slow")
        ]
        top = max((c for c in scored if c is not None), key=lambda c: c.goodput, default=None)
        if top is None or top.goodput <= value * (1 + IMPROVE_TOL):
            break
        found, value = top, top.goodput
    return found


def rack_regrouped(instance: Instance, best: Candidate) -> Packing | None:
    """``best``'s stages regrouped rack by rack: each replica drawn from one rack where it can.

    Each rack's fastest stages form as many whole replicas as they can, the
    rack with the most watts left (at power 1) first; the stages left over
    (the slowest of each rack) form the last replicas, fastest first. A
    replica whose stages share a rack with room is one that rack can boost
    alone, and dropping the last replica (:func:`fewer_boosted`) drops the
    slow leftovers rather than leaving one rack more stages to feed than
    another. A stage counts in the rack of its first GPU (a domain across
    racks: its fastest). Only where every replica runs at one degree (the
    stages are then interchangeable); ``None`` when nothing moves.
    """
    packing = best.packing
    if len(packing) < 2 or len(set(packing.tp.tolist())) != 1:
        return None
    a = instance.arrays
    t = int(packing.tp[0])
    flat = packing.members.ravel()
    rack = a.gpu_rack[packing.slots.gpus[flat, 0]]
    room, _ = headroom(instance, used_mask(instance, packing).astype(float))
    order_of_rack = np.empty(len(a.rack_budget), dtype=np.int64)
    racks_by_room = np.argsort(-room, kind="stable")
    order_of_rack[racks_by_room] = np.arange(len(racks_by_room))
    speed = packing.slots.prefix[flat, t - 1]
    pp = packing.members.shape[1]
    by_rack = np.lexsort((np.arange(len(flat)), -speed, order_of_rack[rack]))
    start = np.searchsorted(order_of_rack[rack][by_rack], order_of_rack[rack][by_rack])
    within = np.empty(len(flat), dtype=np.int64)
    within[by_rack] = np.arange(len(flat)) - start  # rank of the stage in its rack
    whole = np.bincount(rack, minlength=len(room))[rack] // pp * pp
    left = within >= whole  # the stages no whole replica of their rack takes: last
    order = np.lexsort((np.arange(len(flat)), -speed, np.where(left, 0, order_of_rack[rack]), left))
    members = flat[order].reshape(packing.members.shape)
    if np.array_equal(members, packing.members):
        return None
    return Packing(packing.slots, members, packing.tp)


def lead_boosted(instance: Instance, best: Candidate, most: int = 8) -> Candidate | None:
    """``best`` with the watts its racks have left spent on its replicas of the largest
    batch, each raised as far as its own racks allow; ``None`` when goodput does not grow.

    The floor boost (:func:`boost_floor_packed`) raises every replica to one
    speed, as far as the tightest rack allows: racks with room keep it. Under
    the ``fixed`` policy the replica given the larger share of the batch sets
    the pace; under ``elastic`` any faster replica carries more. The replicas
    are taken largest batch first (then fastest, at most ``most`` of them),
    each boosted (:func:`ntp_opt.rules.power.boost_floor_stages`, the
    replica alone) within the rooms the others leave, and the batch split again.
    """
    packing = best.packing
    if len(packing) == 0 or best.goodput <= 0:
        return None
    a = instance.arrays
    powers = best.powers.copy()
    st = packing.stages()
    sizes = np.diff(st.start)
    speeds = replica_speeds(instance, packing, powers)
    batches = np.array(best.batches, dtype=np.int64)
    order = np.lexsort((np.arange(len(packing)), -speeds, -batches))[:most]
    pp = packing.members.shape[1]
    base = packing.stage_speeds()
    alpha = instance.job.power_exponent
    changed = False
    for r in order.tolist():
        if batches[r] <= 0:
            break
        power_of = np.zeros(a.n_gpus)
        power_of[st.gpus] = np.repeat(powers.ravel(), sizes)
        lo, hi = st.start[r * pp], st.start[(r + 1) * pp]
        power_of[st.gpus[lo:hi]] = 1.0
        rack_room, site_room = headroom(instance, power_of)
        one = Packing(packing.slots, packing.members[r : r + 1], packing.tp[r : r + 1])
        up = boost_floor_stages(instance, one.stages(), one.tp, rack_room, site_room)
        if (up**alpha * base[r]).min() > (powers[r] ** alpha * base[r]).min() * (1 + FLOAT_NOISE):
            powers[r] = up  # faster than before (the stages at a limit kept within the rooms)
            changed = True
    if not changed:
        return None
    split = split_packing(instance, packing, powers)
    if split is None or split.goodput <= best.goodput * (1 + IMPROVE_TOL):
        return None
    return Candidate(f"{best.name}+lead", packing, powers, split.batches, split.goodput)


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
        :func:`~ntp_opt.planners.bounds.capacity.capacity_bound` (``inf`` unless ``bound``).
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
