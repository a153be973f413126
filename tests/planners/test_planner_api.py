"""The one planner interface: registry, Outcome, Instance variants."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import numpy as np
import pytest

from ntp_opt.model.control import Control
from ntp_opt.model.files import load_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import Limit, Outcome, PlannerKind, PlannerSpec, RunOptions, Status
from ntp_opt.planners.fast import plan_fast
from ntp_opt.planners.heuristics import dp_drop, ntp, ntp_pw
from ntp_opt.planners.megatron import solve_megatron
from ntp_opt.planners.peers import megatron_ntp, megatron_ntp_reordered
from ntp_opt.planners.registry import REGISTRY
from ntp_opt.planners.riskaware import plan_risk_aware
from ntp_opt.rules.validate import certified, check
from ntp_opt.solve import PLANNERS, solve

ROOT = Path(__file__).resolve().parents[2]
solve_mod = importlib.import_module("ntp_opt.solve")  # the package exports solve()


def _tiny() -> Instance:
    return load_instance(ROOT / "instances" / "tiny.json")


def test_registry_lists_every_planner() -> None:
    assert tuple(REGISTRY) == PLANNERS
    assert {n for n, p in REGISTRY.items() if p.instance_bound} == solve_mod.INSTANCE_BOUNDS
    assert solve_mod.EXACT["optimal-nopower"] == ("cpsat", False)
    assert solve_mod.EXACT["highs"] == ("highs", True)


def test_heuristic_outcome_is_checked_once_by_solve() -> None:
    inst = _tiny()
    out = REGISTRY["ntp"].run(inst, RunOptions(control=Control("ntp", None, None)))
    assert out.plan is not None and "goodput" not in out.plan.metrics  # unchecked
    res = solve(inst, "ntp")
    assert res.plan is not None and res.plan.metrics["goodput"] == res.objective


@pytest.mark.parametrize(
    "planner",
    [dp_drop, ntp, ntp_pw, megatron_ntp, megatron_ntp_reordered, plan_fast, solve_megatron],
)
def test_every_planner_is_called_alike_and_returns_its_plan_unchecked(planner) -> None:
    # the contract: planner(instance, options=RunOptions()) -> Outcome, no validate flag
    inst = _tiny()
    params = inspect.signature(planner).parameters
    assert list(params)[:2] == ["instance", "options"] and "validate" not in params
    assert isinstance(params["options"].default, RunOptions)
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[2:])
    out = planner(inst)
    assert isinstance(out, Outcome) and out.plan is not None
    plan = out.plan
    if planner is not solve_megatron:  # the exact search attaches its own figures
        assert "goodput" not in plan.metrics
    assert certified(inst, plan).metrics["goodput"] == check(inst, plan).goodput


def test_plan_risk_aware_follows_the_contract() -> None:
    params = inspect.signature(plan_risk_aware).parameters
    assert list(params)[:2] == ["instance", "options"] and "validate" not in params
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[2:])


def test_plan_fast_bound_knob() -> None:
    inst = _tiny()
    with_bound, without = plan_fast(inst), plan_fast(inst, RunOptions(), bound=False)
    assert with_bound.bound is not None and with_bound.plan.metrics["bound"] == with_bound.bound
    assert without.bound is None and "bound" not in without.plan.metrics
    assert without.plan.replicas == with_bound.plan.replicas


def test_planner_kind_is_an_enum() -> None:
    assert {p.kind for p in REGISTRY.values()} == set(PlannerKind)
    assert PlannerSpec(_no_plan, "test", kind="bounded").kind is PlannerKind.BOUNDED
    with pytest.raises(ValueError):
        PlannerSpec(_no_plan, "test", kind="clever")
    assert solve_mod.BOUNDED == ("fast",) and solve_mod.SEARCHES == ("risk-aware",)


def _no_plan(instance: Instance, options: RunOptions) -> Outcome:
    return Outcome(plan=None, limit=Limit.TIME)


def _proven_none(instance: Instance, options: RunOptions) -> Outcome:
    return Outcome(plan=None, proven=True)


@pytest.mark.parametrize(
    ("planner", "status"), [(_no_plan, Status.NO_SOLUTION), (_proven_none, Status.INFEASIBLE)]
)
def test_no_plan_is_no_solution_unless_proven(
    monkeypatch: pytest.MonkeyPatch, planner: object, status: Status
) -> None:
    monkeypatch.setitem(REGISTRY, "none", PlannerSpec(planner, "test"))  # type: ignore[arg-type]
    res = solve(_tiny(), "none")
    assert res.status == status and res.plan is None and res.objective is None


@pytest.mark.parametrize(
    ("kind", "slack", "status"),
    [
        ("exact", 0.0, Status.OPTIMAL),
        ("exact", 1e-7, Status.OPTIMAL),  # within the 1e-6 gap tolerance
        ("exact", 1e-3, Status.FEASIBLE),
        ("bounded", 0.0, Status.OPTIMAL),
        ("heuristic", 0.0, Status.FEASIBLE),  # a heuristic's bound is not reported as a proof
    ],
)
def test_status_follows_the_gap_whichever_limit_stopped(
    monkeypatch: pytest.MonkeyPatch, kind: str, slack: float, status: Status
) -> None:
    inst = _tiny()
    plan = REGISTRY["ntp"].run(inst, RunOptions()).plan
    assert plan is not None
    goodput = solve(inst, "ntp").objective
    assert goodput is not None and goodput > 0

    def stopped(instance: Instance, options: RunOptions) -> Outcome:
        return Outcome(plan=plan, bound=goodput * (1 + slack), limit=Limit.TIME)

    monkeypatch.setitem(REGISTRY, "stopped", PlannerSpec(stopped, "test", kind=kind))
    res = solve(inst, "stopped")
    assert res.status == status and res.limit == Limit.TIME


def test_bound_zero_met_by_the_paused_plan_is_optimal(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = _tiny()
    paused = Plan(inst.name, ())

    def nothing_fits(instance: Instance, options: RunOptions) -> Outcome:
        return Outcome(plan=paused, bound=0.0, limit=Limit.TIME)

    monkeypatch.setitem(REGISTRY, "paused", PlannerSpec(nothing_fits, "test", kind="exact"))
    res = solve(inst, "paused")
    assert res.objective == 0.0 and res.status == Status.OPTIMAL


def test_with_job_shares_the_compiled_cluster() -> None:
    inst = _tiny()
    other = inst.with_job(inst.job.model_copy(update={"max_boost": 0.0}))
    assert other.arrays is inst.arrays and other.job.max_boost == 0.0
    assert other.cluster is inst.cluster


def test_with_health_round_trip() -> None:
    inst = _tiny()
    a = inst.arrays
    healthy = a.healthy.copy()
    i = int(np.flatnonzero(healthy)[0])
    healthy[i] = False
    failed = inst.with_health(healthy)
    assert not failed.arrays.healthy[i] and failed.cluster.nodes[a.gpu_ids[i]]["state"] == "failed"
    assert inst.arrays.healthy[i]  # the original is unchanged
    assert failed != inst
    rebuilt = Instance(failed.name, failed.cluster, failed.job, failed.meta)
    assert np.array_equal(rebuilt.arrays.healthy, failed.arrays.healthy)
    back = failed.with_health(a.healthy)
    assert back == inst
    with pytest.raises(ValueError, match="one entry per GPU"):
        inst.with_health(healthy[:-1])
