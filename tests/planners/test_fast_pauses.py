"""``fast`` never pauses where a plan exists; ``ntp-pw`` and ``fast`` spend no power
for nothing (issue 32, items 2 and 3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from ntp_opt import Instance, Job, evaluate, solve
from ntp_opt.model import topology
from ntp_opt.model.plan import Plan, Replica, Stage
from tests.helpers import HANG_GUARD
from tests.strategies import small_instances


@given(small_instances(policy="fixed"))
def test_fast_does_not_pause_where_the_optimum_runs(inst):
    best = solve(inst, "optimal", time_limit=HANG_GUARD)
    res = solve(inst, "fast")
    assert res.plan is not None
    if best.plan is not None and best.plan.replicas:
        assert res.plan.replicas, "fast paused a job the exact planner runs"


def test_domains_cut_into_smaller_stages_when_full_slots_are_too_few():
    # 4 domains of 8 GPUs, 2 failed in each: 6 healthy per domain, TP 8 or 3. The
    # paper's cut gives one TP3 slot per domain (4 slots), but B = 8 at most 2 per
    # replica needs 4 replicas of 2 stages: 8 slots, two TP3 stages per domain.
    g = topology.build_cluster(4, 8, 4, 2)
    topology.fail_gpus(g, [f"d{d}.t0.g{j}" for d in range(4) for j in range(2)])
    job = Job(tp=8, tp_min=3, tp_allowed=(3, 8), pp=2, dp=4, global_batch=8, max_boost=0.0)
    inst = Instance("cut", g, job)
    assert not solve(inst, "ntp").plan.replicas  # 4 slots: 2 replicas, too few
    res = solve(inst, "fast")
    # 8 sequences at most 2 each: 4 replicas of 2 TP3 stages, two per domain
    assert len(res.plan.replicas) == 4 and {r.tp for r in res.plan.replicas} == {3}
    # all at speed 3/8 with overhead 1.01: goodput 8 / (2 / (3/8) * 1.01), relative / 4
    assert res.relative_objective == pytest.approx(8 / (2 / 0.375 * 1.01) / 4, rel=1e-9)


def _locked_rack_instance() -> Instance:
    """GB200-like: 4 racks of 72 GPUs (1000 W, boards up to 1200 W), TP16 PP4 DP4, fixed;
    rack d0 has 9 failed GPUs (3 full stages and one of TP15) and boards locked at
    1000 W: the reduced replica's stage there cannot be boosted."""
    g = topology.build("nvl72", 288, tdp_w=1000.0)
    topology.fail_gpus(g, [f"d0.t{k}.g{j}" for k in range(2) for j in range(4)] + ["d0.t2.g0"])
    for n, d in g.nodes(data=True):
        if d["kind"] == "gpu":
            d["max_power_w"] = 1000.0 if str(n).startswith("d0.") else 1200.0
    job = Job(tp=16, pp=4, dp=4, global_batch=64, batch_policy="fixed")
    return Instance("gb200-locked", g, job)


@pytest.mark.parametrize("policy", ["ntp-pw", "fast"])
def test_no_boost_for_nothing(policy):
    inst = _locked_rack_instance()
    res = solve(inst, policy)
    plan = res.plan
    assert plan is not None and plan.replicas
    # the same plan with every stage at power 1: the same goodput, so no more power
    flat = Plan(
        plan.instance,
        tuple(
            Replica(r.tp, r.local_batch, tuple(Stage(s.domain, s.gpus, 1.0) for s in r.stages))
            for r in plan.replicas
        ),
    )
    at_one = evaluate(inst, flat)
    got = evaluate(inst, plan)
    assert got.feasible and at_one.feasible
    assert got.goodput == pytest.approx(at_one.goodput, rel=1e-12)
    assert got.site_power_w <= at_one.site_power_w + 1e-6
    # TP15 replica with a stage in d0 (locked): 15/16 over 1.01, four replicas at b = 16
    assert res.relative_objective == pytest.approx(15 / 16 / 1.01, rel=1e-9)


def test_trim_keeps_goodput_and_lowers_power():
    # a replica boosted beyond what the split uses is lowered back (elastic, room to spare)
    from ntp_opt.planners.packing import (
        boost_slowest_packed,
        domain_slot_table,
        pack,
        split_packing,
        trim_packed,
    )

    inst = _locked_rack_instance()
    packed = pack(inst, domain_slot_table(inst, reduced=True))
    powers = boost_slowest_packed(inst, packed)
    split = split_packing(inst, packed, powers)
    assert split is not None
    trimmed = trim_packed(inst, packed, powers, split)
    assert (trimmed <= powers).all() and np.allclose(trimmed, 1.0)


