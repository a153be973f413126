"""The exact GPU choice (ntp_opt/planners/exact/choice.py) against the brute force.

Domains across two racks (NVL36x2-like), domains mixing TDPs and domains whose
board limits disagree with speeds: fastest-first can miss the optimum there;
with the exact choice the planner proves the brute force's optimum.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_opt import Instance, Job, solve, validate
from ntp_opt.model import topology
from ntp_opt.planners.base import RunOptions
from ntp_opt.planners.exact import choice, search
from ntp_opt.planners.exact.backends import available_backends, solve_program
from ntp_opt.planners.exact.capacity import build_capacity, iter_stages, level_floor
from ntp_opt.planners.exact.colgen import ColumnGeneration, column_generation_available
from ntp_opt.planners.exact.configs import domain_configs
from ntp_opt.planners.exact.model import NoClusterGraph, prepare, rack_relaxed
from ntp_opt.planners.exact.search import solve_exact
from tests.bruteforce import brute_force
from tests.helpers import HANG_GUARD

# (domains, GPUs per domain, GPUs per tray, trays per rack): the first five have
# domains across racks, the last two racks shared by two domains (rack rows)
SHAPES = [(1, 8, 2, 2), (2, 4, 1, 2), (2, 8, 2, 2), (1, 6, 1, 3), (2, 6, 1, 3), (2, 4, 2, 4)]


def choice_instance(seed: int) -> Instance:
    """A tiny instance where fastest-first may not be optimal (up to 16 GPUs): a
    domain across racks, or sharing a rack; seed % 3 == 1 mixes TDPs, == 2 sets
    board limits on two random GPUs."""
    rng = np.random.default_rng(seed)
    nd, size, tray, tpr = SHAPES[seed % len(SHAPES)]
    g = topology.build_cluster(
        nd, size, tray, tpr, rack_power_factor=float(rng.choice([1.0, 1.1, 1.25]))
    )
    gpus = topology.gpus(g)
    picks = rng.permutation(len(gpus))
    n_fail, n_slow = int(rng.integers(0, 3)), int(rng.integers(0, 3))
    topology.fail_gpus(g, [gpus[i] for i in picks[:n_fail]])
    for i in picks[n_fail : n_fail + n_slow]:
        topology.set_speed(g, [gpus[i]], float(rng.choice([0.5, 0.8, 0.9])))
    if seed % 3 == 1:  # mixed TDP
        for i in picks[n_fail + n_slow : n_fail + n_slow + 2]:
            g.nodes[gpus[i]]["tdp_w"] = float(rng.choice([700.0, 1200.0]))
    if seed % 3 == 2:  # board limits
        for i in picks[-2:]:
            g.nodes[gpus[i]]["max_power_w"] = float(rng.choice([1000.0, 1100.0]))
    g.graph["power_budget_w"] = float(rng.choice([0.9, 1.0, 1.2])) * 1000 * len(gpus)
    tp = int(rng.choice([2, 3, 4])) if size <= 6 else int(rng.choice([3, 4]))
    dp = int(rng.integers(1, 4))
    batch = int(rng.integers(dp, 3 * dp + 1))
    job = Job(
        tp=tp,
        tp_min=int(rng.choice([max(1, tp - 1), tp])),
        pp=int(rng.choice([1, 1, 2])),
        dp=dp,
        dp_max=dp + int(rng.integers(0, 2)),
        global_batch=batch,
        max_local_batch=-(-batch // dp) + int(rng.integers(0, 2)),
        batch_policy=str(rng.choice(["fixed", "elastic"])),
        power_exponent=float(rng.choice([0.65, 0.3, 1.0])),
        max_boost=float(rng.choice([0.3, 1.0])),
        idle_power_fraction=float(rng.choice([0.1, 0.0, 0.5])),
        reshard_overhead=float(rng.choice([0.01, 0.0])),
    )
    return Instance(f"choice-{seed}", g, job)


@pytest.mark.parametrize("seed", range(36))
def test_exact_choice_equals_brute_force(seed):
    inst = choice_instance(seed)
    best, _ = brute_force(inst)
    res = solve(inst, "optimal", time_limit=HANG_GUARD)
    assert validate(inst, res.plan) == []
    assert res.bound is not None and res.bound >= best * (1 - 1e-9)
    assert res.objective <= best * (1 + 1e-9)
    # the choice refused (too many splits): optimal only where the plan meets the bound
    if not prepare(inst).inexact or res.status == "optimal":
        assert res.status == "optimal"
        assert res.objective == pytest.approx(best, rel=1e-6, abs=1e-12)


def test_most_small_instances_are_in_scope():
    covered = [not prepare(choice_instance(seed)).inexact for seed in range(36)]
    assert sum(covered) >= 30


# seeds where fastest-first placements miss the optimum (found with the brute force)
MISSED = [9, 26, 28, 29, 34, 46]  # 29: two domains sharing a rack


@pytest.mark.parametrize("seed", MISSED)
def test_fastest_first_misses_what_the_choice_finds(seed, monkeypatch):
    inst = choice_instance(seed)
    assert prepare(inst).choice  # some domain is chosen exactly
    best, _ = brute_force(inst)
    monkeypatch.setattr(choice, "MAX_STATES", 0)  # refuse the exact choice: fastest-first
    old = solve(inst, "optimal", time_limit=HANG_GUARD)
    assert prepare(inst).inexact and old.status == "feasible"
    assert old.objective < best * (1 - 1e-6)
    assert old.bound is not None and old.bound >= best * (1 - 1e-9)


def test_shared_racks_keep_every_pareto_split():
    # two domains of 4 GPUs in one rack, mixed TDP: the rack is a row of the program,
    # so a multiset of stage kinds may need several splits (least draw per rack)
    inst = choice_instance(29)  # board limits on two GPUs
    prep = prepare(inst)
    assert prep.choice and not any(cd.single for cd in prep.choice.values())
    assert prep.multi


@pytest.mark.parametrize("sizes", [(3, 2), (4, 1, 2), (2, 2, 2, 1)])
def test_splits_are_every_bounded_composition(sizes):
    members = []
    start = 0
    for n in sizes:
        members.append(tuple(range(start, start + n)))
        start += n
    g = len(sizes)
    cd = choice.ChoiceDomain(
        tuple(members), np.ones(g), np.ones(g), np.ones(g), np.zeros(g, dtype=np.int64), True
    )
    for t in range(sum(sizes) + 2):
        want = {k for k in itertools.product(*(range(n + 1) for n in sizes)) if sum(k) == t}
        got = {tuple(int(x) for x in row) for row in cd.splits(t)}
        assert got == want


def test_too_many_groups_stay_fastest_first():
    # 16 GPUs over 2 racks with 8 distinct speeds, TP1: 16 stages per domain
    g = topology.build_cluster(1, 16, 2, 4)
    for i, gpu in enumerate(topology.gpus(g)):
        topology.set_speed(g, [gpu], 1.0 - 0.05 * (i % 8))
    inst = Instance("many", g, Job(tp=1, pp=1, dp=4, global_batch=4))
    prep = prepare(inst)
    assert not prep.choice
    assert "spans racks" in prep.inexact and "no exact GPU choice" in prep.inexact


@st.composite
def two_rack_domains(draw: st.DrawFn) -> Instance:
    """One NVL36x2-like domain of 6 or 8 GPUs over two racks with their own budgets,
    random TDPs (700-1200 W) and speeds: several stages per domain."""
    size = draw(st.sampled_from([6, 8]))
    g = topology.build_cluster(1, size, 1, size // 2)
    gpus = topology.gpus(g)
    for gpu in gpus:
        g.nodes[gpu]["tdp_w"] = draw(st.sampled_from([700.0, 1000.0, 1200.0]))
        topology.set_speed(g, [gpu], draw(st.sampled_from([1.0, 1.0, 0.8])))
    for r in topology.racks(g):  # racks of 1,000 W GPUs' worth, with 0-30 % to boost
        g.nodes[r]["power_budget_w"] = 500.0 * size * draw(st.sampled_from([1.0, 1.1, 1.3]))
    tp = draw(st.sampled_from([2, 3] if size == 6 else [3, 4]))
    dp = draw(st.integers(1, 3))
    batch = draw(st.integers(dp, 2 * dp + 1))
    job = Job(
        tp=tp,
        tp_min=tp,
        pp=draw(st.sampled_from([1, 2])),
        dp=dp,
        global_batch=batch,
        max_local_batch=-(-batch // dp) + 1,
        batch_policy=draw(st.sampled_from(["fixed", "elastic"])),
        max_boost=draw(st.sampled_from([0.3, 1.0])),
        idle_power_fraction=draw(st.sampled_from([0.0, 0.3])),
    )
    return Instance("two-racks", g, job)


@settings(max_examples=max(2, round((settings.default.max_examples or 12) * 0.5)))
@given(two_rack_domains())
def test_two_rack_domains_are_exact(inst):
    assert not prepare(inst).inexact
    best, _ = brute_force(inst)
    res = solve(inst, "optimal", time_limit=HANG_GUARD)
    assert validate(inst, res.plan) == []
    assert res.status == "optimal"
    assert res.objective == pytest.approx(best, rel=1e-6, abs=1e-12)
    assert res.bound is not None and res.bound >= best * (1 - 1e-9)


@pytest.mark.skipif(
    not column_generation_available() or "cpsat" not in available_backends(),
    reason="needs highspy and ortools",
)
@pytest.mark.parametrize("seed", [0, 2, 9, 26, 29, 34])
def test_column_generation_prices_chosen_domains_exactly(seed):
    # configurations generated on demand for chosen domains: the same C(theta') as the
    # full program over the exact listing, proven
    inst = choice_instance(seed)
    prep = prepare(inst)
    assert prep.choice
    job = inst.job
    for degrees in {(job.tp,), job.allowed}:
        cg = ColumnGeneration(prep, degrees)
        top = (
            min(job.local_batch_max, job.global_batch)
            * job.seq_time_s
            / job.tp_factor(min(degrees))
        )
        for theta in np.geomspace(0.4 * job.seq_time_s, 1.3 * top, 4).tolist():
            cap = build_capacity(prep, theta, degrees)
            want = 0
            if cap.classes:
                sol = solve_program(cap.program, "cpsat")
                want = int(sol.objective or 0)
            got = cg.solve(theta, "cpsat")
            assert got.upper == got.lower == want, (theta, degrees)
            stages = list(iter_stages(prep, got.capacity, got.solution.x))
            assert sum(st.batch for st in stages) == got.lower * job.pp
            used = [g for st in stages for g in st.gpus]
            assert len(used) == len(set(used))  # no GPU in two stages


def tp36_like(seed: int) -> Instance:
    """Two NVL36x2-like domains of 8 GPUs, each across two racks of 4 (own budgets),
    TP4 with TP3 allowed: at most two stages per domain, as TP36 on NVL36x2. Up to
    one failed GPU and one straggler; a fixed batch at or one below ``dp_max M``
    (every replica then carries ``M`` or ``M - 1``: :func:`capacity.level_floor` > 1),
    or elastic with boost."""
    rng = np.random.default_rng(1000 + seed)
    g = topology.build_cluster(2, 8, 2, 2, rack_power_factor=float(rng.choice([1.0, 1.1, 1.25])))
    gpus = topology.gpus(g)
    picks = rng.permutation(len(gpus))
    n_fail, n_slow = int(rng.integers(0, 2)), int(rng.integers(0, 2))
    topology.fail_gpus(g, [gpus[i] for i in picks[:n_fail]])
    for i in picks[n_fail : n_fail + n_slow]:
        topology.set_speed(g, [gpus[i]], float(rng.choice([0.8, 0.9])))
    pp = int(rng.choice([1, 2]))
    dp_max = 4 // pp - int(rng.integers(0, 2))
    big_m = int(rng.integers(3, 5))
    fixed = seed % 2 == 0
    batch = dp_max * big_m - int(rng.integers(0, 2)) if fixed else dp_max * big_m
    job = Job(
        tp=4,
        tp_min=3,
        pp=pp,
        dp=dp_max,
        dp_max=dp_max,
        global_batch=batch,
        max_local_batch=big_m,
        batch_policy="fixed" if fixed else "elastic",
        power_exponent=float(rng.choice([0.65, 1.0])),
        max_boost=0.3,
        idle_power_fraction=float(rng.choice([0.1, 0.3])),
        reshard_overhead=float(rng.choice([0.01, 0.0])),
    )
    return Instance(f"tp36-like-{seed}", g, job)


@pytest.mark.parametrize("seed", range(12))
def test_tp36_like_domains_are_exact(seed):
    # the level floor (fixed), the LP levels of the descent and the remembered
    # last-stage picks (elastic) all apply here
    inst = tp36_like(seed)
    prep = prepare(inst)
    assert not prep.inexact and len(prep.choice) == 2
    if inst.job.batch_policy == "fixed":
        assert level_floor(prep, inst.job.global_batch) >= inst.job.max_local_batch - 1 > 1
    best, _ = brute_force(inst)
    res = solve(inst, "optimal", time_limit=HANG_GUARD)
    assert validate(inst, res.plan) == []
    assert res.status == "optimal"
    assert res.objective == pytest.approx(best, rel=1e-6, abs=1e-12)
    assert res.bound is not None and res.bound >= best * (1 - 1e-9)


def _carried(inst: Instance, theta: float, min_batch: int = 1) -> int:
    cap = build_capacity(prepare(inst), theta, inst.job.allowed, min_batch=min_batch)
    sol = solve_program(cap.program, "cpsat" if "cpsat" in available_backends() else "highs")
    assert sol.status == "optimal"
    return int(sol.objective)


@pytest.mark.parametrize("seed", [0, 2, 4])
def test_level_floor_decides_the_target(seed):
    # C(theta) >= B exactly when the program without levels below the floor reaches B
    inst = tp36_like(seed)
    big_b = inst.job.global_batch
    floor = level_floor(prepare(inst), big_b)
    assert floor > 1
    reached = 0
    for theta in np.geomspace(0.5, 8.0, 9):
        full, cut = _carried(inst, float(theta)), _carried(inst, float(theta), floor)
        assert cut <= full
        assert (cut >= big_b) == (full >= big_b)
        reached += full >= big_b
    assert 0 < reached < 9  # both answers occur


def test_remembered_pairs_list_as_a_fresh_domain():
    # one domain listed at a sequence of step times (pairs remembered from the earlier
    # ones) gives exactly the listing of a domain that never saw another step time
    inst = tp36_like(1)
    prep = prepare(inst)
    d, cd = next(iter(prep.choice.items()))
    dom = prep.domains[d]
    for theta in (6.0, 4.0, 3.9, 2.5, 2.4):
        got = domain_configs(prep, dom, 2, theta, inst.job.allowed)
        fresh = choice.ChoiceDomain(cd.members, cd.speed, cd.tdp, cd.cap, cd.rack, cd.single)
        prep.choice[d] = fresh
        want = domain_configs(prep, dom, 2, theta, inst.job.allowed)
        prep.choice[d] = cd
        assert got == want
    assert cd._pairs  # the listing did remember pairs


@pytest.mark.parametrize("seed", range(36))
def test_rack_merged_relaxation_proves_only_the_optimum(seed, monkeypatch):
    # the exact choice refused everywhere (fastest-first): a proof can only come from
    # the rack-merged relaxation, and it must hold against the brute force
    monkeypatch.setattr(choice, "MAX_STATES", 0)
    inst = choice_instance(seed)
    best, _ = brute_force(inst)
    res = solve(inst, "optimal", time_limit=HANG_GUARD)
    assert validate(inst, res.plan) == []
    assert res.bound is not None and res.bound >= best * (1 - 1e-9)
    assert res.objective <= best * (1 + 1e-9)
    if res.status == "optimal":
        assert res.objective == pytest.approx(best, rel=1e-6, abs=1e-12)
    else:
        assert res.limit in ("unsettled", "time_limit")


@pytest.mark.parametrize("seed", [0, 3, 6, 12, 15, 30, 33])
def test_rack_merged_relaxation_settles_fastest_first(seed, monkeypatch):
    # fastest-first finds the optimum but cannot prove it (its model is not exact
    # across racks); the search on the rack-merged instance proves it
    monkeypatch.setattr(choice, "MAX_STATES", 0)
    inst = choice_instance(seed)
    assert "spans racks" in prepare(inst).inexact
    best, _ = brute_force(inst)
    old = solve_exact(inst, RunOptions(time_limit=HANG_GUARD), relax_racks=False)
    assert not old.proven and old.limit == "unsettled"
    new = solve_exact(inst, RunOptions(time_limit=HANG_GUARD))
    assert new.proven and new.limit == "none"
    assert any("racks merged" in line for line in new.log)
    assert new.stats["goodput"] == pytest.approx(best, rel=1e-6, abs=1e-12)
    assert new.bound is not None and best * (1 - 1e-9) <= new.bound <= best * (1 + 1e-6)


def test_rack_relaxed_merges_the_racks_of_a_spanning_domain():
    inst = choice_instance(0)  # one domain of 8 GPUs over two racks
    prep = prepare(inst)
    merged = rack_relaxed(prep)
    assert merged is not None
    a, m = inst.arrays, merged.arrays
    assert len(set(a.gpu_rack.tolist())) == 2 and len(set(m.gpu_rack.tolist())) == 1
    assert m.rack_budget.sum() == pytest.approx(a.rack_budget.sum())
    assert m.rack_budget[m.gpu_rack[0]] == pytest.approx(a.rack_budget.sum())
    assert "spans racks" not in prepare(merged).inexact
    with pytest.raises(NoClusterGraph):  # its graph would not match its arrays
        _ = merged.cluster
    # racks not spanned by a domain stay as they are
    job = Job(tp=2, pp=1, dp=2, global_batch=2)
    one_rack = Instance("one", topology.build_cluster(2, 4, 1, 4), job)
    assert rack_relaxed(prepare(one_rack)) is None


def test_rack_merged_relaxation_without_a_graph_is_no_proof(monkeypatch):
    # a warm start that reads the cluster graph (the merged instance has none): the
    # relaxation gives no bound, and the search still returns its plan, unproven
    monkeypatch.setattr(choice, "MAX_STATES", 0)
    real = search.baselines.ntp_pw

    def reads_graph(instance):  # type: ignore[no-untyped-def]
        _ = instance.cluster
        return real(instance)

    monkeypatch.setattr(search.baselines, "ntp_pw", reads_graph)
    inst = choice_instance(0)
    res = solve_exact(inst, RunOptions(time_limit=HANG_GUARD))
    assert not res.proven and res.limit == "unsettled"
    assert any("needs the cluster graph" in line for line in res.log)
    assert validate(inst, res.plan) == []
