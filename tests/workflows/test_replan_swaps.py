"""The swap plan of re-planning (issue 30): made from the running layout, the same plan.

:func:`ntp_opt.planners.swaps.improve` reads its slots from the plan's node ids,
one slot at a time, or, given the plan's layout, from its arrays all at once;
a :class:`Replanner` re-boosts and checks the swap plan once instead of twice.
Both must give what the code before them gave: the reference paths are kept
(``improve`` without a layout; the Replanner's legacy switch) and compared here,
event by event, on seeded failure chains where the swap plan is made and kept.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt import Instance, Job, solve
from ntp_opt.model import topology
from ntp_opt.model.files import load_instance
from ntp_opt.model.layout import Layout
from ntp_opt.planners.swaps import improve, improve_layout
from ntp_opt.rules.validate import evaluate
from ntp_opt.workflows.events import apply_events
from ntp_opt.workflows.incremental import recourse_layout
from ntp_opt.workflows.replan import ClusterEvent, Replanner
from tests import swaps_reference
from tests.strategies import instances, valid_plans

INSTANCES = Path(__file__).resolve().parents[2] / "instances"


def nvl32(gpus: int, seed: int) -> Instance:
    """An NVL32 cluster as ``benchmarks/large.py`` builds it (elastic, 0.1 % failed)."""
    g = topology.nvl32(gpus // 32, rack_power_factor=1.3)
    job = Job(
        tp=32,
        tp_allowed=(28, 30, 32),
        pp=8,
        dp=gpus // 256,
        global_batch=gpus // 16,
        batch_policy="elastic",
    )
    topology.fail_random(g, fraction=1e-3, seed=seed)
    topology.add_stragglers(g, count=gpus // 4096, speed=(0.7, 0.95), seed=seed + 1)
    return Instance(f"nvl32-{gpus}", g, job, {"seed": seed}, copy_graph=False)


@given(instances(), st.data())
def test_improve_from_the_layout_equals_improve_from_node_ids(inst, data):
    plan = data.draw(valid_plans(inst))
    if not plan.replicas:
        return
    a = inst.arrays
    up = [g for g, ok in zip(a.gpu_ids, a.healthy, strict=True) if ok]
    gone = data.draw(st.lists(st.sampled_from(up), min_size=1, max_size=3, unique=True))
    new = apply_events(inst, [ClusterEvent("fail", tuple(gone))])
    mask = a.healthy & ~new.arrays.healthy
    local, lay = recourse_layout(new, plan, Layout.from_plan(inst, plan), mask)
    focus = set(data.draw(st.lists(st.integers(0, max(0, len(local.replicas) - 1)), max_size=3)))
    ref = swaps_reference.improve(new, local, focus)
    for got in (improve(new, local, focus), improve(new, local, focus, layout=lay)):
        assert (got is None) == (ref is None)
        if got is not None:
            assert got.replicas == ref.replicas and got.metrics == ref.metrics
    both = improve_layout(new, local, focus, layout=lay)
    assert (both is None) == (ref is None)
    if both is not None:
        assert_same_layout(both[1], Layout.from_plan(new, both[0]))


def assert_same_layout(got: Layout, want: Layout) -> None:
    for name in ("replica", "stage", "domain", "offsets", "gpus", "power", "degree", "batch"):
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert (got.metrics, got.instance) == (want.metrics, want.instance)


@pytest.mark.parametrize("gpus", [2048, 4096])
def test_improve_equals_the_reference_on_large_chains(gpus):
    """Many candidate moves (128 replicas of 8 stages at 4k): the same plan."""
    inst = nvl32(gpus, 5)
    plan = solve(inst, "fast").plan
    assert plan is not None
    rng = np.random.default_rng(gpus)
    a = inst.arrays
    layout = Layout.from_plan(inst, plan)
    made = 0
    for _ in range(4):
        used = np.flatnonzero(np.isin(np.arange(a.n_gpus), layout.gpus) & a.healthy)
        gone = a.gpu_ids[int(rng.choice(used))]
        new = apply_events(inst, [ClusterEvent("fail", gone)])
        mask = inst.arrays.healthy & ~new.arrays.healthy
        local, lay = recourse_layout(new, plan, layout, mask)
        focus = {int(lay.replica[np.flatnonzero(lay.domain == a.gpu_domain[a.gpu_index[gone]])[0]])}
        ref = swaps_reference.improve(new, local, focus)
        got = improve(new, local, focus, layout=lay)
        assert (got is None) == (ref is None)
        if got is not None:
            made += 1
            assert got.replicas == ref.replicas and got.metrics == ref.metrics
            both = improve_layout(new, local, focus, layout=lay)
            assert both is not None and both[0] == got
            assert_same_layout(both[1], Layout.from_plan(new, got))
        inst, plan, layout, a = new, local, lay, new.arrays
    assert made  # the search moved something


SWAPLESS = {"nvl72-576-tp36-0.4pct-elastic", "dgx-1k-0.4pct-fixed"}
"""Chains whose swap plan is never made (improve finds no move): the global path.
dgx-1k fixed joined when the fixed-batch local plan began to be re-boosted after a
degree drop (every event there keeps the local plan against the global one)."""


def chains() -> list[tuple[str, Instance]]:
    out = [("nvl32-2048", nvl32(2048, 1)), ("nvl32-4096", nvl32(4096, 2))]
    for name in ("nvl32-1k-0.4pct-elastic", "dgx-1k-0.4pct-fixed", "nvl72-576-tp36-0.4pct-elastic"):
        out.append((name, load_instance(INSTANCES / f"{name}.json.gz")))
    return out


@pytest.mark.parametrize(("name", "inst"), chains(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_replanner_makes_the_swap_plan_as_before(name, inst):
    plan = solve(inst, "fast").plan
    assert plan is not None
    runners = {legacy: Replanner(inst, plan) for legacy in (True, False)}
    runners[True]._legacy = True
    tried = []
    for seed in (3, 4):
        rng = np.random.default_rng(seed)
        for _ in range(6):
            a = runners[False].instance.arrays
            used = np.zeros(a.n_gpus, dtype=bool)
            used[runners[False].state.layout.gpus] = True
            if not used.any():  # the plan ran out of replicas
                break
            ev = ClusterEvent("fail", a.gpu_ids[int(rng.choice(np.flatnonzero(used)))])
            ref, got = (runners[legacy].replan([ev]) for legacy in (True, False))
            assert got.plan.replicas == ref.plan.replicas
            assert got.plan.metrics == ref.plan.metrics
            assert (got.choice, got.moved, got.goodput, got.bound, got.bound_kind) == (
                ref.choice,
                ref.moved,
                ref.goodput,
                ref.bound,
                ref.bound_kind,
            )
            assert got.details == ref.details
            assert got.state is not None
            lay, full = got.state.layout, Layout.from_plan(got.instance, got.plan)
            for f in ("replica", "stage", "domain", "offsets", "gpus", "power", "degree", "batch"):
                assert np.array_equal(getattr(lay, f), getattr(full, f)), f
            assert evaluate(got.instance, got.plan) == got.state.evaluation
            tried.append("swap" in got.details)
        runners = {legacy: Replanner(inst, plan) for legacy in (True, False)}
        runners[True]._legacy = True
    assert any(tried) != (name in SWAPLESS)  # the path under test ran (or not)