# ---------------------------------------------------------------------------
# fast's further candidates and local steps (issue 32, item 2): each instance is
# one where the plan before them was worse; the expected goodputs are by hand
# ---------------------------------------------------------------------------


def test_spread_stages_over_racks_to_boost_them_all():
    # 3 domains of 4 GPUs, each its own rack of 4,600 W (1.15 x TDP): TP2, 3 replicas.
    # Two replicas in one rack boost only to 1.15; one per rack, each reaches 1.3
    # (2 x 1,300 W + 2 idle x 100 W = 2,800 W per rack, 8,400 W of the site's 12,000).
    g = topology.build_cluster(3, 4, 2, 2, rack_power_factor=1.15)
    g.graph["power_budget_w"] = 12_000.0
    job = Job(tp=2, pp=1, dp=3, global_batch=9, max_local_batch=3, batch_policy="elastic")
    inst = Instance("spread", g, job)
    res = solve(inst, "fast")
    assert sorted(r.stages[0].domain for r in res.plan.replicas) == ["d0", "d1", "d2"]
    # each replica at 1.3 ** 0.65 / 0.7 sequences/s, b = 3: goodput = 3 v, relative = v c
    assert res.relative_objective == pytest.approx(1.3**0.65, rel=1e-6)


def test_even_stages_in_a_domain():
    # one domain of 16 GPUs, 2 failed: the paper cuts TP8 + TP6; two TP7 stages carry
    # the fixed batch (one sequence each) faster: the slowest replica sets the pace
    g = topology.build_cluster(1, 16, 4, 4)
    topology.fail_gpus(g, ["d0.t0.g0", "d0.t0.g1"])
    job = Job(
        tp=8, tp_min=3, pp=1, dp=2, global_batch=2, max_local_batch=1, max_boost=0.0,
        batch_policy="fixed",
    )  # fmt: skip
    inst = Instance("even", g, job)
    assert solve(inst, "ntp").relative_objective == pytest.approx(6 / 8 / 1.01, rel=1e-9)
    res = solve(inst, "fast")
    assert [r.tp for r in res.plan.replicas] == [7, 7]
    assert res.relative_objective == pytest.approx(7 / 8 / 1.01, rel=1e-9)


def test_level_degrees_to_fit_the_site():
    # 2 domains (racks) of 32 GPUs, one failed: TP16 PP2 replicas of 32 and 30 GPUs, the
    # site feeds 60 GPUs: lowering the largest degree (15 + 15) beats lowering the
    # worst replica's (16 + 14), two sequences of three each
    g = topology.build_cluster(2, 32, 4, 8)
    topology.fail_gpus(g, ["d1.t0.g0"])
    g.graph["power_budget_w"] = 60 * 1000.0
    job = Job(
        tp=16, tp_min=9, pp=2, dp=2, global_batch=6, max_local_batch=3, max_boost=0.0,
        idle_power_fraction=0.0, batch_policy="elastic",
    )  # fmt: skip
    inst = Instance("level", g, job)
    res = solve(inst, "fast")
    assert sorted(r.tp for r in res.plan.replicas) == [15, 15]
    assert res.relative_objective == pytest.approx(15 / 16 / 1.01, rel=1e-9)


def test_cap_the_degree_and_boost_instead():
    # TP16 and TP15 replicas (fixed, one sequence each) fill the site at power 1; the
    # TP16 replica runs no faster than the pace the TP15 one sets. Both at TP15 free
    # 1,000 W, which lifts all 30 GPUs to 31/30 (alpha 1)
    g = topology.build_cluster(2, 16, 4, 4)
    topology.fail_gpus(g, ["d1.t0.g0"])
    g.graph["power_budget_w"] = 31 * 1000.0
    job = Job(
        tp=16, tp_min=14, pp=1, dp=2, global_batch=2, max_local_batch=1, power_exponent=1.0,
        idle_power_fraction=0.0, batch_policy="fixed",
    )  # fmt: skip
    inst = Instance("cap", g, job)
    assert solve(inst, "ntp-pw").relative_objective == pytest.approx(15 / 16 / 1.01, rel=1e-9)
    res = solve(inst, "fast")
    assert [r.tp for r in res.plan.replicas] == [15, 15]
    assert res.relative_objective == pytest.approx(15 / 16 * 31 / 30 / 1.01, rel=1e-6)


