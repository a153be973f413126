"""The array forms of ``fast`` and the heuristics give bit for bit the per-slot loops' results.

The references below are the straightforward loops the array code replaced
(issue 15): one domain, slot, replica or stage at a time. Every comparison is
exact (``==`` on floats), so the plans, and the ``best_known`` values, stay
the same.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_opt import Instance
from ntp_opt.planners import fast_cuts, packing
from ntp_opt.planners.packing import Slot
from ntp_opt.rules.boost import Stages, boost_floor_stages, boost_stages
from ntp_opt.rules.goodput import replica_speed
from ntp_opt.rules.power import (
    can_boost,
    headroom,
    over_budget,
    stage_cap,
)
from ntp_opt.rules.tolerances import BOOST_MARGIN, BUDGET_SLACK
from tests.helpers import make_instance
from tests.strategies import instances

Groups = list[tuple[int, list[Slot]]]


def boost_lists(instance, replicas, candidates, rack_room, site_room, *, steps):
    """:func:`ntp_opt.rules.boost.boost_stages` on per-replica lists (degree, GPUs, powers)."""
    stages = Stages.from_lists([gs for _, gs, _ in replicas])
    tp = np.array([t for t, _, _ in replicas], dtype=np.int64)
    powers = np.array([float(x) for _, _, p in replicas for x in p], dtype=float)
    out, boosted = boost_stages(
        instance, stages, tp, powers, candidates, rack_room, site_room, steps=steps
    )
    return per_replica(stages, out, len(replicas)), boosted


def floor_lists(instance, replicas, rack_room, site_room):
    """:func:`ntp_opt.rules.boost.boost_floor_stages` on per-replica lists (degree, GPUs)."""
    if not replicas:
        return []
    stages = Stages.from_lists([gs for _, gs in replicas])
    tp = np.array([t for t, _ in replicas], dtype=np.int64)
    out = boost_floor_stages(instance, stages, tp, rack_room, site_room)
    return per_replica(stages, out, len(replicas))


def per_replica(stages, values, n):
    cuts = np.searchsorted(stages.replica, np.arange(n + 1))
    flat = values.tolist()
    return [flat[cuts[r] : cuts[r + 1]] for r in range(n)]


# --- the references: one item at a time --------------------------------------------


def ref_domain_slots(instance: Instance, reduced: bool) -> list[Slot]:
    a, job = instance.arrays, instance.job
    slots = []
    for d, members in enumerate(a.domain_gpus):
        ok = members[a.healthy[members]]
        ok = ok[np.argsort(-a.speed[ok], kind="stable")]
        full = len(ok) // job.tp
        for j in range(full):
            slots.append(Slot(d, ok[j * job.tp : (j + 1) * job.tp], job.tp))
        if reduced:
            rest = ok[full * job.tp :]
            t = job.largest_allowed(len(rest))
            if t is not None and t < job.tp:
                slots.append(Slot(d, rest[:t], t))
    return slots


def ref_speed_aware_slots(instance: Instance) -> list[Slot]:
    a, job = instance.arrays, instance.job
    slots = []
    for d, members in enumerate(a.domain_gpus):
        ok = members[a.healthy[members]]
        ok = ok[np.argsort(-a.speed[ok], kind="stable")]
        sp, start = a.speed[ok], 0
        while True:
            left, best_t, best_v = len(ok) - start, 0, 0.0
            for t in job.allowed:
                if t <= left:
                    v = job.tp_factor(t) * float(sp[start + t - 1])
                    if v >= best_v:
                        best_t, best_v = t, v
            if best_t == 0:
                break
            slots.append(Slot(d, ok[start : start + best_t], best_t))
            start += best_t
    return slots


def ref_pack(instance: Instance, slots: list[Slot], by_value: bool) -> Groups:
    job, speed = instance.job, instance.arrays.speed
    v = [s.speed(speed, s.degree) for s in slots]
    if by_value:
        val = [job.tp_factor(s.degree) * x for s, x in zip(slots, v, strict=True)]
        order = sorted(range(len(slots)), key=lambda i: (-val[i], -slots[i].degree, i))
    else:
        order = sorted(range(len(slots)), key=lambda i: (-slots[i].degree, -v[i], i))
    groups = []
    for r in range(min(job.replicas_max, len(slots) // job.pp, job.global_batch)):
        members = [slots[i] for i in order[r * job.pp : (r + 1) * job.pp]]
        groups.append((min(s.degree for s in members), members))
    return groups


def ref_fit_power(instance: Instance, groups: Groups) -> Groups:
    groups = list(groups)
    while groups and not packing.fits_at_power_one(instance, packing.used_mask(instance, groups)):
        groups.pop()
    return groups


def ref_boost_toward(instance, replicas, candidates, rack_room, site_room, *, steps):
    a, job = instance.arrays, instance.job
    alpha = job.power_exponent
    powers = [list(p) for _, _, p in replicas]
    if not can_boost(instance):
        return powers, []
    rack_room = np.array(rack_room, dtype=float)
    target, keep = 1.0 / job.seq_time_s, 1.0 - BOOST_MARGIN

    def need(i, goal):
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

    def fits(extra_rack, extra):
        return bool(np.all(extra_rack <= rack_room * keep) and extra <= site_room * keep)

    def goal(i):  # nominal, or the best its most limited stage reaches
        t, gs, pws = replicas[i]
        factor = job.tp_factor(t) / job.seq_time_s
        fs = np.array([factor * float(a.speed[g].min()) for g in gs])
        top = np.array([max(stage_cap(instance, g), pw) for g, pw in zip(gs, pws, strict=True)])
        return min(float((fs * top**alpha).min()), target)  # numpy's pow, as the arrays

    boosted = []
    for i in sorted(candidates, key=lambda i: (need(i, goal(i))[2], i)):
        mult, extra_rack, extra = need(i, goal(i))
        if not fits(extra_rack, extra):
            t, gs, pws = replicas[i]
            lo = replica_speed(job, t, [float(a.speed[g].min()) for g in gs], list(pws))
            up = goal(i)
            if up <= lo:
                continue
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


def ref_boost_floor(instance, replicas, rack_room, site_room, steps=60):
    a, job = instance.arrays, instance.job
    alpha = job.power_exponent
    ones = [[1.0] * len(m) for _, m in replicas]
    if not replicas or not can_boost(instance):
        return ones
    base = np.concatenate(
        [np.repeat([job.tp_factor(t) * float(a.speed[g].min()) for g in m], t) for t, m in replicas]
    )
    flat = np.concatenate([g for _, m in replicas for g in m])
    caps = np.concatenate([np.repeat([stage_cap(instance, g) for g in m], t) for t, m in replicas])
    sizes = np.concatenate([np.full(len(m), t) for t, m in replicas])
    stage = np.repeat(np.arange(len(sizes)), sizes)
    n_racks = len(a.rack_ids)
    key, inverse = np.unique(stage * n_racks + a.gpu_rack[flat], return_inverse=True)
    tdp = np.bincount(inverse.ravel(), weights=a.tdp[flat], minlength=len(key))
    rack = key % n_racks
    first = np.searchsorted(stage, key // n_racks)
    u_base, u_caps, keep = base[first], caps[first], 1 - BOOST_MARGIN

    def powers(tau, b, hi):
        return np.clip((tau / b) ** (1.0 / alpha), 1.0, hi)

    def fits(tau):
        extra = tdp * (powers(tau, u_base, u_caps) - 1.0)
        per_rack = np.bincount(rack, weights=extra, minlength=n_racks)
        return bool(np.all(per_rack <= rack_room * keep) and extra.sum() <= site_room * keep)

    lo, top = float(base.min()), float((base * caps**alpha).min())
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


def ref_fit_by_degree(instance: Instance, groups: Groups) -> Groups | None:
    kept = ref_fit_power(instance, groups)
    if len(kept) == len(groups):
        return None
    a, job = instance.arrays, instance.job
    out = [(t, list(m)) for t, m in groups[: len(kept) + 1]]
    lower = {t: max((u for u in job.allowed if u < t), default=None) for t in job.allowed}
    rack, site = packing.draw_at_power_one(instance, packing.used_mask(instance, out))
    saving = a.tdp * (1.0 - job.idle_power_fraction)

    def over():
        racks, site_over = over_budget(instance, rack, site, tol=BUDGET_SLACK, slack=0.0)
        return bool(racks.any() or site_over)

    r, stuck = len(out) - 1, 0
    while over():
        t, members = out[r]
        step = lower.get(t)
        if step is not None:
            freed = np.concatenate([s.gpus[step:t] for s in members])
            rack -= np.bincount(a.gpu_rack[freed], weights=saving[freed], minlength=len(rack))
            site -= float(saving[freed].sum())
            out[r] = (step, members)
            stuck = 0
        else:
            stuck += 1
            if stuck >= len(out):
                return None
        r = r - 1 if r > 0 else len(out) - 1
    used = packing.used_mask(instance, out)
    return out if packing.fits_at_power_one(instance, used) else None


# --- helpers ---------------------------------------------------------------------


def same_slots(x: list[Slot], y: list[Slot]) -> bool:
    return [(s.domain, s.degree, s.gpus.tolist()) for s in x] == [
        (s.domain, s.degree, s.gpus.tolist()) for s in y
    ]


def same_groups(x: Groups | None, y: Groups | None) -> bool:
    if x is None or y is None:
        return x is y
    return len(x) == len(y) and all(
        t == u and same_slots(m, n) for (t, m), (u, n) in zip(x, y, strict=True)
    )


def boost_input(instance: Instance, groups: Groups):
    used = packing.used_mask(instance, groups).astype(float)
    rack_room, site_room = headroom(instance, used)
    reps = [(t, [s.gpus[:t] for s in m], [1.0] * len(m)) for t, m in groups]
    return reps, rack_room, site_room


def check_everything(instance: Instance) -> None:
    for reduced in (False, True):
        assert same_slots(
            packing.domain_slots(instance, reduced), ref_domain_slots(instance, reduced)
        )
    assert same_slots(fast_cuts.speed_aware_slots(instance), ref_speed_aware_slots(instance))
    packs = [
        (ref_domain_slots(instance, False), False),
        (ref_domain_slots(instance, True), False),
        (ref_speed_aware_slots(instance), True),
    ]
    for slots, by_value in packs:
        groups = packing.pack_replicas(instance, slots, by_value)
        assert same_groups(groups, ref_pack(instance, slots, by_value))
        kept = packing.fit_power(instance, groups)
        assert same_groups(kept, ref_fit_power(instance, groups))
        assert same_groups(
            fast_cuts.fit_power_by_degree(instance, groups), ref_fit_by_degree(instance, groups)
        )
        reps, rack_room, site_room = boost_input(instance, kept)
        everyone = list(range(len(kept)))
        some = everyone[::-2]  # a subset, out of order: only its stages are read
        for steps, cand in ((50, everyone), (60, everyone), (50, some)):
            got, got_who = boost_lists(instance, reps, cand, rack_room, site_room, steps=steps)
            ref, ref_who = ref_boost_toward(instance, reps, cand, rack_room, site_room, steps=steps)
            # the replicas' goals go through numpy's pow on arrays, the reference's
            # bisection through Python's: the same to the last few bits only
            assert got_who == ref_who
            assert np.allclose([x for p in got for x in p], [x for p in ref for x in p], rtol=1e-12)
        floor_reps = [(t, g) for t, g, _ in reps]
        assert floor_lists(instance, floor_reps, rack_room, site_room) == ref_boost_floor(
            instance, floor_reps, rack_room, site_room
        )
        assert fast_cuts.boost_floor(instance, kept) == ref_boost_floor(
            instance, floor_reps, rack_room, site_room
        )
        powers = packing.boost_slowest(instance, kept)
        packed = packing.Packing.from_groups(instance, kept)
        pw = np.array(powers, dtype=float).reshape(len(kept), instance.job.pp)
        split = packing.split_groups(instance, kept, powers)
        assert split == packing.split_packing(instance, packed, pw)
        if split is not None:
            assert packing.to_replicas(
                instance, kept, powers, split.batches
            ) == packing.packing_replicas(instance, packed, pw, split.batches)


# --- the tests ---------------------------------------------------------------------


@settings(max_examples=40)
@given(instances())
def test_array_forms_equal_the_loops(instance):
    check_everything(instance)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("site", [0.7, 0.85, 0.93])
def test_partial_boosts_equal_the_loops(seed, site):
    """Site budgets that stop the boost part way: the bisections run, and agree."""
    inst = make_instance(
        domains=8, failed=3, stragglers=6, seed=seed, tp_allowed=(6, 7, 8), tp_min=6
    )
    g = inst.cluster.copy()
    gpus = [n for n, d in g.nodes(data=True) if d.get("kind") == "gpu"]
    g.graph["power_budget_w"] = site * 1000.0 * len(gpus)
    inst = Instance("tight", g, inst.job)
    check_everything(inst)
    groups = packing.fit_power(inst, packing.pack_replicas(inst, packing.domain_slots(inst, True)))
    reps, rack_room, site_room = boost_input(inst, groups)
    powers, boosted = boost_lists(
        inst, reps, list(range(len(groups))), rack_room, site_room, steps=50
    )
    assert (powers, boosted) == ref_boost_toward(
        inst, reps, list(range(len(groups))), rack_room, site_room, steps=50
    )


def test_a_partial_boost_happens():
    """The case above is not vacuous: some replica gets less than its full boost."""
    inst = make_instance(domains=8, failed=3, stragglers=6, seed=1, tp_allowed=(6, 7, 8), tp_min=6)
    g = inst.cluster.copy()
    gpus = [n for n, d in g.nodes(data=True) if d.get("kind") == "gpu"]
    g.graph["power_budget_w"] = 0.93 * 1000.0 * len(gpus)
    inst = Instance("tight", g, inst.job)
    groups = packing.fit_power(inst, packing.pack_replicas(inst, packing.domain_slots(inst, True)))
    reps, rack_room, site_room = boost_input(inst, groups)
    slow = list(range(len(groups)))
    powers, boosted = boost_lists(inst, reps, slow, rack_room, site_room, steps=50)
    full, _ = boost_lists(inst, reps, slow, rack_room * 100, site_room * 100, steps=50)
    assert boosted and powers != full


@given(instances(), st.sampled_from([0.5, 0.8, 0.95]))
def test_fit_power_equals_dropping_one_at_a_time(instance, factor):
    g = instance.cluster.copy()
    g.graph["power_budget_w"] = factor * instance.arrays.site_budget
    inst = Instance(instance.name, g, instance.job)
    groups = packing.pack_replicas(inst, packing.domain_slots(inst, True))
    assert same_groups(packing.fit_power(inst, groups), ref_fit_power(inst, groups))
