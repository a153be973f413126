"""Recourse (docs/model.md, spec section 4): hand cases and validator checks on random instances."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_opt.model import topology
from ntp_opt.model.failures import failed_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.planners import heuristics as baselines
from ntp_opt.rules.recourse import adapt, goodput_after
from ntp_opt.rules.validate import check
from tests.helpers import make_instance, planned
from tests.planners.exact.test_milp import exact_instance
from tests.strategies import instances


def _mask(inst: Instance, ids) -> np.ndarray:
    m = np.zeros(inst.arrays.n_gpus, dtype=bool)
    m[[inst.arrays.gpu_index[g] for g in ids]] = True
    return m


def _plan(inst: Instance, stages_per_replica, tp, batches, power=1.0) -> Plan:
    reps = tuple(
        Replica(tp, b, tuple(Stage(d, tuple(gs), power) for d, gs in stages))
        for stages, b in zip(stages_per_replica, batches, strict=True)
    )
    plan = Plan(inst.name, reps)
    return plan.with_metrics(**check(inst, plan).as_metrics())


def _adapt_checked(inst, plan, ids):
    mask = _mask(inst, ids)
    out = adapt(inst, plan, mask)
    ev = check(failed_instance(inst, mask), out)
    assert ev.goodput == pytest.approx(out.metrics["goodput"])
    return out, ev


def test_refill_from_in_domain_spare_keeps_tp_and_goodput():
    # 2 domains of 8 GPUs (trays of 4). Replica r runs on tray 0 of domain r at TP 4;
    # tray 1 of each domain is spare. Each replica: v = 1/c = 1, b = 2 -> theta 2, goodput 2.
    g = topology.build_cluster(2, 8, 4, 2)
    inst = Instance("spare", g, Job(tp=4, tp_min=2, pp=1, dp=2, global_batch=4))
    plan = _plan(
        inst,
        [[("d0", [f"d0.t0.g{k}" for k in range(4)])], [("d1", [f"d1.t0.g{k}" for k in range(4)])]],
        4,
        [2, 2],
    )
    assert plan.metrics["goodput"] == pytest.approx(2.0)
    # d0.t0.g1 fails: the first spare of d0 in graph order (d0.t1.g0) replaces it.
    out, ev = _adapt_checked(inst, plan, ["d0.t0.g1"])
    assert [r.tp for r in out.replicas] == [4, 4]
    assert set(out.replicas[0].stages[0].gpus) == {"d0.t0.g0", "d0.t0.g2", "d0.t0.g3", "d0.t1.g0"}
    assert ev.goodput == pytest.approx(2.0)
    # A failure among the spares changes nothing.
    out, ev = _adapt_checked(inst, plan, ["d1.t1.g2"])
    assert out.replicas == plan.replicas and ev.goodput == pytest.approx(2.0)
    # A slower spare is taken after faster ones (fastest first).
    g2 = g.copy()
    topology.set_speed(g2, ["d0.t1.g0"], 0.5)
    inst2 = Instance("spare", g2, inst.job)
    out, _ = _adapt_checked(inst2, plan, ["d0.t0.g1"])
    assert "d0.t1.g1" in out.replicas[0].stages[0].gpus


def _full(tp_allowed=None, tp_min=2, policy="elastic", mlb=2):
    # 2 domains of 4 GPUs, both used by one TP4 replica each: no spares at all.
    g = topology.build_cluster(2, 4, 2, 2)
    job = Job(
        tp=4,
        tp_min=tp_min,
        tp_allowed=tp_allowed,
        pp=1,
        dp=2,
        global_batch=4,
        batch_policy=policy,
        max_local_batch=mlb,
    )
    inst = Instance("full", g, job)
    plan = _plan(
        inst,
        [
            [("d0", [f"d0.t{k // 2}.g{k % 2}" for k in range(4)])],
            [("d1", [f"d1.t{k // 2}.g{k % 2}" for k in range(4)])],
        ],
        4,
        [2, 2],
    )
    return inst, plan


def test_no_spare_drops_to_largest_allowed_degree():
    # Allowed {2, 3, 4}: replica 0 keeps 3 GPUs at TP 3, v0 = 3/4; v1 = 1; rho = 0.01.
    # Batches (2, 2): theta = 2/0.75 * 1.01, goodput = 4 / theta = 1.5/1.01;
    # (1, 2): theta = 2 * 1.01, goodput 3 / theta = 1.5/1.01 as well (tie -> larger batch).
    inst, plan = _full()
    out, ev = _adapt_checked(inst, plan, ["d0.t0.g0"])
    assert [r.tp for r in out.replicas] == [3, 4]
    assert ev.goodput == pytest.approx(1.5 / 1.01)
    # Allowed {2, 4}: 3 survivors cannot run TP 3, so TP 2 on the two fastest survivors.
    inst, plan = _full(tp_allowed=(2, 4))
    out, _ = _adapt_checked(inst, plan, ["d0.t0.g0"])
    assert [r.tp for r in out.replicas] == [2, 4]
    assert out.replicas[0].stages[0].gpus == ("d0.t0.g1", "d0.t1.g0")


def test_below_tp_min_the_replica_drops_out():
    # tp_min = 4: replica 0 cannot run with 3 GPUs; replica 1 alone takes b = 2 in 2 s:
    # goodput 1.0 (no reduced replica left, so no resharding overhead).
    inst, plan = _full(tp_min=4)
    out, ev = _adapt_checked(inst, plan, ["d0.t0.g0"])
    assert len(out.replicas) == 1 and out.metrics["dropped"] == 1
    assert out.replicas[0].stages[0].domain == "d1"
    assert ev.goodput == pytest.approx(1.0)


def test_fixed_policy_that_cannot_carry_b_pauses():
    # fixed, B = 4, max_local_batch = 2: one replica carries at most 2 -> the job pauses.
    inst, plan = _full(tp_min=4, policy="fixed")
    out, ev = _adapt_checked(inst, plan, ["d0.t0.g0"])
    assert out.replicas == () and out.metrics["paused"] and ev.goodput == 0.0
    # max_local_batch = 4: the survivor carries all of B: theta 4, goodput 1.
    inst, plan = _full(tp_min=4, policy="fixed", mlb=4)
    out, ev = _adapt_checked(inst, plan, ["d0.t0.g0"])
    assert [r.local_batch for r in out.replicas] == [4] and ev.goodput == pytest.approx(1.0)
    assert goodput_after(inst, plan, _mask(inst, ["d0.t0.g0"])) == pytest.approx(1.0)


def test_boosted_stage_over_rack_budget_goes_back_to_power_1():
    # 2 domains of 4 GPUs, one tray (2 GPUs) per rack: d0.t0 -> r0, d0.t1 -> r1,
    # d1.t0 -> r2, d1.t1 -> r3. Budgets: r0, r2 2400 W; r1, r3 1250 W.
    # Replica r runs TP 2 on d{r}.t0 at power 1.2: r0 draws 2 * 1200 = 2400 W, r1 idles
    # at 2 * 100 = 200 W. d0.t0.g0 fails: the refill d0.t1.g0 (rack r1) at 1.2 makes r1
    # draw 1200 + 100 = 1300 W > 1250 W, so replica 0's stage (it has a GPU in r1) goes
    # back to power 1 (r1: 1000 + 100 = 1100 W). Replica 1 keeps its boost.
    g = topology.build_cluster(2, 4, 2, 1)
    for r, w in zip(topology.racks(g), [2400.0, 1250.0, 2400.0, 1250.0], strict=True):
        g.nodes[r]["power_budget_w"] = w
    inst = Instance("pw", g, Job(tp=2, pp=1, dp=2, global_batch=4, max_boost=0.3))
    plan = _plan(
        inst,
        [[("d0", ["d0.t0.g0", "d0.t0.g1"])], [("d1", ["d1.t0.g0", "d1.t0.g1"])]],
        2,
        [2, 2],
        power=1.2,
    )
    out, _ = _adapt_checked(inst, plan, ["d0.t0.g0"])
    assert out.replicas[0].stages[0].gpus == ("d0.t0.g1", "d0.t1.g0")
    assert [s.power for r in out.replicas for s in r.stages] == [1.0, 1.2]
    assert out.metrics["reduced_power"] is True
    # A failure that needs no refill from another rack keeps every boost.
    out, _ = _adapt_checked(inst, plan, ["d0.t1.g0"])
    assert [s.power for r in out.replicas for s in r.stages] == [1.2, 1.2]


@pytest.mark.parametrize("seed", range(24))
def test_recourse_output_passes_validator(seed):
    rng = np.random.default_rng(seed)
    if seed % 2:
        inst = exact_instance(seed)
    else:
        inst = make_instance(
            failed=seed % 5,
            stragglers=seed % 3,
            seed=seed,
            rack_power_factor=float(rng.choice([1.0, 1.2, 1.4])),
            batch_policy=str(rng.choice(["fixed", "elastic"])),
        )
    for planner in (baselines.dp_drop, baselines.ntp, baselines.ntp_pw):
        plan = planned(planner, inst)
        for frac in (0.05, 0.2, 0.5):
            mask = rng.random(inst.arrays.n_gpus) < frac
            out = adapt(inst, plan, mask)
            ev = check(failed_instance(inst, mask), out)
            assert ev.goodput == pytest.approx(out.metrics["goodput"])
            assert out == adapt(inst, plan, mask)  # deterministic


def test_no_failure_keeps_plan_and_goodput():
    inst = make_instance(failed=3, seed=4)
    for planner in (baselines.ntp, baselines.ntp_pw):
        plan = planned(planner, inst)
        out = adapt(inst, plan, None)
        assert [r.stages for r in out.replicas] == [r.stages for r in plan.replicas]
        assert out.metrics["goodput"] == pytest.approx(plan.metrics["goodput"])


@given(instances(), st.sampled_from(["dp-drop", "ntp", "ntp-pw", "fast"]), st.data())
@settings(deadline=None)
def test_recourse_plans_are_feasible_and_below_the_bound(inst, planner, data):
    """Any planner's plan, any set of further failures: the recourse plan
    passes the validator on the failed instance, its goodput is what
    goodput_after reports, and no more than the failed instance's bound."""
    from ntp_opt import solve
    from ntp_opt.planners.bounds import capacity_bound

    plan = solve(inst, planner).plan
    assert plan is not None
    a = inst.arrays
    mask = np.array(
        data.draw(st.lists(st.booleans(), min_size=a.n_gpus, max_size=a.n_gpus)), dtype=bool
    )
    mask &= a.healthy
    after = failed_instance(inst, mask)
    ev = check(after, adapt(inst, plan, mask))
    assert ev.goodput == pytest.approx(goodput_after(inst, plan, mask), rel=1e-12, abs=1e-12)
    assert ev.goodput <= capacity_bound(after) * (1 + 1e-9)


