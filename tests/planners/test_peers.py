"""Peer baselines: Megatron-LM's nonuniform TP against hand-worked cases, and the
Malleus-style batch ILP and our exact split against enumeration.

Goodput values are written as the model's formulas (docs/model.md, spec section 3),
worked out by hand in the comments, never taken from the code under test:

    v_r = t_r / T * (slowest GPU) / c,   theta = max_r b_r / v_r * (1 + rho [some t_r < T]),
    goodput = sum_r b_r / theta,         relative = goodput * c / R.

Every cluster below is ``build_cluster(n, size, 4, ...)``: domain ``d{i}`` has
trays ``d{i}.t{j}`` of 4 GPUs ``d{i}.t{j}.g{k}``, so local rank ``4 j + k`` of
a TP group is GPU ``t{j}.g{k}`` (graph order). c = 1, rho = 0.01.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest

from ntp_opt.model import topology
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.planners import peers
from ntp_opt.rules.validate import evaluate
from ntp_opt.solve import HEURISTICS, solve
from tests.helpers import HANG_GUARD, planned

RHO = 0.01


def cluster(failed=(), stragglers=(), domains=4, size=8, rack_power_factor=1.0):
    g = topology.build_cluster(domains, size, 4, size // 4, rack_power_factor=rack_power_factor)
    topology.fail_gpus(g, list(failed))
    for gid, s in stragglers:
        topology.set_speed(g, [gid], s)
    return g


def job(**kw: Any) -> Job:
    spec: dict[str, Any] = dict(tp=8, tp_min=6, pp=1, dp=4, global_batch=16, batch_policy="fixed")
    spec.update(kw)
    return Job(**spec)


def rel(instance, plan):
    ev = evaluate(instance, plan)
    assert ev.feasible, ev.violations
    return ev.relative_goodput


def ranks(replica, stage=0):
    """Local ranks (0..7 in a domain of 8) of a stage's GPUs."""
    out = []
    for gid in replica.stages[stage].gpus:
        _, t, g = str(gid).split(".")
        out.append(4 * int(t[1:]) + int(g[1:]))
    return out


# --- Megatron's parity rule, as its docstring and unit tests state it ----------------------


def test_tp_spares_with_parity_megatron_examples():
    # compute_uniform_tp_spares_with_parity({0: [2, 5], 1: [1]}, 8) == (2, {0: [2, 5], 1: [1, 7]})
    assert peers.tp_spares_with_parity({0: [2, 5], 1: [1]}, 8) == (2, {0: [2, 5], 1: [1, 7]})
    assert peers.tp_spares_with_parity({0: [2, 5], 1: [1, 3]}, 8) == (2, {0: [2, 5], 1: [1, 3]})
    assert peers.tp_spares_with_parity({}, 8) == (0, {})
    # spares raised to 3 (reduced degree rounded down): pad the two highest healthy ranks
    assert peers.tp_spares_with_parity({0: [7]}, 8, spares=3) == (3, {0: [5, 6, 7]})
    with pytest.raises(ValueError):
        peers.tp_spares_with_parity({0: [1, 2]}, 8, spares=1)
    with pytest.raises(ValueError):
        peers.tp_spares_with_parity({0: [8]}, 8)


