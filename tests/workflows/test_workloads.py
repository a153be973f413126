"""Multi-workload plans: validator mutations, the MILP against an independent
brute force and against static partitions, determinism, input errors."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from ntp_opt import Instance, Job
from ntp_opt.model import topology
from ntp_opt.model.plan import Plan
from ntp_opt.model.workloads import (
    MultiInstance,
    MultiPlan,
    ServingReplica,
    ServingWorkload,
    Workloads,
)
from ntp_opt.planners.multi import solve_multi
from ntp_opt.rules.multi import check_multi, evaluate_multi, validate_multi, with_training_metrics
from ntp_opt.rules.validate import check
from ntp_opt.workflows.multi.static import solve_static
from tests.helpers import HANG_GUARD, make_instance

TL = HANG_GUARD  # every exact run here finishes; the limit only guards against a hang


# --------------------------------------------------------------------------------------
# an independent brute force (equal GPU speeds, no power boost, default power budgets)
# --------------------------------------------------------------------------------------


def _domain_uses(healthy: int, items: list[tuple[str, int]]) -> list[dict[tuple[str, int], int]]:
    """Every multiset of items (kind, size) whose sizes sum to at most ``healthy``."""
    out: list[dict[tuple[str, int], int]] = []

    def rec(k: int, room: int, cur: dict[tuple[str, int], int]) -> None:
        if k == len(items):
            out.append(dict(cur))
            return
        _kind, size = items[k]
        for n in range(room // size + 1):
            if n:
                cur[items[k]] = n
            rec(k + 1, room - n * size, cur)
            cur.pop(items[k], None)

    rec(0, healthy, {})
    return out


def _training_best(job: Job, stages: dict[int, int]) -> list[float]:
    """Relative goodputs of every feasible training plan from these stage counts."""
    values = [0.0]  # the paused job
    degrees = sorted(stages)
    ranges = [range(stages[t] // job.pp + 1) for t in degrees]
    cap = job.local_batch_max
    for counts in itertools.product(*ranges):
        if not 0 < sum(counts) <= job.replicas_max:
            continue
        tps = [t for t, n in zip(degrees, counts, strict=True) for _ in range(n)]
        for batches in itertools.product(range(1, cap + 1), repeat=len(tps)):
            total = sum(batches)
            if job.batch_policy == "fixed" and total != job.global_batch:
                continue
            if total > job.global_batch:
                continue
            theta = max(b * job.seq_time_s * job.tp / t for b, t in zip(batches, tps, strict=True))
            if any(t < job.tp for t in tps):
                theta *= 1 + job.reshard_overhead
            values.append(total / theta * job.seq_time_s / job.dp)
    return values


def brute_force(multi: MultiInstance) -> float:
    """Best weighted goodput over every assignment of stages and replicas to domains."""
    inst = multi.instance
    job = inst.job
    wl = multi.workloads
    a = inst.arrays
    assert len(set(a.speed[a.healthy].tolist())) <= 1 and float(a.speed.max()) == 1.0
    items = [("train", t) for t in job.allowed] + [
        (f.name, t) for f in wl.serving for t in f.degrees
    ]
    reach: set[tuple[int, ...]] = {(0,) * len(items)}
    for h in a.healthy_in_domain().tolist():
        uses = _domain_uses(int(h), items)
        vecs = {tuple(u.get(it, 0) for it in items) for u in uses}
        reach = {tuple(x + y for x, y in zip(r, v, strict=True)) for r in reach for v in vecs}
    best = -math.inf
    cache: dict[tuple[int, ...], list[float]] = {}
    n_train = len(job.allowed)
    for vec in reach:
        key = vec[:n_train]
        if key not in cache:
            cache[key] = _training_best(job, dict(zip(job.allowed, key, strict=True)))
        trains = [v for v in cache[key] if v >= wl.training_min_relative_goodput * (1 - 1e-9)]
        if not trains:
            continue
        value = wl.training_weight * max(trains)
        ok = True
        k = n_train
        for f in wl.serving:
            counts = vec[k : k + len(f.degrees)]
            k += len(f.degrees)
            x = sum(n * f.throughput[t] for n, t in zip(counts, f.degrees, strict=True))
            n = sum(counts)
            if n < f.min_replicas or (f.max_replicas is not None and n > f.max_replicas):
                ok = False
            if x < f.min_fraction * f.demand * (1 - 1e-9):
                ok = False
            value += f.weight * min(1.0, x / f.demand)
        if ok:
            best = max(best, value)
    return best


# --------------------------------------------------------------------------------------
# an independent brute force with GPU speeds, latency targets and memory floors
# --------------------------------------------------------------------------------------


def _domain_groups(
    speeds: list[float], kinds: list[tuple[str, int]]
) -> set[tuple[tuple[str, int, float], ...]]:
    """Every way to cut a domain's healthy GPUs (their speeds) into groups of the given
    kinds (name, size), each group at its slowest GPU: sorted tuples of (name, size, speed)."""
    out: set[tuple[tuple[str, int, float], ...]] = set()

    def rec(free: tuple[int, ...], groups: tuple[tuple[str, int, float], ...]) -> None:
        if not free:
            out.add(tuple(sorted(groups)))
            return
        first, rest = free[0], free[1:]
        rec(rest, groups)  # the first free GPU stays idle
        for name, size in kinds:
            for others in itertools.combinations(rest, size - 1):
                members = (first, *others)
                left = tuple(g for g in rest if g not in others)
                rec(left, (*groups, (name, size, min(speeds[g] for g in members))))

    rec(tuple(range(len(speeds))), ())
    return out


def _training_values(job: Job, stages: tuple[tuple[int, float], ...]) -> list[float]:
    """Relative goodputs of every training plan from these stages ``(degree, speed)``."""
    values = [0.0]
    cap = job.local_batch_max

    def replicas(
        left: tuple[tuple[int, float], ...], reps: tuple[tuple[int, float], ...]
    ) -> list[tuple[tuple[int, float], ...]]:
        if not left:
            return [reps]
        (t, s), rest = left[0], left[1:]
        got = replicas(rest, reps)  # the first stage unused
        same = [k for k, (t2, _) in enumerate(rest) if t2 == t]
        for mates in itertools.combinations(same, job.pp - 1):
            slow = min([s, *(rest[k][1] for k in mates)])
            remain = tuple(st for k, st in enumerate(rest) if k not in mates)
            got += replicas(remain, (*reps, (t, slow)))
        return got

    for reps in set(replicas(stages, ())):
        if not 0 < len(reps) <= job.replicas_max:
            continue
        for batches in itertools.product(range(1, cap + 1), repeat=len(reps)):
            total = sum(batches)
            if total > job.global_batch or (
                job.batch_policy == "fixed" and total != job.global_batch
            ):
                continue
            pairs = zip(batches, reps, strict=True)
            theta = max(b * job.seq_time_s * job.tp / (t * s) for b, (t, s) in pairs)
            if any(t < job.tp for t, _ in reps):
                theta *= 1 + job.reshard_overhead
            values.append(total / theta * job.seq_time_s / job.dp)
    return values


def brute_force_speeds(multi: MultiInstance) -> float:
    """Best weighted goodput over every way to cut every domain into training stages and
    serving replicas (any GPUs, each group at its slowest GPU's speed); a replica counts
    only at a degree of at least ``min_tp`` and within ``max_latency_ms``."""
    inst = multi.instance
    job = inst.job
    wl = multi.workloads
    a = inst.arrays
    kinds = [("~train", t) for t in job.allowed] + sorted(
        {(f.name, t) for f in wl.serving for t in f.degrees if t >= f.min_tp}
    )
    reach: set[tuple[tuple[str, int, float], ...]] = {()}
    for members in a.domain_gpus:
        speeds = [float(a.speed[g]) for g in members if a.healthy[g]]
        options = _domain_groups(speeds, kinds)
        reach = {tuple(sorted(r + o)) for r in reach for o in options}
    best = -math.inf
    cache: dict[tuple[tuple[int, float], ...], float] = {}
    for groups in reach:
        stages = tuple((t, s) for name, t, s in groups if name == "~train")
        if stages not in cache:
            ok = [
                v
                for v in _training_values(job, stages)
                if v >= wl.training_min_relative_goodput * (1 - 1e-9)
            ]
            cache[stages] = max(ok, default=-math.inf)
        value = wl.training_weight * cache[stages]
        for f in wl.serving:
            mine = [
                (t, s)
                for name, t, s in groups
                if name == f.name
                and (f.max_latency_ms is None or f.latency_ms[t] / s <= f.max_latency_ms)
            ]
            x = sum(f.throughput[t] * s for t, s in mine)
            n = len(mine)
            if n < f.min_replicas or (f.max_replicas is not None and n > f.max_replicas):
                value = -math.inf
            if x < f.min_fraction * f.demand * (1 - 1e-9):
                value = -math.inf
            value += f.weight * min(1.0, x / f.demand)
        best = max(best, value)
    return best


# --------------------------------------------------------------------------------------
# instances
# --------------------------------------------------------------------------------------


def tiny(
    failed: list[str],
    serving: tuple[ServingWorkload, ...],
    *,
    domains: int = 3,
    size: int = 4,
    training_weight: float = 1.0,
    training_min: float = 0.0,
    **job: object,
) -> MultiInstance:
    g = topology.build_cluster(domains, size, 2, size // 2)
    topology.fail_gpus(g, failed)
    spec: dict[str, object] = {
        "tp": size,
        "tp_min": size - 1,
        "tp_allowed": (size - 1, size),
        "pp": 1,
        "dp": 2,
        "global_batch": 4,
    }
    spec.update(job)
    inst = Instance("tiny", g, Job(**spec))  # type: ignore[arg-type]
    wl = Workloads(
        training_weight=training_weight,
        training_min_relative_goodput=training_min,
        serving=serving,
    )
    return MultiInstance(inst, wl)


CHAT = ServingWorkload(name="chat", throughput={1: 1.0, 2: 1.8}, demand=5.0, weight=1.0)
AGENT = ServingWorkload(
    name="agent", throughput={2: 3.0, 4: 5.0}, demand=6.0, weight=2.0, min_replicas=1
)

TINY_CASES = [
    dict(failed=["d0.g0"], serving=(CHAT,)),
    dict(failed=["d0.g0", "d1.g3"], serving=(CHAT, AGENT)),
    dict(failed=[], serving=(CHAT, AGENT), batch_policy="elastic", global_batch=5),
    dict(failed=["d2.g1"], serving=(CHAT,), pp=2, dp=1, global_batch=2, training_weight=3.0),
    dict(failed=["d0.g0", "d0.g1"], serving=(AGENT,), training_min=0.5, training_weight=0.1),
    dict(
        failed=["d1.g0"],
        serving=(
            ServingWorkload(name="chat", throughput={1: 1.0, 2: 1.8}, demand=3.0, min_fraction=0.5),
        ),
        batch_policy="elastic",
        global_batch=3,
        dp=3,
        max_local_batch=2,
        training_weight=0.5,
    ),
]


def _gid(name: str) -> str:
    """GPU id of build_cluster: d{i}.t{j}.g{k}; the tests write d{i}.g{n} for brevity."""
    d, g = name.split(".")
    n = int(g[1:])
    return f"{d}.t{n // 2}.g{n % 2}"


def _tiny(case: dict[str, object]) -> MultiInstance:
    spec = dict(case)
    failed = [_gid(x) for x in spec.pop("failed")]  # type: ignore[attr-defined]
    serving = spec.pop("serving")
    return tiny(failed, serving, **spec)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", range(len(TINY_CASES)))
def test_milp_matches_brute_force(case: int) -> None:
    multi = _tiny(TINY_CASES[case])
    res = solve_multi(multi, time_limit=TL)
    assert res.plan is not None and res.objective is not None
    expected = brute_force(multi)
    assert res.objective == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert res.status == "optimal"
    assert res.bound is not None and res.bound >= res.objective - 1e-9
    ev = check_multi(multi, res.plan)
    assert ev.weighted_goodput == pytest.approx(res.objective)


def test_hand_checked_leftover_fills_a_tp2_replica() -> None:
    """A 32-GPU domain with 2 failed: training at TP28 leaves 2 healthy GPUs idle,
    a TP2 serving replica fits there (the issue's example)."""
    g = topology.nvl32(2)
    topology.fail_gpus(g, ["d0.t0.g0", "d0.t0.g1"])
    job = Job(tp=32, tp_allowed=(28, 32), pp=1, dp=2, global_batch=2)
    fleet = ServingWorkload(name="agent", throughput={2: 1.0}, demand=1.0, weight=1.0)
    multi = MultiInstance(Instance("ex", g, job), Workloads(serving=(fleet,)))
    res = solve_multi(multi, time_limit=TL)
    assert res.plan is not None
    # training: TP32 and TP28 with one sequence each; theta = c * 32/28 * 1.01
    rel = (2 / (32 / 28 * 1.01)) / 2
    assert res.objective == pytest.approx(rel + 1.0, rel=1e-9)
    (rep,) = res.plan.serving
    assert rep.domain == "d0" and rep.tp == 2
    # without sharing domains the fleet needs a whole domain: training pauses or loses it
    alone = solve_multi(multi, time_limit=TL, share_domains=False)
    assert alone.objective is not None and alone.objective < res.objective - 0.1


# --------------------------------------------------------------------------------------
# the validator catches every mutation
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def solved() -> tuple[MultiInstance, MultiPlan]:
    multi = _tiny({**TINY_CASES[1], "training_weight": 3.0, "dp": 1})
    res = solve_multi(multi, time_limit=TL)
    assert res.plan is not None
    assert res.plan.training.replicas and len(res.plan.serving) >= 2
    return multi, res.plan


def _rules(multi: MultiInstance, plan: MultiPlan) -> set[str]:
    return {v.rule for v in validate_multi(multi, plan)}


def _serving(plan: MultiPlan, k: int, **change: object) -> MultiPlan:
    reps = list(plan.serving)
    reps[k] = dataclasses.replace(reps[k], **change)  # type: ignore[arg-type]
    return MultiPlan(plan.training, tuple(reps))


def test_valid_plan_has_no_violation(solved: tuple[MultiInstance, MultiPlan]) -> None:
    multi, plan = solved
    assert validate_multi(multi, plan) == []
    check(multi.instance, plan.training)  # the training part alone is a valid plan too


def test_shared_gpu_between_training_and_serving(
    solved: tuple[MultiInstance, MultiPlan],
) -> None:
    multi, plan = solved
    a = multi.instance.arrays
    train_gpu = plan.training.replicas[0].stages[0].gpus[0]
    dom = a.domain_ids[a.gpu_domain[a.gpu_index[train_gpu]]]
    bad = MultiPlan(plan.training, (*plan.serving, ServingReplica("chat", 1, dom, (train_gpu,))))
    assert "gpu-reused" in _rules(multi, bad)


def test_shared_gpu_between_fleets(solved: tuple[MultiInstance, MultiPlan]) -> None:
    multi, plan = solved
    rep = plan.serving[0]
    clone = ServingReplica("chat", 1, rep.domain, rep.gpus[:1])
    assert "gpu-reused" in _rules(multi, MultiPlan(plan.training, (*plan.serving, clone)))


def test_tp_not_allowed_and_size(solved: tuple[MultiInstance, MultiPlan]) -> None:
    multi, plan = solved
    k = next(i for i, r in enumerate(plan.serving) if r.workload == "agent")
    rep = plan.serving[k]
    # agent allows 2 and 4: make it a TP1 replica on one of its GPUs
    assert "serving-tp" in _rules(multi, _serving(plan, k, tp=1, gpus=rep.gpus[:1]))
    assert "serving-size" in _rules(multi, _serving(plan, k, gpus=rep.gpus[:1]))
    assert "serving-workload" in _rules(multi, _serving(plan, k, workload="nope"))


def test_failed_unknown_and_foreign_gpus(solved: tuple[MultiInstance, MultiPlan]) -> None:
    multi, plan = solved
    a = multi.instance.arrays
    failed = next(g for i, g in enumerate(a.gpu_ids) if not a.healthy[i])
    failed_dom = a.domain_ids[a.gpu_domain[a.gpu_index[failed]]]
    extra = ServingReplica("chat", 1, failed_dom, (failed,))
    assert "gpu-failed" in _rules(multi, MultiPlan(plan.training, (*plan.serving, extra)))
    rep = plan.serving[0]
    other = next(d for d in a.domain_ids if d != rep.domain)
    assert "gpu-outside-domain" in _rules(multi, _serving(plan, 0, domain=other))
    ghost = ServingReplica("chat", 1, "d0", ("nope",))
    assert "gpu-unknown" in _rules(multi, MultiPlan(plan.training, (*plan.serving, ghost)))
    nodom = ServingReplica("chat", 1, "d9", plan.serving[0].gpus[:1])
    assert "domain-unknown" in _rules(multi, MultiPlan(plan.training, (nodom,)))


def test_minimum_shares_and_max_replicas(solved: tuple[MultiInstance, MultiPlan]) -> None:
    multi, plan = solved
    no_agent = tuple(r for r in plan.serving if r.workload != "agent")
    assert "min-replicas" in _rules(multi, MultiPlan(plan.training, no_agent))
    strict = MultiInstance(
        multi.instance,
        Workloads(
            training_min_relative_goodput=1.5,
            serving=(
                CHAT.model_copy(update={"min_fraction": 1.0, "max_replicas": 1}),
                AGENT,
            ),
        ),
    )
    rules = _rules(strict, plan)
    assert {"min-fraction", "max-replicas", "training-min"} <= rules


def test_metrics_claim_and_power() -> None:
    multi = _tiny(TINY_CASES[0])
    res = solve_multi(multi, time_limit=TL)
    assert res.plan is not None
    lying = res.plan.with_metrics(weighted_goodput=res.plan.metrics["weighted_goodput"] + 0.5)
    assert "metrics" in _rules(multi, lying)
    # the same plan on a cluster whose racks hold only 60 % of their TDP
    g = topology.build_cluster(3, 4, 2, 2, rack_power_factor=0.6)
    topology.fail_gpus(g, [_gid("d0.g0")])
    weak = MultiInstance(Instance("tiny", g, multi.instance.job), multi.workloads)
    g.graph["power_budget_w"] = 1000.0
    weak = MultiInstance(Instance("tiny", g, multi.instance.job), multi.workloads)
    rules = _rules(weak, res.plan)
    assert "rack-power" in rules and "site-power" in rules
    with pytest.raises(ValueError, match="power budgets"):
        solve_multi(weak, time_limit=TL)


def test_training_rules_still_apply(solved: tuple[MultiInstance, MultiPlan]) -> None:
    multi, plan = solved
    rep = plan.training.replicas[0]
    broken = Plan(plan.training.instance, (dataclasses.replace(rep, local_batch=99),))
    assert "batch-range" in _rules(multi, MultiPlan(broken, plan.serving))


# --------------------------------------------------------------------------------------
# MILP against static partitions, sharing, determinism
# --------------------------------------------------------------------------------------


def _medium(seed: int, failed: int) -> MultiInstance:
    inst = make_instance(
        domains=12,
        size=32,
        tray=4,
        failed=failed,
        seed=seed,
        tp=32,
        tp_allowed=(28, 30, 32),
        pp=2,
        dp=4,
        global_batch=16,
    )
    wl = Workloads(
        serving=(
            ServingWorkload(name="chat", throughput={4: 4.0, 8: 7.0}, demand=50.0, weight=1.0),
            ServingWorkload(
                name="agent",
                throughput={1: 1.0, 2: 1.9},
                demand=30.0,
                weight=2.0,
                min_fraction=0.3,
            ),
        )
    )
    return MultiInstance(inst, wl)


@pytest.mark.parametrize(("seed", "failed"), [(0, 3), (1, 8)])
def test_milp_beats_static_partition(seed: int, failed: int) -> None:
    multi = _medium(seed, failed)
    res = solve_multi(multi, time_limit=TL)
    _plan, ev = solve_static(multi, time_limit=TL)
    assert res.objective is not None and res.plan is not None
    assert res.objective >= ev.weighted_goodput - 1e-9
    assert res.bound is not None and res.bound >= res.objective
    apart = solve_multi(multi, time_limit=TL, share_domains=False)
    assert apart.objective is not None
    assert apart.objective <= res.objective + 1e-9
    assert check_multi(multi, res.plan).feasible


def test_deterministic_with_seed() -> None:
    multi = _medium(2, 5)
    one = solve_multi(multi, time_limit=TL, seed=3)
    two = solve_multi(multi, time_limit=TL, seed=3)
    assert one.plan is not None and two.plan is not None
    assert one.plan.training == two.plan.training
    assert one.plan.serving == two.plan.serving


def test_stragglers_give_a_valid_plan_and_a_real_bound() -> None:
    """With stragglers the bound comes from the optimistic programs: a real bound (never
    a gap of 0 by default), and ``optimal`` only when the plan reaches it."""
    inst = make_instance(domains=4, size=8, tray=4, stragglers=3, tp=8, pp=1, dp=3, global_batch=6)
    multi = MultiInstance(inst, Workloads(serving=(CHAT,)))
    res = solve_multi(multi, time_limit=TL)
    assert res.plan is not None and evaluate_multi(multi, res.plan).feasible
    assert res.bound is not None and res.objective is not None and res.gap is not None
    assert res.bound >= res.objective * (1 - 1e-9)
    # the bound is no looser than the same instance with every healthy GPU at the
    # fastest speed (whose plans are at least as good as every plan here)
    a = inst.arrays
    lifted = MultiInstance(
        inst.with_health(speed=np.where(a.healthy, a.speed[a.healthy].max(), a.speed)),
        multi.workloads,
    )
    top = solve_multi(lifted, time_limit=TL)
    assert top.bound is not None and res.bound <= top.bound * (1 + 1e-9)
    assert (res.status == "optimal") == (res.gap <= 1e-6)
    if res.status != "optimal":
        assert res.reason


def _with_speeds(multi: MultiInstance, speeds: dict[str, float]) -> MultiInstance:
    """``multi`` with these GPUs (tests' short names) slowed to these speeds."""
    a = multi.instance.arrays
    sp = a.speed.copy()
    for name, v in speeds.items():
        sp[a.gpu_index[_gid(name)]] = v
    return MultiInstance(multi.instance.with_health(speed=sp), multi.workloads)


def _random_speed_case(seed: int) -> MultiInstance:
    """A tiny instance with stragglers, fleets with latency targets and memory floors."""
    import random

    rng = random.Random(seed)
    fleets = []
    for k in range(rng.choice((1, 2))):
        degrees = rng.sample((1, 2, 4), 2)
        fleets.append(
            ServingWorkload(
                name=f"f{k}",
                throughput={t: round(rng.uniform(0.5, 1.2) * t, 2) for t in degrees},
                demand=round(rng.uniform(1.0, 8.0), 1),
                weight=rng.choice((0.5, 1.0, 2.0)),
                min_replicas=rng.choice((0, 0, 1)),
                min_fraction=rng.choice((0.0, 0.0, 0.25)),
                max_replicas=rng.choice((None, 3)),
                latency_ms={t: round(rng.uniform(20, 60) / t**0.5, 1) for t in degrees},
                max_latency_ms=rng.choice((None, 30.0, 40.0)),
                min_tp=rng.choice((1, 1, 2)),
            )
        )
    healthy = [f"d{d}.g{n}" for d in range(3) for n in range(4)]
    multi = tiny(
        [_gid(g) for g in rng.sample(healthy, rng.choice((0, 1)))],
        tuple(fleets),
        training_weight=rng.choice((0.5, 1.0, 3.0)),
        batch_policy=rng.choice(("fixed", "elastic")),
        pp=rng.choice((1, 2)),
        dp=2,
        global_batch=rng.choice((2, 3, 4)),
    )
    slow = rng.sample(healthy, rng.choice((1, 2, 3)))
    return _with_speeds(multi, {g: rng.choice((0.7, 0.8, 0.9)) for g in slow})


@pytest.mark.parametrize("seed", range(16))
def test_stragglers_latency_and_memory_against_brute_force(seed: int) -> None:
    """Stragglers, latency targets and memory floors: the bound holds against every way
    to cut the domains (brute force), and a plan labelled optimal reaches it."""
    multi = _random_speed_case(seed)
    expected = brute_force_speeds(multi)
    res = solve_multi(multi, time_limit=TL)
    if expected == -math.inf:
        assert res.status == "infeasible"
        return
    assert res.objective is not None and res.bound is not None
    assert res.objective <= expected + 1e-9
    assert res.bound >= expected * (1 - 1e-9)
    assert res.gap is not None
    if res.status == "optimal":  # up to the rounding of the replicas' shares (1e-6 each)
        assert res.gap <= 1e-4
        assert res.objective == pytest.approx(expected, rel=1e-6, abs=1e-9)
    else:
        assert res.gap > 1e-6 and res.reason and "stragglers" in res.reason


def test_highs_tolerance_regression_keeps_the_optimum() -> None:
    """Found by the brute force: with row coefficients near 1e8 HiGHS ran at its
    tightest integrality tolerance and its presolve returned a wrong optimum (training
    paused, 2.142), and the optimistic bound was as wrong. By hand: TP3 on d0 and on
    d2's three fast GPUs (speed 1): 3 * 2 / (2 * 4/3 * 1.01); f1's TP1 on d2's 0.9 GPU
    (25.8 / 0.9 = 28.7 ms); f0's TP4 on d1 at 0.7 (20.7 / 0.7 = 29.6 ms)."""
    f0 = ServingWorkload(
        name="f0",
        throughput={2: 1.52, 4: 3.54},
        demand=6.9,
        min_fraction=0.25,
        latency_ms={2: 24.6, 4: 20.7},
        max_latency_ms=30.0,
    )
    f1 = ServingWorkload(
        name="f1",
        throughput={1: 1.15, 4: 2.65},
        demand=3.5,
        weight=0.5,
        min_replicas=1,
        max_replicas=3,
        latency_ms={1: 25.8, 4: 22.4},
        max_latency_ms=30.0,
    )
    base = tiny([_gid("d0.g1")], (f0, f1), training_weight=3.0, global_batch=2, max_local_batch=1)
    multi = _with_speeds(base, {"d1.g0": 0.9, "d1.g1": 0.7, "d2.g3": 0.9})
    want = 3 * 2 / (2 * 4 / 3 * 1.01) + 0.5 * 1.15 * 0.9 / 3.5 + 3.54 * 0.7 / 6.9
    assert brute_force_speeds(multi) == pytest.approx(want, rel=1e-12)
    res = solve_multi(multi, time_limit=TL)
    assert res.objective == pytest.approx(want, rel=1e-9)
    assert res.bound is not None and res.bound >= want * (1 - 1e-9)


def test_fleet_served_only_at_high_tp() -> None:
    """TP1 cannot hold the model (min_tp=2) and TP2 misses the latency target: only
    TP4 replicas serve. Training is worth nothing here, so the fleet takes what it can:
    one TP4 per whole domain (d0 lost a GPU), 2 x 3.0 req/s of 9.0 by hand."""
    big = ServingWorkload(
        name="big",
        throughput={1: 1.0, 2: 2.0, 4: 3.0},
        demand=9.0,
        latency_ms={1: 100.0, 2: 60.0, 4: 40.0},
        max_latency_ms=50.0,
        min_tp=2,
    )
    multi = tiny([_gid("d0.g0")], (big,), training_weight=0.0)
    res = solve_multi(multi, time_limit=TL)
    assert res.status == "optimal" and res.plan is not None
    assert res.objective == pytest.approx(2 * 3.0 / 9.0, rel=1e-9)
    assert res.objective == pytest.approx(brute_force_speeds(multi), rel=1e-9)
    assert sorted(r.tp for r in res.plan.serving) == [4, 4]
    # without the floor and the target, TP1 replicas on all 11 GPUs serve everything
    free = ServingWorkload(name="big", throughput={1: 1.0, 2: 2.0, 4: 3.0}, demand=9.0)
    loose = solve_multi(tiny([_gid("d0.g0")], (free,), training_weight=0.0), time_limit=TL)
    assert loose.objective == pytest.approx(1.0)
    # the static partition never forms a replica that cannot count
    plan, ev = solve_static(multi, time_limit=TL)
    assert all(r.tp == 4 for r in plan.serving) and ev.fleets["big"].late == 0


def test_straggler_makes_a_replica_miss_the_latency_target() -> None:
    """d0.g0 at speed 0.8: a TP2 replica holding it takes 50 / 0.8 = 62.5 ms > 55 ms.
    The planner leaves d0.g0 and its partner out and forms the other five TP2
    replicas (5 x 2.0 req/s of 100), and proves it."""
    fleet = ServingWorkload(
        name="agents",
        throughput={2: 2.0},
        demand=100.0,
        latency_ms={2: 50.0},
        max_latency_ms=55.0,
    )
    multi = _with_speeds(tiny([], (fleet,), training_weight=0.0), {"d0.g0": 0.8})
    res = solve_multi(multi, time_limit=TL)
    assert res.status == "optimal" and res.plan is not None
    assert res.objective == pytest.approx(5 * 2.0 / 100.0, rel=1e-9)
    assert len(res.plan.serving) == 5
    assert all(_gid("d0.g0") not in r.gpus for r in res.plan.serving)
    # the validator counts a late replica as serving nothing
    used = {g for r in res.plan.serving for g in r.gpus}
    spare = next(_gid(f"d0.g{n}") for n in range(1, 4) if _gid(f"d0.g{n}") not in used)
    late = ServingReplica("agents", 2, "d0", (_gid("d0.g0"), spare))
    bad = MultiPlan(res.plan.training, (*res.plan.serving, late))
    ev = evaluate_multi(multi, bad)
    assert ev.feasible and ev.fleets["agents"].late == 1
    assert ev.weighted_goodput == pytest.approx(res.objective, rel=1e-12)
    # with a looser target the sixth replica counts at speed 0.8
    ok = _with_speeds(
        tiny([], (fleet.model_copy(update={"max_latency_ms": 70.0}),), training_weight=0.0),
        {"d0.g0": 0.8},
    )
    assert solve_multi(ok, time_limit=TL).objective == pytest.approx((5 * 2.0 + 1.6) / 100.0)
    # the static partition gives the fleet d2 (training's nominal block is d0, d1); with
    # the straggler there its greedy forms the one TP2 replica on fast GPUs, not the late one
    there = _with_speeds(tiny([], (fleet,), training_weight=0.0), {"d2.g0": 0.8})
    plan, st = solve_static(there, time_limit=TL)
    assert [r.domain for r in plan.serving] == ["d2"]
    assert st.fleets["agents"].late == 0 and _gid("d2.g0") not in plan.serving[0].gpus


def test_validator_memory_floor_and_late_replicas() -> None:
    fleet = ServingWorkload(
        name="f",
        throughput={1: 1.0, 2: 2.0},
        demand=10.0,
        min_replicas=1,
        latency_ms={1: 80.0, 2: 40.0},
        max_latency_ms=60.0,
        min_tp=2,
    )
    multi = tiny([], (fleet,), training_weight=0.0)
    empty = Plan(multi.name, ())
    small = MultiPlan(empty, (ServingReplica("f", 1, "d0", (_gid("d0.g0"),)),))
    rules = _rules(multi, small)
    assert "serving-memory" in rules and "min-replicas" in rules
    good = MultiPlan(empty, (ServingReplica("f", 2, "d0", (_gid("d0.g0"), _gid("d0.g1"))),))
    assert validate_multi(multi, good) == []
    # the same replica with a slow GPU misses the target: it no longer counts
    slow = _with_speeds(multi, {"d0.g1": 0.6})
    ev = evaluate_multi(slow, good)
    assert ev.fleets["f"].late == 1 and ev.fleets["f"].served == 0.0
    assert [v.rule for v in ev.violations] == ["min-replicas"]
    assert "latency target" in ev.violations[0].message


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"latency_ms": {"2": 10.0}}, "missing [1]"),
        ({"latency_ms": {"1": 10.0, "2": 5.0, "4": 3.0}}, "not in throughput [4]"),
        ({"latency_ms": {"1": -1.0, "2": 5.0}}, "latency_ms"),
        ({"max_latency_ms": 50.0}, "max_latency_ms"),
        ({"latency_ms": {"1": 10.0, "2": 5.0}, "max_latency_ms": -5.0}, "max_latency_ms"),
        ({"min_tp": 4}, "min_tp"),
        ({"min_tp": 0}, "min_tp"),
        ({"latency_target": 5}, "latency_target"),
    ],
)
def test_bad_latency_and_memory_fields(spec: dict[str, object], needle: str) -> None:
    from ntp_opt.model.files import InputError
    from ntp_opt.model.files.workloads import workloads_from_dict

    fleet = {"name": "f", "throughput": {"1": 1.0, "2": 2.0}, "demand": 1.0, **spec}
    data = {"format": "ntp-opt/workloads@1", "serving": [fleet]}
    with pytest.raises(InputError) as err:
        workloads_from_dict(data, "wl.json")
    text = str(err.value)
    assert "wl.json" in text and needle in text
    assert "\n" not in text.strip()