def _three_nvl8(site_w: float | None = None) -> tuple[Instance, Plan]:
    """Three NVL8 domains, one rack each (budget 1.3 x TDP), TP8 PP1 R = 3, B = 24 fixed."""
    g = topology.build_cluster(3, 8, 4, 2, rack_power_factor=1.3)
    if site_w is not None:
        g.graph["power_budget_w"] = site_w
    inst = Instance("boost", g, Job(tp=8, pp=1, dp=3, global_batch=24))
    full = [[(f"d{d}", [f"d{d}.t{t}.g{k}" for t in range(2) for k in range(4)])] for d in range(3)]
    return inst, _plan(inst, full, 8, [8, 8, 8])


def test_boost_spends_the_freed_power_on_the_reduced_replica():
    # d0.t0.g0 fails: d0 runs TP7 (speed 7/8). Without boost: relative (7/8) / 1.01.
    # The site budget is the TDP sum: the failed GPU frees exactly one TDP, so the
    # 7 GPUs of d0 can reach pi = 1 + 1/7 = 8/7 (rack room 10.4 - 7 TDP is larger):
    # speed (7/8) * (8/7)^0.65 = (7/8)^0.35, relative (7/8)^0.35 / 1.01.
    inst, plan = _three_nvl8()
    mask = _mask(inst, ["d0.t0.g0"])
    plain = adapt(inst, plan, mask)
    assert plain == adapt(inst, plan, mask, boost=False)  # the default is unchanged
    assert "boosted" not in plain.metrics
    assert plain.metrics["relative_goodput"] == pytest.approx((7 / 8) / 1.01)
    out = adapt(inst, plan, mask, boost=True)
    ev = check(failed_instance(inst, mask), out)
    assert ev.relative_goodput == pytest.approx((7 / 8) ** 0.35 / 1.01, rel=1e-7)
    assert out.replicas[0].stages[0].power == pytest.approx(8 / 7, rel=1e-7)
    assert [r.stages[0].power for r in out.replicas[1:]] == [1.0, 1.0]
    assert out.metrics["boosted"] == 1