# --- megatron-ntp, hand-worked --------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fixed", "elastic"])
def test_issue_example_both_replicas_at_tp6(policy):
    # PP1, replica r = domain d{r}. Replica 0 lost local ranks 2 and 5, replica 1 rank 1.
    # tp_spares = max(2, 1) = 2: both run at TP6; replica 1 pads out its highest healthy
    # rank 7. Replicas 2, 3 stay at TP8. Same local batch b = 16 / 4 = 4 everywhere:
    # theta = 4 / (6/8) * 1.01 = 5.38667, goodput = 16 / theta = 2.97030,
    # relative = 2.97030 / 4 = 0.742574.
    inst = Instance("x", cluster(["d0.t0.g2", "d0.t1.g1", "d1.t0.g1"]), job(batch_policy=policy))
    plan = planned(peers.megatron_ntp, inst)
    assert [r.tp for r in plan.replicas] == [6, 6, 8, 8]
    assert ranks(plan.replicas[0]) == [0, 1, 3, 4, 6, 7]
    assert ranks(plan.replicas[1]) == [0, 2, 3, 4, 5, 6]
    assert [s.domain for r in plan.replicas for s in r.stages] == ["d0", "d1", "d2", "d3"]
    assert all(r.local_batch == 4 for r in plan.replicas)
    assert all(s.power == 1.0 for r in plan.replicas for s in r.stages)
    theta = 4 / (6 / 8) * (1 + RHO)
    assert rel(inst, plan) == pytest.approx(16 / theta / 4)
    assert plan.metrics["tp_spares"] == 2 and plan.metrics["dropped_replicas"] == 0


def test_reduced_degree_rounds_down_to_allowed():
    # one failure: 8 - 1 = 7 is not in tp_allowed = (6, 8), so Megatron's tp_spares is
    # raised to 2: TP6 on local ranks 0..5 after dropping rank 0 and padding rank 7.
    # theta = 4 / (6/8) * 1.01, relative = 16 / theta / 4 = 0.742574
    inst = Instance("x", cluster(["d2.t0.g0"]), job(tp_allowed=(6, 8)))
    plan = planned(peers.megatron_ntp, inst)
    assert [r.tp for r in plan.replicas] == [8, 8, 6, 8]
    assert ranks(plan.replicas[2]) == [1, 2, 3, 4, 5, 6]
    assert rel(inst, plan) == pytest.approx(16 / (4 / 0.75 * (1 + RHO)) / 4)


def test_pp2_megatron_rank_order_and_drop():
    # PP2, DP4 on 8 domains. Megatron's default order tp-dp-pp: TP group g = k * 4 + r, so
    # replica r holds d{r} (stage 0) and d{4+r} (stage 1). d5 lost 1 GPU -> replica 1;
    # d2 lost 3 GPUs -> replica 2 would need TP5 < tp_min 6: it is dropped. The common
    # degree of the remaining affected replicas is 8 - 1 = 7.
    # elastic: 3 replicas of b = 4, theta = 4 / (7/8) * 1.01 = 4.61714,
    # goodput = 12 / theta = 2.59901, relative = 0.649752.
    failed = ["d5.t0.g0", "d2.t0.g0", "d2.t0.g1", "d2.t1.g0"]
    inst = Instance("x", cluster(failed, domains=8), job(pp=2, batch_policy="elastic"))
    plan = planned(peers.megatron_ntp, inst)
    assert [[s.domain for s in r.stages] for r in plan.replicas] == [
        ["d0", "d4"],
        ["d1", "d5"],
        ["d3", "d7"],
    ]
    assert [r.tp for r in plan.replicas] == [8, 7, 8]
    # the healthy stage of the reduced replica pads out its highest rank too
    assert ranks(plan.replicas[1], 0) == [0, 1, 2, 3, 4, 5, 6]
    assert ranks(plan.replicas[1], 1) == [1, 2, 3, 4, 5, 6, 7]
    assert rel(inst, plan) == pytest.approx(12 / (4 / (7 / 8) * (1 + RHO)) / 4)
    assert plan.metrics["dropped_replicas"] == 1
    # the other rank order puts replica r on d{2r}, d{2r+1}: d2 is replica 1's, d5 replica 2's
    other = peers.megatron_plan(inst, rank_order="tp-pp-dp")
    assert [[s.domain for s in r.stages] for r in other.replicas] == [
        ["d0", "d1"],
        ["d4", "d5"],
        ["d6", "d7"],
    ]
    assert rel(inst, other) == pytest.approx(rel(inst, plan))
    # fixed policy: 3 x 4 = 12 != B = 16 and the runtime does not rebalance -> paused
    fixed = Instance("x", inst.cluster, job(pp=2, batch_policy="fixed"))
    paused = planned(peers.megatron_ntp, fixed)
    assert paused.replicas == () and paused.metrics["paused"] is True
    assert evaluate(fixed, paused).goodput == 0.0