def test_drop_a_slow_replica_and_boost_the_others():
    # 3 domains of 8 GPUs, d2 all at speed 0.5; the site feeds the 24 GPUs at power 1
    # (alpha 1, no idle draw). Three replicas of one sequence each go at d2's pace
    # (goodput 3 / 2); without d2, its 8,000 W lift the other 16 GPUs to 1.5: two
    # sequences at speed 1.5 (goodput 3)
    g = topology.build_cluster(3, 8, 4, 2, rack_power_factor=2.0)
    topology.set_speed(g, [f"d2.t{k}.g{j}" for k in range(2) for j in range(4)], 0.5)
    g.graph["power_budget_w"] = 24 * 1000.0
    job = Job(
        tp=8, pp=1, dp=3, global_batch=3, max_local_batch=1, power_exponent=1.0,
        max_boost=1.0, idle_power_fraction=0.0, seq_time_s=1.0, batch_policy="elastic",
    )  # fmt: skip
    inst = Instance("drop", g, job)
    assert solve(inst, "ntp-pw").relative_objective == pytest.approx(1.5 / 3, rel=1e-9)
    res = solve(inst, "fast")
    assert len(res.plan.replicas) == 2
    assert res.relative_objective == pytest.approx(3 / 3, rel=1e-6)


# ---------------------------------------------------------------------------
# no watts for nothing (issue 32, item 3)
# ---------------------------------------------------------------------------


@given(small_instances())
@pytest.mark.parametrize("policy", ["ntp-pw", "fast"])
def test_every_boost_is_needed(policy, inst):
    # lowering any boosted stage by a step of 0.01 % lowers the plan's goodput: no
    # stage is boosted beyond what its replica's batch needs
    res = solve(inst, policy)
    plan = res.plan
    assert plan is not None
    base = evaluate(inst, plan)
    for i, r in enumerate(plan.replicas):
        for k, s in enumerate(r.stages):
            if s.power <= 1.0:
                continue
            stages = list(r.stages)
            stages[k] = Stage(s.domain, s.gpus, max(1.0, s.power * (1 - 1e-4)))
            replicas = list(plan.replicas)
            replicas[i] = Replica(r.tp, r.local_batch, tuple(stages))
            lowered = evaluate(inst, Plan(plan.instance, tuple(replicas)))
            assert lowered.goodput < base.goodput * (1 - 1e-7), (i, k, s.power)


@given(small_instances())
def test_no_replica_of_fast_holds_gpus_for_nothing(inst):
    # a replica of fast's plan at the next lower allowed degree (its stages' fastest
    # GPUs) lowers the goodput, or the plan is no longer valid: fast keeps no GPUs
    # (and their watts) that its batch split does not use
    plan = solve(inst, "fast").plan
    assert plan is not None
    base = evaluate(inst, plan)
    allowed = sorted(inst.job.allowed)
    for i, r in enumerate(plan.replicas):
        lower = [t for t in allowed if t < r.tp]
        if not lower:
            continue
        t = lower[-1]
        stages = tuple(Stage(s.domain, s.gpus[:t], s.power) for s in r.stages)
        replicas = list(plan.replicas)
        replicas[i] = Replica(t, r.local_batch, stages)
        lowered = evaluate(inst, Plan(plan.instance, tuple(replicas)))
        assert not lowered.feasible or lowered.goodput < base.goodput * (1 - 1e-9), (i, r.tp, t)


def test_trim_degrees_by_hand():
    # two domains of 36 GPUs, 6 failed in d1, TP36 (any degree from 18), elastic B = 4,
    # at most 2 per replica: two replicas of 2 sequences. The pace is set by the
    # reduced replica (TP30 in d1); the TP36 one keeps it at TP30 too, on 6 GPUs fewer
    g = topology.build_cluster(2, 36, 4, 9)
    topology.fail_gpus(g, [f"d1.t0.g{j}" for j in range(4)] + ["d1.t1.g0", "d1.t1.g1"])
    job = Job(
        tp=36, tp_min=18, pp=1, dp=2, global_batch=4, max_local_batch=2, max_boost=0.0,
        batch_policy="elastic",
    )  # fmt: skip
    inst = Instance("trim-degrees", g, job)
    res = solve(inst, "fast")
    assert sorted(r.tp for r in res.plan.replicas) == [30, 30]
    assert res.relative_objective == pytest.approx(30 / 36 / 1.01, rel=1e-9)


