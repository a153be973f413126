"""The exact planner against the independent brute force (tests/bruteforce.py),
the baselines, its own bound, time limits and warm starts."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from ntp_opt import Instance, Job, evaluate, load_instance, solve
from ntp_opt.model import topology
from ntp_opt.planners.exact import choice
from ntp_opt.planners.exact.backends import available_backends
from ntp_opt.planners.exact.model import prepare
from tests.bruteforce import brute_force
from tests.helpers import HANG_GUARD, StepClock, stop_at_first_plan

ROOT = Path(__file__).resolve().parents[3]
BACKENDS = [b for b in ("cpsat", "highs") if b in available_backends()]


def exact_instance(seed: int) -> Instance:
    """A random instance within the exact model's scope (docs/model.md):
    every domain's healthy GPUs share one TDP and one rack. Up to 16 GPUs."""
    rng = np.random.default_rng(seed)
    shapes = [(3, 4, 2, 2), (4, 4, 2, 2), (2, 4, 2, 4), (2, 8, 4, 2), (3, 4, 1, 4), (4, 4, 2, 4)]
    nd, size, tray, tpr = shapes[seed % len(shapes)]
    g = topology.build_cluster(
        nd, size, tray, tpr, rack_power_factor=float(rng.choice([1.0, 1.15, 1.4]))
    )
    gpus = topology.gpus(g)
    picks = rng.permutation(len(gpus))
    n_fail, n_slow = int(rng.integers(0, 4)), int(rng.integers(0, 3))
    topology.fail_gpus(g, [gpus[i] for i in picks[:n_fail]])
    for i in picks[n_fail : n_fail + n_slow]:
        topology.set_speed(g, [gpus[i]], float(rng.choice([0.5, 0.8, 0.9])))
    g.graph["power_budget_w"] = float(rng.choice([0.9, 1.0, 1.0, 1.2])) * 1000 * len(gpus)
    tp = size if size == 4 else int(rng.choice([4, 8]))
    dp = int(rng.integers(1, 4))
    batch = int(rng.integers(dp, 3 * dp + 1))
    job = Job(
        tp=tp,
        tp_min=int(rng.choice([tp // 2, tp - 1, tp])),
        pp=int(rng.choice([1, 1, 2])),
        dp=dp,
        dp_max=dp + int(rng.integers(0, 2)),
        global_batch=batch,
        max_local_batch=-(-batch // dp) + int(rng.integers(0, 2)),
        batch_policy=str(rng.choice(["fixed", "elastic"])),
        seq_time_s=float(rng.choice([1.0, 0.7])),
        tp_efficiency={tp - 1: 1.05} if rng.random() < 0.3 else {},
        power_exponent=float(rng.choice([0.65, 0.65, 0.3, 1.0, 0.0])),
        max_boost=float(rng.choice([0.3, 0.3, 0.0, 1.0])),
        idle_power_fraction=float(rng.choice([0.1, 0.0, 0.5])),
        reshard_overhead=float(rng.choice([0.01, 0.0, 0.2])),
    )
    return Instance(f"exact-{seed}", g, job)


@pytest.mark.parametrize("seed", range(40))
def test_cpsat_equals_brute_force(seed):
    inst = exact_instance(seed)
    best, _ = brute_force(inst)
    res = solve(inst, "cpsat", time_limit=HANG_GUARD)
    assert res.status == "optimal"
    assert res.objective == pytest.approx(best, rel=1e-5, abs=1e-9)
    assert res.bound is not None and res.bound >= best * (1 - 1e-9)
    assert evaluate(inst, res.plan).feasible


@pytest.mark.parametrize("seed", range(0, 40, 3))
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cpsat"])
def test_other_backends_equal_brute_force(seed, backend):
    inst = exact_instance(seed)
    best, _ = brute_force(inst)
    res = solve(inst, backend, time_limit=HANG_GUARD)
    assert res.status == "optimal"
    assert res.objective == pytest.approx(best, rel=1e-5, abs=1e-9)


def test_tiny_hand_optimum():
    inst = load_instance(ROOT / "instances" / "tiny.json")
    for solver in ("optimal", *BACKENDS):
        res = solve(inst, solver, time_limit=HANG_GUARD)
        assert res.status == "optimal"
        assert res.objective == pytest.approx(2 * 0.75 * 1.3**0.65 / 1.01, rel=1e-6)
    res = solve(inst, "optimal-nopower", time_limit=HANG_GUARD)
    assert res.objective == pytest.approx(7 / 4.04, rel=1e-9)
    assert all(s.power == 1.0 for r in res.plan.replicas for s in r.stages)


def _mixed_tdp() -> Instance:
    g = topology.build_cluster(2, 4, 2, 2)
    g.nodes["d0.t0.g1"]["tdp_w"] = 700.0
    topology.fail_gpus(g, ["d1.t0.g0"])
    return Instance(
        "mixed",
        g,
        Job(tp=4, tp_min=3, pp=1, dp=2, global_batch=6, batch_policy="elastic", max_boost=1.0),
    )


def test_mixed_tdp_is_chosen_exactly():
    # a domain mixing TDPs: fastest-first may miss the optimum, the exact GPU choice does not
    inst = _mixed_tdp()
    assert prepare(inst).choice and not prepare(inst).inexact
    best, _ = brute_force(inst)
    res = solve(inst, "optimal", time_limit=HANG_GUARD)
    assert res.status == "optimal"
    assert res.objective == pytest.approx(best, rel=1e-6)


def test_out_of_scope_is_not_claimed_optimal(monkeypatch):
    # the exact GPU choice refused (too many split states): fastest-first, no claim
    monkeypatch.setattr(choice, "MAX_STATES", 0)
    inst = _mixed_tdp()
    assert "mixes GPU TDPs" in prepare(inst).inexact
    best, _ = brute_force(inst)
    res = solve(inst, "optimal", time_limit=HANG_GUARD)
    assert res.status == "feasible"
    assert res.objective <= best * (1 + 1e-9)
    assert res.bound is not None and res.bound >= best * (1 - 1e-9)


# the hand-made instances, and library instances that the exact planner proves in under a second
# (the whole library is run by ``ntp-opt bench``: instances/best_known.md)
NEVER_WORSE = [
    "default.json",
    "tiny.json",
    "nvl32-256-healthy-tight-fixed.json.gz",
    "nvl36x2-144-tp72-tray-fixed.json.gz",
    "nvl72-1k-tp72-trays-fixed.json.gz",
    "nvl32-1k-0.1pct-fixed.json.gz",
    "nvl32-4k-trays-fixed.json.gz",
]
#: searches that run for minutes: stopped soon after their first plan (the checks hold for
#: any plan the search returns, and the incumbent only rises)
NEVER_WORSE_STOPPED = [
    "gb200-nvl72-9k-trays.json.gz",
    "paper-nvl32-32k-0.1pct.json.gz",
    "paper-nvl32-32k-0.4pct.json.gz",
]


@pytest.mark.parametrize("name", NEVER_WORSE + NEVER_WORSE_STOPPED)
def test_never_worse_than_baselines(name):
    inst = load_instance(ROOT / "instances" / name)
    if name in NEVER_WORSE_STOPPED:
        res = solve(inst, "optimal", **stop_at_first_plan())
        assert res.limit == "interrupted"
    else:
        res = solve(inst, "optimal", time_limit=HANG_GUARD)
        assert res.limit == "none"
    assert res.evaluation.feasible
    for policy in ("dp-drop", "ntp", "ntp-pw"):
        assert res.objective >= solve(inst, policy).objective * (1 - 1e-12)
    if res.bound is not None:
        assert res.bound >= res.objective * (1 - 1e-9)


def test_time_limit_holds_and_returns_best_plan(monkeypatch):
    base = load_instance(ROOT / "instances" / "default.json")
    # elastic with power boost: a long search
    job = base.job.model_copy(update={"batch_policy": "elastic"})
    inst = Instance(base.name, base.cluster, job, copy_graph=False)
    # the clock advances 0.05 s per reading, so the 1 s limit runs out after 20
    # readings of the search, however fast or loaded the machine (unlimited, the
    # search takes about 12 CPU s)
    clock = StepClock(0.05)
    monkeypatch.setattr(time, "perf_counter", clock)
    res = solve(inst, "optimal", time_limit=1)
    assert res.runtime_s < 1 + 1  # runtime on the step clock: stopped right at the limit
    assert res.limit == "time_limit"
    assert res.evaluation.feasible and res.bound is not None
    assert res.bound >= res.objective
    # the status follows the gap, whichever limit stopped the search
    assert (res.status == "optimal") == (res.bound <= res.objective * (1 + 1e-6))


def test_warm_start_is_kept():
    inst = exact_instance(3)
    warm = solve(inst, "ntp-pw").plan
    res = solve(inst, "optimal", time_limit=HANG_GUARD, initial_plan=warm)
    assert res.objective >= evaluate(inst, warm).goodput * (1 - 1e-12)


def test_deterministic():
    inst = exact_instance(7)
    a = solve(inst, "optimal", time_limit=HANG_GUARD)
    b = solve(inst, "optimal", time_limit=HANG_GUARD)
    assert a.plan == b.plan


def test_too_many_stages_per_domain_uses_column_generation():
    # TP8 on NVL72: nine stages per domain, beyond the configuration cap: the
    # configurations are generated on demand (colgen.py) instead of the case being
    # left out; without boost the search proves the optimum
    g = topology.gb200_nvl72(2)
    topology.fail_random(g, count=3, seed=1)
    job = Job(tp=8, pp=2, dp=8, global_batch=64, batch_policy="elastic", max_boost=0.0)
    inst = Instance("tp8", g, job)
    res = solve(inst, "optimal", time_limit=HANG_GUARD, log=True)
    assert res.evaluation.feasible
    assert "column generation" in res.log and "left out degrees" not in res.log
    assert res.objective >= solve(inst, "ntp-pw").objective * (1 - 1e-12)
    assert res.status == "optimal"


@pytest.mark.parametrize("seed", range(4))
def test_larger_instances_equal_brute_force(seed):
    # 24-32 GPUs, one spare domain pair: the brute force still enumerates them quickly
    # (at 64 GPUs it takes minutes)
    rng = np.random.default_rng(100 + seed)
    nd, size, tray = [(8, 4, 2), (6, 4, 2), (4, 8, 4), (8, 4, 2)][seed]
    g = topology.build_cluster(nd, size, tray, size // tray, rack_power_factor=1.2)
    gpus = topology.gpus(g)
    picks = rng.permutation(len(gpus))
    topology.fail_gpus(g, [gpus[i] for i in picks[:3]])
    topology.set_speed(g, [gpus[i] for i in picks[3:5]], 0.85)
    policy = "fixed" if seed % 2 else "elastic"
    dp = nd // 2 - 1
    job = Job(tp=size, tp_min=size - 1, pp=2, dp=dp, global_batch=2 * dp, batch_policy=policy)
    inst = Instance(f"larger-{seed}", g, job)
    best, _ = brute_force(inst)
    assert best > 0
    res = solve(inst, "cpsat", time_limit=HANG_GUARD)
    assert res.status == "optimal"
    assert res.objective == pytest.approx(best, rel=1e-5, abs=1e-9)