def test_reordered_packs_failed_domains_into_one_replica():
    # d0 lost 2 GPUs, d5 lost 1. As launched (tp-dp-pp) d0 is replica 0's stage 0 and d5
    # replica 1's stage 1: two replicas at the common TP6. The re-ordering launcher sorts
    # domains by failures (d0, d5, then the healthy ones in graph order): replica 0 =
    # (d0, d5) at TP6, the other three at TP8. Same local batch, so the step time is set
    # by a TP6 replica either way: theta = 4 / 0.75 * 1.01, relative = 16 / theta / 4.
    failed = ["d0.t0.g0", "d0.t1.g3", "d5.t1.g0"]
    inst = Instance("x", cluster(failed, domains=8), job(pp=2))
    launched = planned(peers.megatron_ntp, inst)
    packed = planned(peers.megatron_ntp_reordered, inst)
    assert [r.tp for r in launched.replicas] == [6, 6, 8, 8]
    assert [r.tp for r in packed.replicas] == [6, 8, 8, 8]
    assert [[s.domain for s in r.stages] for r in packed.replicas] == [
        ["d0", "d5"],
        ["d1", "d2"],
        ["d3", "d4"],
        ["d6", "d7"],
    ]
    expect = 16 / (4 / 0.75 * (1 + RHO)) / 4
    assert rel(inst, launched) == pytest.approx(expect)
    assert rel(inst, packed) == pytest.approx(expect)
    assert evaluate(inst, packed).n_reduced == 1


def test_gpus_beyond_the_tp_groups_are_not_tp_spares():
    # domains of 12 GPUs, TP8: one group per domain on trays t0, t1; tray t2 is outside
    # the job. A failure on d0.t0.g0 (local rank 0): as launched replica 0 runs at TP7,
    # theta = 4 / (7/8) * 1.01, relative = 16 / theta / 4 = 0.866337. The re-ordering
    # launcher maps d0's ranks onto healthy GPUs first (t0.g1 .. t2.g0): every replica at
    # TP8, relative 1. A failure on t2 alone is invisible as launched.
    inst = Instance("x", cluster(["d0.t0.g0"], size=12), job(tp_min=7))
    launched = planned(peers.megatron_ntp, inst)
    assert [r.tp for r in launched.replicas] == [7, 8, 8, 8]
    assert rel(inst, launched) == pytest.approx(16 / (4 / (7 / 8) * (1 + RHO)) / 4)
    packed = planned(peers.megatron_ntp_reordered, inst)
    assert [r.tp for r in packed.replicas] == [8, 8, 8, 8]
    assert "d0.t2.g0" in packed.replicas[0].stages[0].gpus
    assert rel(inst, packed) == pytest.approx(1.0)
    outside = Instance("y", cluster(["d1.t2.g3"], size=12), job(tp_min=7))
    assert rel(outside, planned(peers.megatron_ntp, outside)) == pytest.approx(1.0)


def test_straggler_is_not_rebalanced():
    # no failure, d3.t0.g0 at speed 0.5: every replica at TP8 with b = 4 (no rebalancing),
    # theta = 4 / 0.5 = 8 (no overhead), goodput = 16 / 8 = 2, relative 0.5. ntp gives
    # the slow replica a smaller batch and does better.
    inst = Instance("x", cluster(stragglers=[("d3.t0.g0", 0.5)]), job(batch_policy="elastic"))
    plan = planned(peers.megatron_ntp, inst)
    assert rel(inst, plan) == pytest.approx(16 / 8 / 4)
    assert rel(inst, solve(inst, "ntp").plan) > 0.5


