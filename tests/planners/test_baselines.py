"""Baseline planners: valid plans, hand-checked packing, power and pauses."""

from __future__ import annotations

import pytest

from ntp_opt.model import topology
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.planners import heuristics as baselines
from ntp_opt.rules.validate import evaluate
from ntp_opt.solve import Status, solve
from tests.helpers import make_instance, planned

PLANNERS = [baselines.dp_drop, baselines.ntp, baselines.ntp_pw]


def cluster(failed_ids=(), stragglers=(), rack_power_factor=1.0, domains=8):
    g = topology.build_cluster(domains, 8, 4, 2, rack_power_factor=rack_power_factor)
    topology.fail_gpus(g, list(failed_ids))
    for gid, s in stragglers:
        topology.set_speed(g, [gid], s)
    return g


def job(**kw):
    spec = dict(tp=8, tp_min=6, pp=2, dp=4, global_batch=16, batch_policy="elastic")
    spec.update(kw)
    return Job(**spec)


def test_dp_drop_drops_replicas_with_failed_domains():
    # one failure in each of d0, d1, d2: 5 healthy domains hold 2 replicas of PP2
    inst = Instance("x", cluster(["d0.t0.g0", "d1.t0.g0", "d2.t1.g3"]), job())
    plan = planned(baselines.dp_drop, inst)
    ev = evaluate(inst, plan)
    assert ev.n_replicas == 2 and ev.n_reduced == 0
    assert ev.relative_goodput == pytest.approx(2 / 4)
    used = {s.domain for r in plan.replicas for s in r.stages}
    assert not used & {"d0", "d1", "d2"}


def test_ntp_packs_failed_domains_together():
    # failures in d0 and d5: NTP packs both into one TP7 replica... but TP7 is allowed
    inst = Instance("x", cluster(["d0.t0.g0", "d5.t1.g2"]), job())
    plan = planned(baselines.ntp, inst)
    ev = evaluate(inst, plan)
    assert ev.n_replicas == 4 and ev.n_reduced == 1
    reduced = [r for r in plan.replicas if r.tp < 8]
    assert {s.domain for s in reduced[0].stages} == {"d0", "d5"}
    assert reduced[0].tp == 7
    # full replicas take b = 4 at theta = 4 c; the TP7 one floor(4 * 7/8) = 3
    assert ev.relative_goodput == pytest.approx((3 * 4 + 3) / (4 * 1.01) / 4)


def test_ntp_respects_tp_allowed():
    inst = Instance("x", cluster(["d0.t0.g0"]), job(tp_allowed=(6, 8)))
    plan = planned(baselines.ntp, inst)
    assert sorted(r.tp for r in plan.replicas) == [6, 8, 8, 8]


def test_ntp_pw_restores_nominal_speed_with_rack_headroom():
    g = cluster(["d0.t0.g0", "d5.t1.g2"], rack_power_factor=1.3)
    g.graph["power_budget_w"] = 1.05 * 64 * 1000  # a site with 5 % headroom
    inst = Instance("x", g, job())
    plan = planned(baselines.ntp_pw, inst)
    ev = evaluate(inst, plan)
    assert ev.feasible and ev.n_reduced == 1
    reduced = next(r for r in plan.replicas if r.tp < 8)
    expect = (8 / 7) ** (1 / 0.65)  # pi with (7/8) pi^0.65 = 1
    assert all(s.power == pytest.approx(expect) for s in reduced.stages)
    assert ev.relative_goodput == pytest.approx(1 / 1.01)
    assert all(r.local_batch == 4 for r in plan.replicas)


def test_ntp_pw_limited_by_rack_budget():
    # racks at exactly TDP, no spare domain: the TP7 stages in d0 and d5 may draw
    # 7 pi + 0 (the failed GPU) <= 8 kW each -> pi <= 8/7; the site's 2 kW freed by
    # the two failed GPUs allow the same 2 x 7 (pi - 1) <= 2.
    inst = Instance("x", cluster(["d0.t0.g0", "d5.t1.g2"]), job())
    plan = planned(baselines.ntp_pw, inst)
    reduced = next(r for r in plan.replicas if r.tp < 8)
    assert {s.domain for s in reduced.stages} == {"d0", "d5"}
    assert all(s.power == pytest.approx(8 / 7, rel=1e-6) for s in reduced.stages)
    ev = evaluate(inst, plan)
    assert ev.feasible
    assert ev.relative_goodput > evaluate(inst, planned(baselines.ntp, inst)).relative_goodput


def test_stragglers_end_up_as_spares_when_there_are_spares():
    g = cluster(stragglers=[("d3.t0.g1", 0.6)], domains=10)
    inst = Instance("x", g, job())
    for planner in PLANNERS:
        plan = planned(planner, inst)
        assert "d3.t0.g1" not in set(plan.used_gpus())
        assert evaluate(inst, plan).relative_goodput == pytest.approx(1.0)


def test_fixed_policy_pauses_without_capacity():
    inst = Instance("x", cluster(["d0.t0.g0"]), job(batch_policy="fixed"))
    plan = planned(baselines.dp_drop, inst)
    assert plan.replicas == () and plan.metrics["paused"] is True
    assert evaluate(inst, plan).goodput == 0.0
    res = solve(inst, "dp-drop")
    assert res.status is Status.FEASIBLE and res.objective == 0.0
    # NTP keeps four replicas, all at b0 = 4; the TP7 one sets the step time
    ev = evaluate(inst, planned(baselines.ntp, inst))
    assert ev.n_replicas == 4 and ev.total_batch == 16
    assert ev.relative_goodput == pytest.approx(16 / (4 / (7 / 8) * 1.01) / 4)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["fixed", "elastic"])
def test_random_instances_valid_and_ordered(seed, policy):
    inst = make_instance(
        domains=10,
        failed=seed % 6,
        stragglers=seed % 3,
        seed=seed,
        rack_power_factor=1.0 + 0.1 * (seed % 4),
        tp_min=6,
        batch_policy=policy,
    )
    values = {}
    for planner in PLANNERS:
        plan = planned(planner, inst)
        ev = evaluate(inst, plan)
        assert ev.feasible, ev.violations
        assert plan.metrics["goodput"] == pytest.approx(ev.goodput)
        values[planner.__name__] = ev.goodput
    # same replicas, boosted: never slower
    assert values["ntp_pw"] >= values["ntp"] * (1 - 1e-12)


def test_deterministic():
    a = make_instance(failed=4, stragglers=3, seed=9, tp_min=6)
    b = make_instance(failed=4, stragglers=3, seed=9, tp_min=6)
    for planner in PLANNERS:
        assert planner(a) == planner(b)


def test_solve_entry_point():
    inst = make_instance(failed=2, tp_min=6)
    res = solve(inst, "ntp")
    assert res.status is Status.FEASIBLE and res.plan is not None
    assert res.objective == pytest.approx(evaluate(inst, res.plan).goodput)
    assert res.bound is None and res.gap is None
    with pytest.raises(ValueError, match="unknown solver 'magic'; known: dp-drop, ntp, ntp-pw"):
        solve(inst, "magic")
    with pytest.raises(ValueError, match="time_limit"):
        solve(inst, "ntp", time_limit=-1)
