"""Re-planning at a fixed batch (issue 30) and re-boosting only what pays (issue 32).

* the incremental bound's ``fixed`` refinement (kept speed bounds re-checked,
  :func:`ntp_opt.planners.bounds.stage.stage_bound_at` with ``fixed``) is
  never below a proven optimum, never above the bound without it, and at
  its own instance within a hair of :func:`stage_bound`;
* the step time it solves directly is the least one that carries the batch;
* a :class:`Replanner` under a fixed batch re-boosts after a degree drop and
  settles on the incremental bound;
* :func:`ntp_opt.workflows.incremental.reboost_layout` leaves a replica the
  split does not wait for at power 1.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt import Instance, Job, check, solve
from ntp_opt.model import topology
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.planners.bounds import fixed
from ntp_opt.planners.bounds.rows import domain_rows, domain_rows_after
from ntp_opt.planners.bounds.stage import (
    FixedSpeeds,
    stage_bound,
    stage_bound_at,
    stage_bound_point,
)
from ntp_opt.workflows.events import apply_events
from ntp_opt.workflows.incremental import reboost_layout
from ntp_opt.workflows.replan import ClusterEvent, Replanner
from tests.helpers import HANG_GUARD
from tests.strategies import small_instances
from tests.workflows import test_replan_incremental


@given(small_instances(policy="fixed"), st.data())
def test_the_kept_fixed_refinement_bounds_the_optimum(inst, data):
    rows = domain_rows(inst)
    fixed: FixedSpeeds = {}
    value, points = stage_bound_point(inst, rows, fixed)
    assert value == stage_bound(inst)
    # at its own instance: the full refinement's value, up to the direct solve's margin
    same = stage_bound_at(inst, points, rows, fixed)
    assert value * (1 - 1e-9) <= same <= value * (1 + 1e-9) + 1e-12
    events = test_replan_incremental._events(data, inst, data.draw(st.integers(1, 3)))
    new = apply_events(inst, events)
    a = inst.arrays
    changed = (a.healthy != new.arrays.healthy) | (a.speed != new.arrays.speed)
    touched = sorted({int(a.gpu_domain[i]) for i in np.flatnonzero(changed)})
    after = domain_rows_after(new, rows, touched)
    out: FixedSpeeds = {}
    bound = stage_bound_at(new, points, after, fixed, out)
    assert bound <= stage_bound_at(new, points, after) * (1 + 1e-12)  # only tightens
    # the speed bounds it used, kept for the next event: re-checked, no looser
    again = stage_bound_at(new, points, after, out)
    assert again <= bound * (1 + 1e-9)
    res = solve(new, "optimal", time_limit=HANG_GUARD)
    if res.status == "optimal":
        assert res.objective <= again * (1 + 1e-9)


def test_the_direct_step_time_is_the_least_that_carries_the_batch():
    rng = np.random.default_rng(3)
    for _ in range(50):
        w = rng.uniform(0.1, 2.0, size=int(rng.integers(1, 12)))
        w[rng.random(len(w)) < 0.2] = 0.0
        b_max = int(rng.integers(1, 6))
        live = int((w > 0).sum())
        if live == 0:
            continue
        big_b = int(rng.integers(1, b_max * live + 1))
        theta = fixed._carry_time(w, b_max, big_b)

        def carried(t: float, w=w, b_max=b_max) -> float:
            return float(np.minimum(b_max, t * w).sum())

        assert carried(theta * (1 + 1e-9)) >= big_b
        assert carried(theta * (1 - 1e-9)) < big_b


def _fixed_cluster() -> Instance:
    """Four domains of 8 GPUs (no spare), two TP8 replicas of 2 stages, a fixed batch of 4, and
    power room to boost a reduced replica."""
    g = topology.build_cluster(4, 8, 4, 2)
    job = Job(
        tp=8,
        tp_min=6,
        tp_allowed=(6, 8),
        pp=2,
        dp=2,
        global_batch=4,
        max_local_batch=2,
        batch_policy="fixed",
    )
    return Instance("fixed-four", g, job)


def test_a_fixed_batch_replan_reboosts_a_reduced_replica_and_settles_incrementally():
    inst = _fixed_cluster()
    plan = solve(inst, "fast").plan
    assert plan is not None and len(plan.replicas) == 2
    runner = Replanner(inst, plan)
    used = sorted(plan.used_gpus())
    out = runner.replan([ClusterEvent("fail", used[0])])
    # the hit replica runs at TP6 (no spare in its domain): the whole job waits for
    # it unless its stages are boosted, and the local plan boosts them
    assert out.choice == "local" and out.bound_kind == "incremental"
    reduced = [rep for rep in out.plan.replicas if rep.tp == 6]
    assert len(reduced) == 1 and all(st.power > 1.0 for st in reduced[0].stages)
    assert check(out.instance, out.plan).goodput == out.goodput
    # TP6 at power 1 would carry its two sequences at 6/8 of the pace; boosted, more
    job = inst.job
    unboosted = job.global_batch / (2 / (job.tp_factor(6) / job.seq_time_s)) / 1.01
    assert out.goodput > unboosted * 1.01
    assert out.goodput <= out.bound * (1 + 1e-9)


def test_reboost_leaves_a_replica_the_split_does_not_wait_for_at_power_one():
    """Two TP1 replicas with one sequence each: the one on a straggler sets the step
    time, so boosting the other gains nothing and it stays at power 1."""
    g = topology.build_cluster(1, 4, 2, 2)
    topology.fail_gpus(g, ["d0.t0.g0"])
    topology.set_speed(g, ["d0.t0.g1"], 0.5)
    g.graph["power_budget_w"] = 3600.0
    job = Job(
        tp=2,
        tp_min=1,
        pp=1,
        dp=3,
        global_batch=3,
        max_local_batch=1,
        batch_policy="elastic",
    )
    inst = Instance("trim", g, job)
    plan = Plan(
        "trim",
        (
            Replica(tp=1, local_batch=1, stages=(Stage("d0", ("d0.t0.g1",), 1.0),)),
            Replica(tp=1, local_batch=1, stages=(Stage("d0", ("d0.t1.g0",), 1.0),)),
        ),
        {},
    )
    got = reboost_layout(inst, plan, Layout.from_plan(inst, plan))
    assert got is not None
    slow, fast = got.plan.replicas
    assert slow.stages[0].power == pytest.approx(1.3)  # the straggler at its cap
    assert fast.stages[0].power == 1.0  # before issue 32: 1.3, for no goodput
    # goodput: two sequences at the straggler's pace, with the resharding overhead
    expected = 2 * job.tp_factor(1) * 0.5 * 1.3**0.65 / 1.01
    assert check(inst, got.plan).goodput == pytest.approx(expected, rel=1e-9)