def test_rack_budget_below_tdp_drops_replicas():
    # racks at 0.9 x TDP cannot feed a TP8 stage at power 1 (8 kW > 7.2 kW): every
    # replica is dropped and the job pauses.
    inst = Instance("x", cluster(rack_power_factor=0.9), job(batch_policy="elastic"))
    plan = planned(peers.megatron_ntp, inst)
    assert plan.replicas == () and evaluate(inst, plan).feasible


def test_registered_and_never_above_the_optimum():
    assert "megatron-ntp" in HEURISTICS and "megatron-ntp-reordered" in HEURISTICS
    g = topology.build_cluster(16, 8, 4, 2)
    topology.fail_random(g, count=6, seed=3)
    topology.add_stragglers(g, count=3, speed=(0.7, 0.95), seed=4)
    inst = Instance("r", g, job(pp=2, dp=8, global_batch=32, batch_policy="elastic"))
    best = solve(inst, "optimal-nopower", time_limit=HANG_GUARD)
    assert best.status == "optimal"
    for name in ("megatron-ntp", "megatron-ntp-reordered"):
        res = solve(inst, name)
        assert res.evaluation is not None and res.evaluation.feasible
        assert rel(inst, res.plan) <= rel(inst, best.plan) + 1e-9


# --- batch split: Malleus-style ILP and ours ------------------------------------------------


def brute_force(times, n_total):
    """Smallest max_i o_i m_i over every composition of n_total into len(times) parts >= 1."""
    n = len(times)
    best = math.inf
    for cuts in itertools.combinations(range(1, n_total), n - 1):
        parts = [b - a for a, b in zip((0, *cuts), (*cuts, n_total), strict=True)]
        best = min(best, max(o * m for o, m in zip(times, parts, strict=True)))
    return best


def test_split_hand_case():
    # o = (1, 2), N = 3: (2, 1) gives max(2, 2) = 2, (1, 2) gives max(1, 4) = 4
    ours = peers.our_split([1.0, 2.0], 3)
    assert ours.m == [2, 1] and ours.objective == 2.0 and ours.proven
    # 8 micro-batches on 28/32 and 30/32 speeds: o = 32/28, 32/30; N = 16 -> (8, 8)
    # gives 8 * 32/28 = 9.142857; (7, 9) gives 9 * 32/30 = 9.6; (9, 7) gives 10.29
    ours = peers.our_split([32 / 28, 32 / 30], 16)
    assert ours.m == [8, 8] and ours.objective == pytest.approx(8 * 32 / 28)


def test_our_split_exact_against_enumeration():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 4)
        n_total = rng.randint(n, 11)
        times = [rng.choice([1.0, 32 / 30, 32 / 28, 1.5, rng.uniform(0.5, 3)]) for _ in range(n)]
        ours = peers.our_split(times, n_total)
        assert sum(ours.m) == n_total and min(ours.m) >= 1
        assert ours.objective == pytest.approx(brute_force(times, n_total), rel=1e-12)


def test_malleus_split_against_enumeration():
    pytest.importorskip("pulp")
    rng = random.Random(11)
    for _ in range(12):
        n = rng.randint(1, 4)
        n_total = rng.randint(n, 10)
        times = [rng.choice([1.0, 32 / 30, 32 / 28, rng.uniform(0.5, 3)]) for _ in range(n)]
        ilp = peers.malleus_split(times, n_total, time_limit=HANG_GUARD)
        assert ilp.proven and sum(ilp.m) == n_total
        assert ilp.objective == pytest.approx(brute_force(times, n_total), rel=1e-6)


def check_never_loses(times, n_total, limit):
    ilp = peers.malleus_split(times, n_total, time_limit=limit)
    ours = peers.our_split(times, n_total)
    assert ours.proven
    assert ours.objective <= ilp.objective * (1 + 1e-9)
    if ilp.proven:
        assert ours.objective == pytest.approx(ilp.objective, rel=1e-6)
    return ilp


