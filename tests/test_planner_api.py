"""The one planner interface: registry, Outcome, Instance variants."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

from ntp_opt.model.control import Control
from ntp_opt.model.files import load_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import Limit, Outcome, PlannerSpec, RunOptions, Status
from ntp_opt.planners.registry import REGISTRY
from ntp_opt.solve import PLANNERS, solve

ROOT = Path(__file__).resolve().parent.parent
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
