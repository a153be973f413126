"""Risk-aware planning (issue 4, item 4): expected goodput after recourse.

Expected values here are either computed by hand (argued in comments) or by
exact enumeration with :func:`ntp_opt.rules.expected.expected_goodput`, which the
planner does not use to score its moves in these tests' comparisons against
the risk-blind optimum.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from ntp_opt import solve
from ntp_opt.model import topology
from ntp_opt.model.files import load_plan, save_plan
from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.planners.base import Limit, Outcome, RunOptions
from ntp_opt.planners.riskaware import (
    RISK_INSTANCES,
    fresh_scenarios,
    gpu_risk,
    objective,
    plan_risk_aware,
    risk_instance,
    scenario_goodputs,
    training_scenarios,
)
from ntp_opt.planners.riskaware.scorer import FastScorer
from ntp_opt.rules.expected import expected_goodput
from ntp_opt.rules.recourse import adapt
from ntp_opt.rules.validate import certified, check
from tests.helpers import HANG_GUARD, StepClock
from tests.planners.exact.test_milp import exact_instance

RISKY_SPARE = {"d0", "d2"}  # domains of `spare-domains` whose trays fail with p = 0.05
RISKY_PACK = {"d0", "d2", "d4", "d6"}  # domains of `pack` with one tray at p = 0.1


def _domains(plan):
    return [{st.domain for st in rep.stages} for rep in plan.replicas]


def _exact(inst, plan):
    return expected_goodput(inst, plan, method="exact").relative_mean


def test_spare_domains_leaves_risky_domains_spare():
    inst = risk_instance("spare-domains")
    out = plan_risk_aware(inst, RunOptions(time_limit=HANG_GUARD))
    check(inst, out.plan)
    used = set().union(*_domains(out.plan))
    # Four domains (d1, d3, d4, d5) carry no risk at all and two replicas of two
    # stages need exactly four, so a plan exists that no failure touches: its
    # expected goodput is its nominal relative goodput 1.0, and nothing beats it.
    assert not used & RISKY_SPARE
    assert _exact(inst, out.plan) == pytest.approx(1.0, abs=1e-9)
    blind = _exact(inst, out.blind)
    assert blind <= _exact(inst, out.plan) + 1e-12
    # Premise of the strict claim: the risk-blind optimum uses a risky domain.
    # A tray failure (4 of 8 GPUs, no in-domain spare, tp_min 7) drops that
    # replica, so its expected goodput is strictly below 1.
    assert set().union(*_domains(out.blind)) & RISKY_SPARE, "blind plan avoids risk by chance"
    assert blind < 1.0 - 1e-3


def test_pack_groups_risky_domains_in_few_replicas():
    inst = risk_instance("pack")
    out = plan_risk_aware(
        inst, RunOptions(time_limit=HANG_GUARD), ws_bound=False
    )  # bound: test_waitandsee
    check(inst, out.plan)
    # Every plan uses all 8 domains in 4 replicas of 2. A replica survives
    # unless a risky tray in it fails; a lost replica costs 1/4 (elastic, no
    # reduced degree: 4 survivors < tp_min 7, so it drops and the others keep
    # full TP and their batch of 8). With k risky domains in a replica, it is
    # lost with 1 - 0.9**k. Pairs {2, 2, 0, 0} lose 2 * 0.19 = 0.38 replicas
    # in expectation, {2, 1, 1, 0} lose 0.39 and {1, 1, 1, 1} lose 0.4, so the
    # best expected relative goodput is 1 - 0.38 / 4 = 0.905, the risk-blind
    # spread 1 - 0.4 / 4 = 0.9.
    assert _exact(inst, out.plan) == pytest.approx(0.905, abs=1e-9)
    assert sorted(len(d & RISKY_PACK) for d in _domains(out.plan)) == [0, 0, 2, 2]
    blind = _exact(inst, out.blind)
    assert blind <= 0.905 + 1e-12
    if sorted(len(d & RISKY_PACK) for d in _domains(out.blind)) == [1, 1, 1, 1]:
        assert blind == pytest.approx(0.9, abs=1e-9)


@pytest.mark.parametrize("name", ["mixed", "mixed-fixed"])
def test_mixed_instances_beat_blind_on_fresh_scenarios(name):
    inst = risk_instance(name)
    out = plan_risk_aware(inst, RunOptions(time_limit=HANG_GUARD), fresh_samples=200)
    check(inst, out.plan)
    m = out.plan.metrics
    assert m["saa_method"] == "saa"
    assert m["saa_expected_goodput"] >= m["blind_saa_expected_goodput"]
    # nominal goodput is never traded (nominal_tolerance = 0)
    assert check(inst, out.plan).goodput >= check(inst, out.blind).goodput * (1 - 1e-9)
    # fresh scenarios (seed stream [5, 1], never seen by the planner), paired
    scen = fresh_scenarios(inst, 400, seed=5)
    diff = scenario_goodputs(inst, out.plan, scen) - scenario_goodputs(inst, out.blind, scen)
    assert diff.mean() > 0
    lo, hi = m["expected_ci_low"], m["expected_ci_high"]
    assert lo <= m["expected_goodput"] <= hi and m["expected_samples"] == 200


def _random_risky(seed: int) -> Instance:
    inst = exact_instance(seed)
    g = inst.cluster.copy()
    rng = np.random.default_rng(100 + seed)
    gpus = topology.gpus(g)
    picks = rng.permutation(len(gpus))[:6]
    topology.set_p_fail(g, 0.08, [gpus[i] for i in picks])
    trays = topology.trays(g)
    topology.set_p_fail(g, 0.1, [trays[int(rng.integers(len(trays)))]])
    return Instance(inst.name, g, inst.job)


@pytest.mark.parametrize("seed", range(8))
def test_never_worse_than_blind_exactly(seed):
    inst = _random_risky(seed)
    res = solve(inst, "optimal", time_limit=HANG_GUARD)
    if res.plan is None:
        pytest.skip("infeasible instance")
    out = plan_risk_aware(inst, RunOptions(time_limit=HANG_GUARD), blind=res.plan, ws_bound=False)
    check(inst, out.plan)
    assert out.plan.metrics["saa_method"] == "exact"  # at most 7 units
    assert _exact(inst, out.plan) >= _exact(inst, res.plan) - 1e-12
    assert check(inst, out.plan).goodput >= res.objective * (1 - 1e-9)


def test_same_seed_same_plan_and_seed_matters_for_training_only():
    inst = risk_instance("mixed")
    a = plan_risk_aware(inst, RunOptions(time_limit=HANG_GUARD, seed=3), fresh_samples=50)
    b = plan_risk_aware(inst, RunOptions(time_limit=HANG_GUARD, seed=3), fresh_samples=50)
    assert a.plan.replicas == b.plan.replicas
    assert a.plan.metrics["saa_expected_goodput"] == b.plan.metrics["saa_expected_goodput"]
    s0 = training_scenarios(inst, samples=50, seed=0)
    s1 = training_scenarios(inst, samples=50, seed=1)
    assert s0.method == "saa" and math.isclose(s0.weights.sum(), 1.0)
    assert [g.tolist() for g in s0.gpus] != [g.tolist() for g in s1.gpus]


def test_time_limit_respected(monkeypatch):
    inst = risk_instance("mixed-large")
    # the clock advances 0.05 s per reading, so the 1 s limit runs out after 20
    # readings, however fast or loaded the machine (unlimited, the search runs
    # for minutes)
    clock = StepClock(0.05)
    monkeypatch.setattr(time, "perf_counter", clock)
    res = solve(inst, "risk-aware", time_limit=1)
    assert res.runtime_s < 1 + 1  # runtime on the step clock: stopped right at the limit
    assert res.limit == "time_limit"
    assert res.plan is not None
    check(inst, res.plan)


def test_solve_entry_point_and_plan_file(tmp_path):
    inst = risk_instance("spare-domains")
    res = solve(inst, "risk-aware", time_limit=HANG_GUARD)
    # every scenario's optimum is met: proven optimal for the expected goodput
    # (its wait-and-see bound, tests/planners/riskaware/test_waitandsee.py)
    assert res.status == "optimal" and res.solver == "risk-aware"
    assert res.objective == pytest.approx(check(inst, res.plan).goodput)
    assert res.plan.metrics["expected_method"] == "exact"
    assert res.plan.metrics["policy"] == "risk-aware"
    path = tmp_path / "plan.json"
    save_plan(res.plan, path)
    again = load_plan(path)
    assert again.replicas == res.plan.replicas
    check(inst, again)


def test_gpu_risk_by_hand():
    g = topology.build_cluster(2, 8, 4, 2)
    topology.set_p_fail(g, 0.02, ["d0.t0.g1"])
    topology.set_p_fail(g, 0.05, ["d0.t0"])
    inst = Instance("x", g, risk_instance("spare-domains").job)
    risk = gpu_risk(inst)
    idx = inst.arrays.gpu_index
    assert risk[idx["d0.t0.g1"]] == pytest.approx(1 - 0.98 * 0.95)
    assert risk[idx["d0.t0.g0"]] == pytest.approx(0.05)
    assert risk[idx["d1.t0.g0"]] == 0.0
    tray = gpu_risk(inst, blast_radius="tray")
    assert tray[idx["d0.t0.g0"]] == pytest.approx(1 - 0.98 * 0.95)


def test_recourse_keeps_a_plan_at_its_power_budget():
    # The exact planner's boosted plans may sit ~1e-10 above a rack budget
    # (inside the validator's tolerance); without failures, recourse must not
    # reset their power, or every scenario would lose the boost.
    inst = risk_instance("mixed")
    res = solve(inst, "optimal", time_limit=HANG_GUARD)
    assert any(st.power > 1 for rep in res.plan.replicas for st in rep.stages)
    after = adapt(inst, res.plan, None)
    assert not after.metrics["reduced_power"]
    assert after.metrics["goodput"] == pytest.approx(res.objective, rel=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"nominal_tolerance": -0.1}, "nominal_tolerance"),
        ({"fresh_samples": -1}, "fresh_samples"),
        ({"samples": 0}, "samples"),
        ({"exact_units": 21}, "exact_units"),
        ({"time_limit": 0}, "time_limit"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    options = RunOptions(**{k: v for k, v in kwargs.items() if k == "time_limit"})
    knobs = {k: v for k, v in kwargs.items() if k != "time_limit"}
    with pytest.raises(ValueError, match=field):
        plan_risk_aware(risk_instance("pack"), options, **knobs)


def test_unknown_instance_name():
    with pytest.raises(ValueError, match="name must be one of"):
        risk_instance("nope")
    assert len(RISK_INSTANCES) == 5


@pytest.mark.parametrize("name", ["pack", "mixed", "mixed-fixed"])
def test_fast_scorer_equals_recourse(name):
    # The search scores candidates replica by replica; it must agree with the
    # reference recourse (ntp_opt.rules.recourse.adapt) scenario for scenario.

    inst = risk_instance(name)
    res = solve(inst, "ntp", time_limit=5)
    scen = training_scenarios(inst, samples=150, seed=2)
    fast = FastScorer(inst, scen)
    aware = plan_risk_aware(
        inst, RunOptions(time_limit=HANG_GUARD), fresh_samples=0, ws_bound=False
    )
    for plan in (res.plan, aware.plan):
        layout = Layout.from_plan(inst, plan)
        assert fast.eligible(layout)
        assert fast.value(layout) == pytest.approx(objective(inst, plan, scen), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_fast_scorer_on_random_instances(seed):

    inst = _random_risky(seed)
    for name in ("ntp", "dp-drop"):
        plan = solve(inst, name).plan
        if plan is None:
            continue
        scen = training_scenarios(inst, exact_units=20)
        fast = FastScorer(inst, scen)
        layout = Layout.from_plan(inst, plan)
        if fast.eligible(layout):
            assert fast.value(layout) == pytest.approx(objective(inst, plan, scen), rel=1e-12)


def test_fast_scorer_declines_domains_across_racks():
    g = topology.nvl36x2(2)
    inst = Instance("x", g, risk_instance("mixed").job)

    fast = FastScorer(inst, training_scenarios(inst, samples=5))
    assert not fast.domain_ok


@pytest.mark.parametrize("seed", [1, 4])
def test_nominal_tolerance_bounds_the_nominal_loss(seed):
    inst = _random_risky(seed)
    res = solve(inst, "optimal", time_limit=HANG_GUARD)
    out = plan_risk_aware(
        inst,
        RunOptions(time_limit=HANG_GUARD),
        blind=res.plan,
        nominal_tolerance=0.2,
        ws_bound=False,
    )
    nominal = check(inst, out.plan).goodput
    assert nominal >= 0.8 * res.objective * (1 - 1e-9)
    assert _exact(inst, out.plan) >= _exact(inst, res.plan) - 1e-12


def test_outcome_is_an_outcome_not_yet_checked():
    # the planner contract: a direct call returns the plan unchecked; solve checks it
    inst = risk_instance("pack")
    out = plan_risk_aware(inst, RunOptions(time_limit=HANG_GUARD), ws_bound=False)
    assert isinstance(out, Outcome) and out.limit == Limit.NONE
    assert not out.time_limit_hit and not out.interrupted
    assert out.evaluations == out.stats["evaluations"] > 0
    assert "goodput" not in out.plan.metrics
    checked = certified(inst, out.plan)
    assert checked.metrics["goodput"] == check(inst, out.plan).goodput
    res = solve(inst, "risk-aware", time_limit=HANG_GUARD)
    assert res.plan.replicas == out.plan.replicas
    # solve attaches the same checked figures (and the wait-and-see bound's, which
    # out was asked not to compute)
    assert {k: res.plan.metrics[k] for k in checked.metrics} == checked.metrics
    assert "ws_bound" in res.plan.metrics and "ws_bound" not in out.plan.metrics


def test_search_state_is_a_layout_round_trip():
    # the search works in index space: a plan read into a Layout and written
    # back is the same plan, and the scorer gives the reference objective on it
    inst = risk_instance("mixed")
    plan = solve(inst, "ntp").plan
    layout = Layout.from_plan(inst, plan)
    assert layout.to_plan(inst).replicas == plan.replicas
    scen = training_scenarios(inst, samples=20, seed=4)
    assert FastScorer(inst, scen).value(layout) == pytest.approx(
        objective(inst, plan, scen), rel=1e-12
    )