def test_ours_never_loses_to_the_ilp():
    pytest.importorskip("pulp")
    rng = random.Random(5)
    cases = [(rng.randint(2, 40), 0.5) for _ in range(6)]
    cases += [(256, 0.3), (400, 0.3)]  # CBC's time limit bites before any integer point
    for n, limit in cases:
        times = [rng.choice([32 / 28, 32 / 30, 1.0]) * rng.uniform(0.99, 1.01) for _ in range(n)]
        n_total = n * rng.randint(1, 8) + rng.randint(0, n)
        check_never_loses(times, n_total, limit)
    # two speeds, 8 micro-batches each: on this machine CBC stops at 1 s on the point
    # 9.6 (status Optimal, sol_status integer feasible); the optimum is 8 * 32/28
    rng = random.Random(3)
    times = [rng.choice([32 / 28, 32 / 30]) for _ in range(200)]
    check_never_loses(times, 1600, 1.0)
    assert peers.our_split(times, 1600).objective == pytest.approx(8 * 32 / 28)


def test_time_limited_point_is_not_proven(monkeypatch):
    # A time-limited CBC reports status Optimal with sol_status "integer feasible"
    # (PuLP issue #711): such a point must not count as proven.
    pulp = pytest.importorskip("pulp")
    real = pulp.LpProblem.solve

    def stopped(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        self.sol_status = pulp.LpSolutionIntegerFeasible
        return out

    monkeypatch.setattr(pulp.LpProblem, "solve", stopped)
    ilp = peers.malleus_split([1.0, 2.0], 3, time_limit=5)
    assert ilp.m == [2, 1] and ilp.objective == 2.0 and not ilp.proven


def test_split_input_errors():
    for bad in ([], [1.0, 0.0], [math.inf]):
        with pytest.raises(ValueError):
            peers.our_split(bad, 4)
    with pytest.raises(ValueError):
        peers.our_split([1.0, 1.0, 1.0], 2)
    assert peers.split_objective([1.0], []) == math.inf


def test_malleus_as_shipped_reads_counts_in_name_order():
    pytest.importorskip("pulp")
    # 10 pipelines at o = 1 and pipeline 10 at o = 4, N = 41: the only optimum
    # (z = 4) gives the fast ones 4 and the slow one 1 (4 x 10 + 1 = 41; z < 4
    # would leave the slow pipeline no micro-batch). Read in name order
    # m_0, m_1, m_10, m_2, ..., m_9, the slow pipeline's 1 lands on pipeline 2
    # and pipeline 10 gets 4: applied step time 4 x 4 = 16.
    out = peers.malleus_split_as_shipped([1.0] * 10 + [4.0], 41, 1)
    assert out.accepted and out.reported == pytest.approx(4.0)
    assert out.m == [4, 4, 1, 4, 4, 4, 4, 4, 4, 4, 4]
    assert out.applied == pytest.approx(16.0)
    # with 10 pipelines or fewer the name order is the pipeline order
    small = peers.malleus_split_as_shipped([1.0] * 9 + [4.0], 37, 1)
    assert small.m == [4] * 9 + [1] and small.applied == pytest.approx(4.0)


def test_malleus_as_shipped_lower_bound_is_the_stage_count():
    pytest.importorskip("pulp")
    # o = (1, 3), N = 5: with m_i >= 1 the optimum is (4, 1), step time 4;
    # with m_i >= 2 stages the best is (3, 2), step time 3 x 2 = 6
    assert peers.malleus_split([1.0, 3.0], 5).objective == pytest.approx(4.0)
    shipped = peers.malleus_split_as_shipped([1.0, 3.0], 5, 2)
    assert shipped.m == [3, 2] and shipped.reported == pytest.approx(6.0)
    with pytest.raises(ValueError, match="stages"):
        peers.malleus_split_as_shipped([1.0, 3.0], 3, 2)
