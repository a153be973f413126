"""The ``fast`` planner and the stage bound: validity against brute force and planners."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

from ntp_opt import Instance, Job, evaluate, solve
from ntp_opt.model import topology
from ntp_opt.planners.bounds.capacity import capacity_bound, gpu_bound
from ntp_opt.planners.bounds.stage import stage_bound
from ntp_opt.planners.fast import plan_fast
from ntp_opt.planners.fast_candidates import candidates
from ntp_opt.planners.fast_cuts import speed_aware_slots
from tests.bruteforce import brute_force
from tests.helpers import make_instance
from tests.planners.exact.test_milp import exact_instance
from tests.strategies import instances


@pytest.mark.parametrize("seed", range(40))
def test_stage_bound_is_above_the_brute_force_optimum(seed):
    inst = exact_instance(seed)
    best, _ = brute_force(inst)
    assert stage_bound(inst) >= best * (1 - 1e-9)
    assert capacity_bound(inst) >= best * (1 - 1e-9)


def test_stage_bound_by_hand():
    # 4 domains of 4 GPUs, one failed: 3 full stages and one of degree 3.
    # Case A (no reduced replica): 3 replicas at speed 1 -> 3 / c.
    # Case B: stage values (4 + 4 + 4 + 3) / 4 = 3.75, divided by 1 + rho.
    g = topology.build_cluster(4, 4, 2, 2)
    topology.fail_gpus(g, ["d3.t0.g0"])
    job = Job(
        tp=4,
        tp_min=3,
        pp=1,
        dp=4,
        global_batch=8,
        max_boost=0.0,
        reshard_overhead=0.01,
        batch_policy="elastic",
    )
    inst = Instance("hand", g, job)
    # (rel 1e-8: the bounds allow the validator's 1e-9 power slack)
    assert stage_bound(inst) == pytest.approx(3.75 / 1.01, rel=1e-8)
    # fixed: B = 8 with b <= 2 needs all 4 replicas at b = 2, the slowest is
    # the TP3 one (0.75): theta >= 2 * 1.01 / 0.75, goodput <= 8 * 0.75 / 2.02
    fixed = Instance("hand", g, job.model_copy(update={"batch_policy": "fixed"}))
    assert stage_bound(fixed) == pytest.approx(8 * 0.75 / 2.02, rel=1e-9)
    assert solve(fixed, "fast").objective == pytest.approx(8 * 0.75 / 2.02, rel=1e-9)
    # with rho = 0.3, case A wins: 3 replicas at full speed
    job3 = job.model_copy(update={"reshard_overhead": 0.3})
    assert stage_bound(Instance("hand", g, job3)) == pytest.approx(3.0, rel=1e-8)
    # the per-GPU bound ignores both effects: 15 healthy GPUs / 4
    assert gpu_bound(inst) == pytest.approx(15 / 4, rel=1e-8)


def test_stage_bound_straggler_by_hand():
    # one domain of 4 with a straggler at 0.5, TP 4 or 3, pp=1, no power:
    # best stage is 3 GPUs at speed 1 (0.75) rather than 4 at 0.5 (0.5)
    g = topology.build_cluster(1, 4, 2, 2)
    topology.set_speed(g, ["d0.t0.g0"], 0.5)
    job = Job(tp=4, tp_min=3, pp=1, dp=1, global_batch=2, max_boost=0.0, reshard_overhead=0.0)
    inst = Instance("strag", g, job)
    assert stage_bound(inst) == pytest.approx(0.75, rel=1e-8)
    out = plan_fast(inst)
    plan, bound = out.plan, out.bound
    assert plan.replicas[0].tp == 3 and "d0.t0.g0" not in set(plan.used_gpus())
    # b = 2 at speed 0.75: step 2 / 0.75, goodput 0.75 = the bound, so proven optimal
    assert evaluate(inst, plan).goodput == pytest.approx(0.75, rel=1e-9)
    assert bound == pytest.approx(0.75, rel=1e-9)
    assert solve(inst, "fast").status == "optimal"


@given(instances())
@settings(deadline=None)
def test_fast_beats_the_baselines_and_stays_below_its_bound(inst):
    res = solve(inst, "fast")
    assert res.plan is not None and evaluate(inst, res.plan).feasible
    assert res.bound is not None and res.objective is not None
    assert res.objective <= res.bound * (1 + 1e-9)
    for name in ("dp-drop", "ntp", "ntp-pw"):
        other = solve(inst, name).objective
        assert other is not None and res.objective >= other * (1 - 1e-12), name
        assert other <= res.bound * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(0, 40, 2))
def test_fast_is_below_the_exact_optimum(seed):
    inst = exact_instance(seed)
    best, _ = brute_force(inst)
    res = solve(inst, "fast")
    assert res.objective is not None and res.objective <= best * (1 + 1e-9)
    if res.status == "optimal":
        assert res.objective == pytest.approx(best, rel=1e-6, abs=1e-12)


def test_speed_aware_slots_leave_stragglers_out():
    inst = make_instance(domains=2, size=8, tp=8, tp_allowed=(6, 7, 8), tp_min=6, pp=1, dp=2)
    g = inst.cluster.copy()
    topology.set_speed(g, ["d0.t0.g0"], 0.5)
    inst = Instance("s", g, inst.job)
    slots = speed_aware_slots(inst)
    by_domain = {s.domain: s for s in slots}
    assert by_domain[0].degree == 7  # 7 * 1.0 > 8 * 0.5
    assert inst.arrays.gpu_index["d0.t0.g0"] not in set(by_domain[0].gpus.tolist())
    assert by_domain[1].degree == 8


def test_candidates_are_sorted_and_deterministic():
    inst = make_instance(failed=3, stragglers=2, seed=4, tp_allowed=(6, 7, 8), tp_min=6)
    first = [(c.name, c.goodput) for c in candidates(inst)]
    assert first == [(c.name, c.goodput) for c in candidates(inst)]
    values = [v for _, v in first]
    assert values == sorted(values, reverse=True)
    assert solve(inst, "fast").plan == solve(inst, "fast").plan


def test_fast_on_a_paused_instance():
    # fixed policy that no plan can carry: the fast planner returns the paused plan
    inst = make_instance(failed=20, seed=1, batch_policy="fixed")
    res = solve(inst, "fast")
    assert res.plan is not None
    if not res.plan.replicas:
        assert res.objective == 0.0 and res.reason
    assert math.isfinite(res.bound or 0.0)


def test_tight_site_budget_lowers_a_degree_instead_of_dropping_a_replica():
    # 2 domains of 4 GPUs, TP 4 or 3, pp=1, dp=2, B=8 elastic, no boost; the site
    # budget is 7.1 TDP: 8 GPUs at power 1 do not fit. Dropping a replica leaves
    # 4 used + 4 idle (4.4 TDP): goodput 4 / 4 = 1. Running one replica at TP3
    # instead draws 7 + 0.1 = 7.1 TDP: b = (4, 3), theta = 4 * 1.01, goodput
    # 7 / 4.04 = 1.733, which is also the bound's case B value (4 + 3) / 4 / 1.01.
    g = topology.build_cluster(2, 4, 2, 2)
    g.graph["power_budget_w"] = 7.1 * 1000.0
    job = Job(tp=4, tp_min=3, pp=1, dp=2, global_batch=8, max_boost=0.0, batch_policy="elastic")
    inst = Instance("tight", g, job)
    assert solve(inst, "ntp").objective == pytest.approx(1.0, rel=1e-12)
    res = solve(inst, "fast")
    assert res.objective == pytest.approx(7 / 4.04, rel=1e-12)
    assert sorted(r.tp for r in res.plan.replicas) == [3, 4]
    assert "degree-fit" in res.plan.metrics["candidate"]