def test_regroup_replicas_by_rack_before_dropping_one():
    # 6 domains of 4 GPUs, 3 per rack (each rack's budget = its TDP sum, 12 GPUs), d5 at
    # speed 0.5; TP4 PP2, one sequence per replica, alpha 1, no idle draw. Three replicas
    # must boost d5 (r1 holds 4 + 4 + 8 GPU-equivalents: floor 0.75, goodput 2.25). Packed
    # by speed they pair (d0,d1), (d2,d3), (d4,d5): dropping the last leaves three stages
    # in r0 (floor 1.0, goodput 2). Regrouped by rack, (d0,d1) and (d3,d4) leave each rack
    # 8 GPUs: both at 1.5 (the site's 24 GPUs of TDP over 16): goodput 3
    g = topology.build_cluster(6, 4, 4, 3)
    topology.set_speed(g, [f"d5.t0.g{j}" for j in range(4)], 0.5)
    job = Job(
        tp=4, pp=2, dp=3, global_batch=3, max_local_batch=1, power_exponent=1.0,
        max_boost=1.0, idle_power_fraction=0.0, seq_time_s=1.0, batch_policy="elastic",
    )  # fmt: skip
    inst = Instance("by-rack", g, job)
    res = solve(inst, "fast")
    assert sorted(s.domain for r in res.plan.replicas for s in r.stages) == ["d0", "d1", "d3", "d4"]
    assert res.relative_objective == pytest.approx(3.0 / 3, rel=1e-6)


def test_boost_the_replica_of_the_larger_batch_in_its_roomy_rack():
    # two racks of one 8-GPU domain, TP4 PP1, fixed batch 3 (at most 2 per replica),
    # alpha 1, idle 0.5, multipliers up to 1.8. d1 has 4 failed GPUs: its rack has 4 GPUs
    # of room, d0's rack (one stage used, four idle) 2. The floor boost lifts both replicas
    # to 1.5 (d0's rack): batches 2 and 1 at pace 2 / 1.5, goodput 2.25. The replica in d1
    # alone can reach 1.8 (site: 2 + 3.2 of its 6 GPUs of room): pace 2 / 1.8, goodput 2.7
    g = topology.build_cluster(2, 8, 4, 2)
    topology.fail_gpus(g, [f"d1.t0.g{j}" for j in range(4)])
    job = Job(
        tp=4, pp=1, dp=2, global_batch=3, max_local_batch=2, power_exponent=1.0,
        max_boost=0.8, idle_power_fraction=0.5, seq_time_s=1.0, batch_policy="fixed",
    )  # fmt: skip
    inst = Instance("lead", g, job)
    res = solve(inst, "fast")
    assert {r.stages[0].domain: r.local_batch for r in res.plan.replicas} == {"d0": 1, "d1": 2}
    assert res.relative_objective == pytest.approx(2.7 / 2, rel=1e-6)


def test_one_replica_more_than_the_paper_cut_not_as_many_as_may_run():
    # one domain of 72 GPUs, one failed, TP16 PP3 (degrees 10-16), no boost, elastic with
    # up to 3 replicas of 2 sequences. The paper's cut (four TP16 stages) holds one
    # replica (relative 1 / 3); cut for three replicas (seven TP10 stages) it holds two
    # TP10 ones (2 x 10/16 / 1.01 / 3); cut for two, six stages of TP11 (one raised to
    # TP16 with the GPUs left over): two TP11 replicas, 2 x 11/16 / 1.01 / 3
    g = topology.build_cluster(1, 72, 4, 18)
    topology.fail_gpus(g, ["d0.t0.g0"])
    job = Job(
        tp=16, tp_min=10, pp=3, dp=3, global_batch=4, max_local_batch=2, max_boost=0.0,
        batch_policy="elastic",
    )  # fmt: skip
    inst = Instance("count-next", g, job)
    res = solve(inst, "fast")
    assert [(r.tp, r.local_batch) for r in res.plan.replicas] == [(11, 2), (11, 2)]
    assert res.relative_objective == pytest.approx(2 * 11 / 16 / 1.01 / 3, rel=1e-9)


def test_stages_raised_by_the_count_cut_take_the_slowest_gpus():
    # one domain of 36 GPUs, one failed and one at speed 0.5 (the slowest), TP16 PP2
    # (degrees 8-16), fixed batch 2 of one sequence each: two replicas, four stages of
    # TP8 and three GPUs left over, which raise one stage to TP11. Raised with the fastest
    # GPUs, the slow GPU sits in a TP8 stage (relative 0.5 x 8/16 / 1.01); raised with the
    # slowest, the TP11 stage runs at TP8 on its fastest 8 and leaves it out: 8/16 / 1.01
    g = topology.build_cluster(1, 36, 4, 9)
    topology.fail_gpus(g, ["d0.t0.g0"])
    topology.set_speed(g, ["d0.t8.g3"], 0.5)
    job = Job(
        tp=16, tp_min=8, pp=2, dp=2, global_batch=2, max_local_batch=1, max_boost=0.0,
        batch_policy="fixed",
    )  # fmt: skip
    inst = Instance("count-slow", g, job)
    res = solve(inst, "fast")
    used = {gpu for r in res.plan.replicas for s in r.stages for gpu in s.gpus}
    assert "d0.t8.g3" not in used
    assert res.relative_objective == pytest.approx(8 / 16 / 1.01, rel=1e-9)