def test_cli_names_a_bad_latency_field(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from ntp_opt.app.cli import main

    tiny_json = Path(__file__).resolve().parents[2] / "instances" / "tiny.json"
    fleet = {"name": "chat", "throughput": {"4": 3.5}, "demand": 10.0, "min_tp": -2}
    bad = tmp_path / "w.json"
    bad.write_text(json.dumps({"format": "ntp-opt/workloads@1", "serving": [fleet]}))
    assert main(["multi", str(tiny_json), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad}: serving[0].min_tp:" in err and "Traceback" not in err


def test_infeasible_minimum_share() -> None:
    greedy = ServingWorkload(name="big", throughput={4: 1.0}, demand=1.0, min_replicas=4)
    multi = tiny([], (greedy,))
    res = solve_multi(multi, time_limit=TL)
    assert res.status == "infeasible" and res.plan is None


# --------------------------------------------------------------------------------------
# input errors name the field
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (dict(name="training", throughput={1: 1.0}, demand=1.0), "name"),
        (dict(name="x", throughput={}, demand=1.0), "throughput"),
        (dict(name="x", throughput={0: 1.0}, demand=1.0), "throughput"),
        (dict(name="x", throughput={1: -1.0}, demand=1.0), "throughput"),
        (dict(name="x", throughput={1: 1.0}, demand=0.0), "demand"),
        (dict(name="x", throughput={1: 1.0}, demand=1.0, min_fraction=1.5), "min_fraction"),
        (dict(name="x", throughput={1: 1.0}, demand=1.0, min_replicas=3, max_replicas=2), "max"),
        (dict(name="x", throughput={1: 1.0}, demand=1.0, colour="red"), "colour"),
    ],
)
def test_bad_serving_workload(spec: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        ServingWorkload(**spec)  # type: ignore[arg-type]


def test_bad_workload_sets() -> None:
    with pytest.raises(ValidationError, match="unique"):
        Workloads(serving=(CHAT, CHAT))
    with pytest.raises(ValueError, match=r"'wide'.*exceed"):
        tiny([], (ServingWorkload(name="wide", throughput={8: 1.0}, demand=1.0),))
    odd = ServingWorkload(name="odd", throughput={3: 1.0}, demand=1.0)
    multi = tiny([], (CHAT, odd))  # degrees 1, 2, 3: not a divisibility chain
    with pytest.raises(ValueError, match="divisibility chain"):
        solve_multi(multi, time_limit=TL)
    with pytest.raises(ValueError, match="time_limit"):
        solve_multi(tiny([], (CHAT,)), time_limit=0)


def test_cpsat_backend_agrees_on_a_tiny_instance() -> None:
    multi = _tiny(TINY_CASES[1])
    highs = solve_multi(multi, time_limit=TL)
    cpsat = solve_multi(multi, time_limit=TL, backend="cpsat")
    assert cpsat.objective == pytest.approx(highs.objective, rel=1e-6)
    assert cpsat.objective == pytest.approx(brute_force(multi), rel=1e-6)


def test_docs_example_runs() -> None:
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "workloads.md"
    block = re.search(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert block is not None
    scope: dict[str, object] = {}
    exec(compile(block.group(1), "workloads.md", "exec"), scope)
    res, ev = scope["res"], scope["ev"]
    assert res.status == "optimal"  # type: ignore[attr-defined]
    assert res.objective >= ev.weighted_goodput  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(8))
def test_milp_matches_brute_force_random(seed: int) -> None:
    import random

    rng = random.Random(seed)
    fleets = []
    for k in range(rng.choice((1, 2))):
        degrees = rng.sample((1, 2, 4), 2)
        fleets.append(
            ServingWorkload(
                name=f"f{k}",
                throughput={t: round(rng.uniform(0.5, 1.2) * t, 2) for t in degrees},
                demand=round(rng.uniform(1.0, 8.0), 1),
                weight=rng.choice((0.5, 1.0, 2.0)),
                min_replicas=rng.choice((0, 0, 1)),
                min_fraction=rng.choice((0.0, 0.0, 0.25)),
                max_replicas=rng.choice((None, 3)),
            )
        )
    healthy = [f"d{d}.t{j}.g{k}" for d in range(3) for j in range(2) for k in range(2)]
    multi = tiny(
        rng.sample(healthy, rng.choice((0, 1, 2))),
        tuple(fleets),
        training_weight=rng.choice((0.5, 1.0, 3.0)),
        batch_policy=rng.choice(("fixed", "elastic")),
        pp=rng.choice((1, 2)),
        dp=2,
        global_batch=rng.choice((2, 3, 4)),
    )
    res = solve_multi(multi, time_limit=TL)
    expected = brute_force(multi)
    if expected == -math.inf:
        assert res.status == "infeasible"
        return
    assert res.objective == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert res.status == "optimal"


# --------------------------------------------------------------------------------------
# files and the command line
# --------------------------------------------------------------------------------------


def test_files_round_trip_and_cli(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from ntp_opt import save_instance
    from ntp_opt.app.cli import main
    from ntp_opt.model.files import InputError
    from ntp_opt.model.files.workloads import (
        load_multi_plan,
        load_workloads,
        save_multi_plan,
        save_workloads,
    )

    multi = _tiny(TINY_CASES[1])
    save_workloads(multi.workloads, tmp_path / "wl.json")
    assert load_workloads(tmp_path / "wl.json") == multi.workloads
    res = solve_multi(multi, time_limit=TL)
    assert res.plan is not None
    save_multi_plan(with_training_metrics(multi, res.plan), tmp_path / "plan.json")
    back = load_multi_plan(tmp_path / "plan.json")
    assert back.serving == res.plan.serving
    assert back.training.replicas == res.plan.training.replicas
    assert check_multi(multi, back).weighted_goodput == pytest.approx(res.objective)

    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "ntp-opt/workloads@1", "serving": [{"name": "x", "demand": 1}]}')
    with pytest.raises(InputError, match=r"serving\[0\]\.throughput"):
        load_workloads(bad)

    save_instance(multi.instance, tmp_path / "inst.json")
    out = tmp_path / "cli-plan.json"
    code = main(
        [
            "multi",
            str(tmp_path / "inst.json"),
            str(tmp_path / "wl.json"),
            "--static",
            "-o",
            str(out),
        ]
    )
    assert code == 0 and out.exists()
    text = capsys.readouterr().out
    assert "milp" in text and "static" in text and "optimal" in text
    assert main(["multi", str(tmp_path / "inst.json"), str(bad)]) == 2
    assert "throughput" in capsys.readouterr().err


def test_minimum_share_met_exactly_is_feasible() -> None:
    # one TP2 replica serves 1.9 of 3.8 requests/s: exactly min_fraction = 0.5
    fleet = ServingWorkload(
        name="edge", throughput={2: 1.9}, demand=3.8, min_fraction=0.5, max_replicas=1
    )
    multi = tiny([], (fleet,), training_weight=1.0)
    res = solve_multi(multi, time_limit=TL)
    assert res.plan is not None and res.evaluation is not None
    assert res.evaluation.fleets["edge"].served == pytest.approx(0.5)
    assert res.objective == pytest.approx(brute_force(multi), rel=1e-9)


def test_time_limit_never_returns_an_invalid_plan() -> None:
    multi = _medium(3, 6)
    res = solve_multi(multi, time_limit=0.02)
    assert res.status in ("feasible", "optimal", "no_solution")
    if res.plan is not None:
        assert check_multi(multi, res.plan).feasible
    if res.status != "optimal":
        assert res.reason
