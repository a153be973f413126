"""``fast`` never pauses where a plan exists; ``ntp-pw`` and ``fast`` spend no power
for nothing (issue 32, items 2 and 3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from ntp_opt import Instance, Job, evaluate, solve
from ntp_opt.model import topology
from ntp_opt.model.plan import Plan, Replica, Stage

from .helpers import HANG_GUARD
from .strategies import small_instances


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
    from ntp_opt.planners.heuristics import (
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
