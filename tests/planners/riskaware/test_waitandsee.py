"""The wait-and-see bound of risk-aware planning (issue 16, docs/risk.md).

On tiny instances every plan is enumerated and scored exactly over every
scenario (:func:`ntp_opt.rules.expected.expected_goodput`, the recourse of
docs/failures.md), which gives the exact expected optimum. The checks are

    risk-aware's expected goodput <= exact expected optimum <= wait-and-see bound.

No assertion depends on the machine's speed: the bound is computed without a
deadline (every scenario solved to its proof) or with a limit never reached.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from ntp_opt import solve
from ntp_opt.model import topology
from ntp_opt.model.failures import failed_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.planners.base import RunOptions
from ntp_opt.planners.bounds import capacity_bound
from ntp_opt.planners.riskaware import (
    plan_risk_aware,
    relaxed_instance,
    risk_instance,
    training_scenarios,
    wait_and_see_bound,
)
from ntp_opt.planners.riskaware.nonanticipative import domain_bound, restricted_instance
from ntp_opt.planners.riskaware.scorer import refills_keep_power
from ntp_opt.planners.riskaware.waitandsee import idle_instance
from ntp_opt.rules.expected import expected_goodput
from ntp_opt.rules.recourse import adapt
from ntp_opt.rules.validate import check, evaluate
from tests.helpers import HANG_GUARD


def _tiny(seed: int) -> Instance:
    """A risky instance small enough to enumerate every plan.

    Domains of 2 GPUs (one rack each, one GPU per tray), TP 2, no power boost
    (every multiplier is 1, so a plan is its replicas and GPU sets), at most
    two replicas, at most 4 failure units.
    """
    rng = np.random.default_rng(seed)
    nd = int(rng.choice([3, 4]))
    g = topology.build_cluster(nd, 2, 1, 2)
    gpus = topology.gpus(g)
    picks = rng.permutation(len(gpus))
    if rng.random() < 0.4:
        topology.fail_gpus(g, [gpus[int(picks[0])]])
    topology.set_speed(g, [gpus[int(picks[1])]], float(rng.choice([0.5, 0.8])))
    g.graph["power_budget_w"] = float(rng.choice([0.8, 1.0])) * 1000 * len(gpus)
    risky = [gpus[int(i)] for i in picks[2 : 2 + int(rng.integers(2, 4))]]
    for gid in risky:
        topology.set_p_fail(g, float(rng.choice([0.1, 0.3])), [gid])
    trays = topology.trays(g)
    if rng.random() < 0.5:
        topology.set_p_fail(g, 0.2, [trays[int(rng.integers(len(trays)))]])
    pp = int(rng.choice([1, 2]))
    dp = int(rng.integers(1, 3))
    batch = int(rng.integers(dp, 3 * dp + 1))
    job = Job(
        tp=2,
        tp_min=1 if pp == 1 else 2,
        pp=pp,
        dp=dp,
        dp_max=2,
        global_batch=batch,
        max_local_batch=-(-batch // dp) + int(rng.integers(0, 2)),
        batch_policy=str(rng.choice(["fixed", "elastic"])),
        max_boost=0.0,
        idle_power_fraction=float(rng.choice([0.0, 0.1, 0.5])),
        reshard_overhead=0.1,
    )
    return Instance(f"tiny-{seed}", g, job)


def _stages(inst: Instance, t: int) -> list[tuple[str, tuple[str, ...]]]:
    """Every stage of degree ``t``: a domain and a set of its healthy GPUs."""
    a = inst.arrays
    out = []
    for d, idx in zip(a.domain_ids, a.domain_gpus, strict=True):
        healthy = [a.gpu_ids[i] for i in idx if a.healthy[i]]
        out += [(d, c) for c in itertools.combinations(healthy, t)]
    return out


def _plans(inst: Instance) -> list[Plan]:
    """Every plan of a tiny instance up to batches (recourse re-splits them).

    Replicas, and the stages of a replica, in every order (recourse serves
    replicas in plan order); the GPUs of a stage as a set (the GPUs of a
    domain share rack and TDP here, so which of two equally fast ones a
    stage keeps changes nothing).
    """
    job = inst.job
    replicas = []
    for t in job.tp_allowed:
        for stages in itertools.permutations(_stages(inst, t), job.pp):
            gpus = [x for _, g in stages for x in g]
            if len(set(gpus)) == len(gpus):
                reps = tuple(Stage(domain=d, gpus=g, power=1.0) for d, g in stages)
                replicas.append((t, reps, set(gpus)))
    plans = [Plan(inst.name, ())]
    for n in range(1, job.dp_max + 1):
        for combo in itertools.permutations(replicas, n):
            used = [g for _, _, s in combo for g in s]
            if len(used) != len(set().union(*(s for _, _, s in combo))):
                continue
            raw = Plan(inst.name, tuple(Replica(t, 1, st) for t, st, _ in combo))
            plan = adapt(inst, raw, None)  # the exact batch split; empty if B does not fit
            if plan.replicas and evaluate(inst, plan).feasible:
                plans.append(plan)
    return plans


def _exact_expected_optimum(inst: Instance) -> float:
    return max(expected_goodput(inst, p, method="exact").mean for p in _plans(inst))


@pytest.mark.parametrize("seed", range(6))
def test_risk_aware_below_exact_expected_optimum_below_wait_and_see(seed: int) -> None:
    inst = _tiny(seed)
    out = plan_risk_aware(inst, RunOptions(time_limit=HANG_GUARD), ws_bound=True)
    m = out.plan.metrics
    assert m["saa_method"] == "exact"  # the training objective is the exact expectation
    aware = expected_goodput(inst, out.plan, method="exact").mean
    assert aware == pytest.approx(m["saa_expected_goodput"], rel=1e-9, abs=1e-12)
    best = _exact_expected_optimum(inst)
    assert out.bound is not None
    assert aware <= best * (1 + 1e-9) + 1e-12
    assert best <= out.bound * (1 + 1e-9) + 1e-12
    # with no deadline, the same bound from the function itself
    scen = training_scenarios(inst)
    ws = wait_and_see_bound(inst, scen)
    assert ws.bound == pytest.approx(out.bound, rel=1e-9, abs=1e-12)
    assert ws.solved + ws.capped <= len(scen.gpus)


@pytest.mark.parametrize("seed", [0, 3])
def test_each_scenario_bound_is_above_that_scenario_optimum(seed: int) -> None:
    # U_s >= G(P, s) for every plan P and scenario s, not only on average
    inst = _tiny(seed)
    scen = training_scenarios(inst)
    ws = wait_and_see_bound(inst, scen)
    plans = _plans(inst)
    for g, u in zip(scen.gpus, ws.scenario_bounds, strict=True):
        mask = np.zeros(inst.arrays.n_gpus, dtype=bool)
        mask[g] = True
        best = max(adapt(inst, p, mask).metrics["goodput"] for p in plans)
        assert best <= u * (1 + 1e-9) + 1e-12


def test_pack_bound_by_hand_and_gap() -> None:
    # pack: 8 domains, 4 replicas of 2, no spare domain; one tray in each of
    # 4 domains fails with p = 0.1 and drops its domain. With k domains
    # failed the best plan still runs floor((8 - k) / 2) replicas, each
    # worth 1/4 of the relative goodput: the wait-and-see bound is
    # E = P(0) + 3/4 (P(1) + P(2)) + 1/2 (P(3) + P(4))
    #   = 0.6561 + 0.75 * 0.3402 + 0.5 * 0.0037 = 0.91310.
    # The best plan pairs the risky domains: 0.905 (test_riskaware.py). The
    # domain bound knows that a failed domain takes its whole replica down
    # and that the pairs are chosen before the failures: it proves 0.905.
    inst = risk_instance("pack")
    scale = inst.job.seq_time_s / inst.job.dp
    ws = wait_and_see_bound(inst, training_scenarios(inst))
    assert ws.bound * scale == pytest.approx(0.91310, abs=1e-5)
    res = solve(inst, "risk-aware", time_limit=HANG_GUARD)
    assert res.plan is not None and res.bound is not None and res.expected_objective is not None
    m = res.plan.metrics
    assert res.expected_objective == m["saa_expected_goodput"]
    assert res.expected_objective * scale == pytest.approx(0.905, abs=1e-9)
    assert res.bound * scale == pytest.approx(0.905, rel=2e-6)
    assert res.bound == m["expected_bound"] == m["na_bound"]
    assert res.gap is not None and res.gap <= 1e-6
    assert res.status == "optimal"
    assert res.objective == pytest.approx(check(inst, res.plan).goodput)  # still nominal


def test_spare_domains_is_proven_optimal_for_the_expectation() -> None:
    # four risk-free domains carry the whole job: the risk-aware plan loses
    # nothing in any scenario, so it meets every scenario's optimum; no
    # scenario needs a solve (the plan itself reaches the cap in each)
    inst = risk_instance("spare-domains")
    res = solve(inst, "risk-aware", time_limit=HANG_GUARD)
    assert res.status == "optimal" and res.limit == "none"
    assert res.gap is not None and res.gap <= 1e-6
    assert res.plan is not None
    assert res.plan.metrics["ws_solved"] == 0
    assert res.plan.metrics["ws_capped"] == res.plan.metrics["saa_samples"]


def test_same_scenarios_same_bound() -> None:
    inst = _tiny(1)
    a = wait_and_see_bound(inst, training_scenarios(inst, exact_units=0, samples=40, seed=7))
    b = wait_and_see_bound(inst, training_scenarios(inst, exact_units=0, samples=40, seed=7))
    assert a.bound == b.bound
    assert np.array_equal(a.scenario_bounds, b.scenario_bounds)


def test_without_exact_solves_the_cap_is_the_capacity_bound() -> None:
    # above max_gpus no scenario is solved: every scenario gets the cap,
    # capacity_bound of the instance itself (its domains lie in one rack with
    # one TDP: recourse keeps the nominal draws, no relaxation is needed),
    # still above the objective
    inst = risk_instance("pack")
    assert refills_keep_power(inst)
    scen = training_scenarios(inst)
    ws = wait_and_see_bound(inst, scen, max_gpus=0)
    assert ws.solved == 0
    assert ws.cap == pytest.approx(capacity_bound(inst), rel=1e-12)
    assert ws.bound <= ws.cap * (1 + 1e-12)  # lower tiers: smaller caps
    assert np.all(ws.scenario_bounds <= ws.cap * (1 + 1e-12))
    out = plan_risk_aware(inst, RunOptions(time_limit=HANG_GUARD), ws_bound=False)
    assert out.bound is None and "ws_bound" not in out.plan.metrics
    assert ws.bound >= out.plan.metrics["saa_expected_goodput"]


def test_relaxed_instance_accepts_every_scenario_plan() -> None:
    # a scenario's plans stay feasible when its failed GPUs come back as
    # healthy spares, once the budgets carry their idle draw
    inst = risk_instance("mixed")
    scen = training_scenarios(inst, samples=30, seed=2)
    relaxed = relaxed_instance(inst, scen.gpus)
    a, r = inst.arrays, relaxed.arrays
    # the largest idle draw one scenario frees, per rack and at the site
    idle = inst.job.idle_power_fraction * a.tdp
    most = max(float(idle[np.unique(g)].sum()) for g in scen.gpus)
    assert r.site_budget == pytest.approx(a.site_budget + most, rel=1e-12)
    assert np.all(r.rack_budget >= a.rack_budget)
    for g in scen.gpus[:3]:
        mask = np.zeros(a.n_gpus, dtype=bool)
        mask[g] = True
        res = solve(failed_instance(inst, mask), "ntp-pw")
        assert res.plan is not None
        check(relaxed, res.plan)
    # with no idle draw there is nothing to raise: the instance itself
    no_idle = inst.with_job(inst.job.model_copy(update={"idle_power_fraction": 0.0}))
    assert relaxed_instance(no_idle, scen.gpus) is no_idle


def test_cli_prints_the_expected_goodput_bound_and_gap(tmp_path, capsys) -> None:
    from ntp_opt.app.cli import main
    from ntp_opt.model.files import save_instance

    path = tmp_path / "spare.json"
    save_instance(risk_instance("spare-domains"), path)
    assert main(["solve", str(path), "--policy", "risk-aware", "--time-limit", "600"]) == 0
    out = capsys.readouterr().out
    assert "risk-aware: expected goodput after recourse 1.0000 (rel., exact over 16" in out
    # the exact planner's bounds sit within its tolerance (1e-6) above the optimum
    found = re.search(r", bound 1\.0000, gap (\S+):", out)
    assert found is not None and float(found.group(1)) <= 2e-6


@pytest.mark.parametrize("name", ["pack", "mixed", "mixed-fixed"])
def test_recourse_stays_feasible_with_failed_gpus_drawing_idle(name: str) -> None:
    # the claim behind the nominal cap and the domain bound: where every domain
    # lies in one rack with one TDP, the recourse of a plan is feasible even when
    # the failed GPUs (and every GPU outside the plan's domains) still draw idle
    # power; the budgets are lowered by exactly that draw
    inst = risk_instance(name)
    assert refills_keep_power(inst)
    a = inst.arrays
    plans = [solve(inst, "ntp").plan, solve(inst, "ntp-pw").plan]
    scen = training_scenarios(inst, samples=40, seed=3)
    checked = 0
    for plan in plans:
        assert plan is not None
        ids = [a.gpu_index[g] for r in plan.replicas for st in r.stages for g in st.gpus]
        used = np.unique(a.gpu_domain[ids])
        for g in scen.gpus:
            mask = np.zeros(a.n_gpus, dtype=bool)
            mask[g] = True
            after = adapt(inst, plan, mask)
            idle = idle_instance(inst, mask)
            watts = inst.job.idle_power_fraction * float(a.tdp[g][a.healthy[g]].sum())
            assert idle.arrays.site_budget == pytest.approx(a.site_budget - watts, abs=1e-9)
            # check raises on a broken rule; the goodput is the recourse's
            value = check(failed_instance(inst, mask), after).goodput
            assert check(idle, after).goodput == pytest.approx(value, rel=1e-12)
            restricted = restricted_instance(inst, used, g)
            assert check(restricted, after).goodput == pytest.approx(value, rel=1e-12)
            checked += 1
    assert checked == 2 * len(scen.gpus)


def _tiny_uniform(seed: int) -> Instance:
    """As :func:`_tiny`, with identical domains (no straggler, none failed).

    The non-anticipative domain bound applies: with PP1 a plan uses at most
    ``pp · dp_max = 2`` of the 3-4 domains; with PP2 (TP2, ``tp_min`` 2) a
    domain holds one stage, and a failure in it takes its replica down.
    """
    rng = np.random.default_rng(seed)
    nd = int(rng.choice([3, 4]))
    g = topology.build_cluster(nd, 2, 1, 2)
    gpus = topology.gpus(g)
    picks = rng.permutation(len(gpus))
    g.graph["power_budget_w"] = float(rng.choice([0.8, 1.0])) * 1000 * len(gpus)
    for i in picks[: int(rng.integers(2, 4))]:
        topology.set_p_fail(g, float(rng.choice([0.1, 0.3])), [gpus[int(i)]])
    trays = topology.trays(g)
    if rng.random() < 0.5:
        topology.set_p_fail(g, 0.2, [trays[int(rng.integers(len(trays)))]])
    pp = int(rng.choice([1, 2]))
    dp = int(rng.integers(1, 3))
    batch = int(rng.integers(dp, 3 * dp + 1))
    job = Job(
        tp=2,
        tp_min=pp,
        pp=pp,
        dp=dp,
        dp_max=2,
        global_batch=batch,
        max_local_batch=-(-batch // dp) + int(rng.integers(0, 2)),
        batch_policy=str(rng.choice(["fixed", "elastic"])),
        max_boost=0.0,
        idle_power_fraction=float(rng.choice([0.0, 0.1, 0.5])),
        reshard_overhead=0.1,
    )
    return Instance(f"tiny-uniform-{seed}", g, job)


def test_planner_equals_enumeration_on_tiny_instances() -> None:
    # 50 seeded tiny instances (half with identical domains, where the domain
    # bound applies): every plan is enumerated and scored by its exact
    # expected goodput after recourse. The planner's objective (exact here)
    # must equal the best expectation among the plans that keep the nominal
    # optimum (nominal_tolerance=0), and its bound must lie above the best
    # expectation of every plan, nominal optimum or not.
    coupled = proven = 0
    for seed in range(50):
        inst = _tiny_uniform(seed) if seed % 2 else _tiny(100 + seed)
        scored = [
            (evaluate(inst, p).goodput, expected_goodput(inst, p, method="exact").mean)
            for p in _plans(inst)
        ]
        out = plan_risk_aware(inst, RunOptions(time_limit=None))
        m = out.plan.metrics
        assert m["saa_method"] == "exact"
        nominal = evaluate(inst, out.blind).goodput
        assert max(g for g, _ in scored) <= nominal * (1 + 1e-9) + 1e-12  # blind is optimal
        best_kept = max(e for g, e in scored if g >= nominal * (1 - 1e-9))
        best_any = max(e for _, e in scored)
        value = out.stats["expected_objective"]
        assert expected_goodput(inst, out.plan, method="exact").mean == pytest.approx(
            value, rel=1e-9, abs=1e-12
        )
        assert value == pytest.approx(best_kept, rel=1e-9, abs=1e-12), seed
        assert out.bound is not None
        assert best_any <= out.bound * (1 + 1e-9) + 1e-12, seed
        if out.proven:
            assert out.bound - value <= 1e-6 * out.bound
            proven += 1
        coupled += "na_bound" in m
    assert coupled == 25  # the domain bound ran on every uniform instance
    assert proven >= 20


def _tiny_boosted(seed: int, boost: float = 0.3) -> Instance:
    """4 identical domains of 3 GPUs (one rack each, budget 3 TDPs), TP3 PP2.

    A TP3 stage fills its rack's budget at ``π = 1``; a stage that loses a GPU
    could boost with the freed watts, which recourse never does. A domain
    holds one stage (``tp_min`` 2), so the domain bound's replica groups and
    its power cap both apply.
    """
    rng = np.random.default_rng(seed)
    g = topology.build_cluster(4, 3, 1, 3)
    gpus = topology.gpus(g)
    for i in rng.permutation(len(gpus))[: int(rng.integers(2, 5))]:
        topology.set_p_fail(g, float(rng.choice([0.1, 0.3])), [gpus[int(i)]])
    job = Job(
        tp=3,
        tp_min=2,
        pp=2,
        dp=2,
        dp_max=2,
        global_batch=int(rng.integers(2, 7)),
        batch_policy=str(rng.choice(["fixed", "elastic"])),
        max_boost=boost,
        idle_power_fraction=float(rng.choice([0.0, 0.1, 0.5])),
        reshard_overhead=0.1,
    )
    return Instance(f"tiny-boosted-{seed}", g, job)


def _full_plans(inst: Instance) -> list[Plan]:
    """Every plan of two TP3 replicas at ``π = 1`` (replicas and stages in every order)."""
    a = inst.arrays
    doms = [
        (d, tuple(a.gpu_ids[i] for i in idx))
        for d, idx in zip(a.domain_ids, a.domain_gpus, strict=True)
    ]
    plans = []
    for order in itertools.permutations(doms):
        reps = (order[:2], order[2:])
        raw = Plan(
            inst.name,
            tuple(
                Replica(3, 1, tuple(Stage(domain=d, gpus=g, power=1.0) for d, g in r)) for r in reps
            ),
        )
        plans.append(adapt(inst, raw, None))
    return plans


@pytest.mark.parametrize("seed", range(12))
def test_power_cap_and_degraded_groups_against_enumeration(seed: int) -> None:
    # a rack's budget is 3 TDPs, so a TP3 stage runs at π = 1 (π >= 1); a plan
    # with a TP2 stage, even at the most power its rack allows, or with one
    # replica, has less nominal goodput: every plan keeping the nominal
    # optimum is two TP3 replicas at π = 1 over the 4 domains, enumerated
    # here. The bound (power cap: no scenario program boosts; degraded domains
    # in distinct replicas degrade their partners) must lie above each one's
    # exact expectation, and the planner must reach the best of them; with
    # boost the bound closes the gap. Seeds 8-11 have no boost (no power cap:
    # the replica groups of degraded domains alone).
    boost = 0.3 if seed < 8 else 0.0
    inst = _tiny_boosted(seed, boost)
    a, job = inst.arrays, inst.job
    kept = _full_plans(inst)
    nominal = max(evaluate(inst, p).goodput for p in kept)
    assert all(evaluate(inst, p).goodput == pytest.approx(nominal, rel=1e-12) for p in kept)
    doms = [tuple(a.gpu_ids[i] for i in idx) for idx in a.domain_gpus]
    top = min(1 + job.max_boost, (3 - job.idle_power_fraction) / 2)  # TP2: what the rack allows
    weaker = [
        Plan(inst.name, (Replica(3, 1, (Stage("d0", doms[0], 1.0), Stage("d1", doms[1], 1.0))),)),
        Plan(
            inst.name,
            (
                Replica(3, 1, (Stage("d0", doms[0], 1.0), Stage("d1", doms[1], 1.0))),
                Replica(2, 1, (Stage("d2", doms[2][:2], top), Stage("d3", doms[3][:2], top))),
            ),
        ),
    ]
    for p in weaker:
        p = adapt(inst, p, None)
        assert not p.replicas or evaluate(inst, p).goodput < nominal * (1 - 1e-6)
    best = max(expected_goodput(inst, p, method="exact").mean for p in kept)
    out = plan_risk_aware(inst, RunOptions(time_limit=None))
    cap = out.plan.metrics["na_power_cap"]
    assert cap is None if boost == 0 else cap == pytest.approx(1.0)  # 3 TDPs over 3 GPUs
    assert out.bound is not None
    assert best <= out.bound * (1 + 1e-9) + 1e-12
    if boost > 0:  # the bound closes the gap on these eight (not on seed 9 without boost)
        assert out.bound <= best * (1 + 1e-6)
    assert out.stats["expected_objective"] == pytest.approx(best, rel=1e-9, abs=1e-12)
    # the same bound over every plan (no nominal constraint, no cap) is looser
    scen = training_scenarios(inst)
    caps = wait_and_see_bound(inst, scen).scenario_bounds
    free = domain_bound(inst, scen, caps)
    assert free is not None and free.power_cap is None
    assert free.bound >= out.bound * (1 - 1e-9)