def test_boost_reaches_nominal_speed_with_site_headroom():
    # A site budget of 30 TDP leaves room: pi = (8/7)^(1/0.65) < 1.3 gives TP7 the
    # nominal speed 1; only the resharding overhead remains: relative 1 / 1.01.
    tdp = float(_three_nvl8()[0].arrays.tdp[0])
    inst, plan = _three_nvl8(site_w=30 * tdp)
    mask = _mask(inst, ["d0.t0.g0"])
    out = adapt(inst, plan, mask, boost=True)
    ev = check(failed_instance(inst, mask), out)
    assert ev.relative_goodput == pytest.approx(1 / 1.01, rel=1e-9)
    assert out.replicas[0].stages[0].power == pytest.approx((8 / 7) ** (1 / 0.65), rel=1e-9)
    # No power to give (max_boost = 0): boost changes nothing.
    job = inst.job.model_copy(update={"max_boost": 0.0})
    flat = Instance("flat", inst.cluster, job)
    flat_plan = _plan(
        flat, [[(st.domain, st.gpus) for st in r.stages] for r in plan.replicas], 8, [8, 8, 8]
    )
    assert adapt(flat, flat_plan, mask, boost=True).metrics["boosted"] == 0


@pytest.mark.parametrize("seed", range(12))
def test_boost_output_passes_validator_and_never_hurts(seed):
    rng = np.random.default_rng(100 + seed)
    inst = make_instance(
        failed=seed % 4,
        stragglers=seed % 3,
        seed=seed,
        rack_power_factor=float(rng.choice([1.0, 1.2, 1.4])),
        batch_policy=str(rng.choice(["fixed", "elastic"])),
    )
    for planner in (baselines.ntp, baselines.ntp_pw):
        plan = planned(planner, inst)
        for frac in (0.05, 0.2):
            mask = rng.random(inst.arrays.n_gpus) < frac
            out = adapt(inst, plan, mask, boost=True)
            ev = check(failed_instance(inst, mask), out)
            assert ev.goodput == pytest.approx(out.metrics["goodput"])
            assert ev.goodput >= adapt(inst, plan, mask).metrics["goodput"] * (1 - 1e-9)
