"""Re-planning: events, migration counts (hand-checked), validity, speed path."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_opt import Instance, Job, Plan, Replica, Stage, check, solve
from ntp_opt.model import topology
from ntp_opt.model.layout import Layout
from ntp_opt.rules.validate import certified
from ntp_opt.workflows.events import apply_events
from ntp_opt.workflows.replan import (
    ClusterEvent,
    Replanner,
    align,
    migration,
    replan,
)
from ntp_opt.workflows.simulate import Event
from tests.strategies import instances


def two_domains() -> Instance:
    # 2 domains of 4 GPUs, TP 3 or 4, pp=1: d0 runs TP3 with one spare GPU
    g = topology.build_cluster(2, 4, 2, 2)
    job = Job(tp=4, tp_min=3, pp=1, dp=2, global_batch=4, max_boost=0.0, batch_policy="elastic")
    return Instance("two", g, job)


def plan_for(inst: Instance) -> Plan:
    return Plan(
        inst.name,
        (
            Replica(3, 1, (Stage("d0", ("d0.t0.g0", "d0.t0.g1", "d0.t1.g0"), 1.0),)),
            Replica(4, 2, (Stage("d1", ("d1.t0.g0", "d1.t0.g1", "d1.t1.g0", "d1.t1.g1"), 1.0),)),
        ),
    )


def test_apply_events_equals_a_fresh_build_and_leaves_the_input_alone():
    inst = two_domains()
    new = apply_events(
        inst,
        [
            ClusterEvent("fail", ("d0.t0.g1",)),
            {"kind": "fail", "nodes": ["d1.t1"]},
            ClusterEvent("speed", ("d1.t0.g0",), 0.5),
        ],
    )
    g = inst.cluster.copy()
    topology.fail_gpus(g, ["d0.t0.g1", "d1.t1.g0", "d1.t1.g1"])
    topology.set_speed(g, ["d1.t0.g0"], 0.5)
    fresh = Instance(inst.name, g, inst.job)
    assert new == fresh
    assert (new.arrays.healthy == fresh.arrays.healthy).all()
    assert (new.arrays.speed == fresh.arrays.speed).all()
    assert (
        inst.arrays.healthy.all()
        and inst.cluster.nodes["d0.t0.g1"].get("state", "healthy") == "healthy"
    )
    back = apply_events(new, [ClusterEvent("repair", ("d0.t0.g1",))])
    assert back.arrays.healthy.sum() == new.arrays.healthy.sum() + 1


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (ClusterEvent("fail", ("nope",)), "nope"),
        (ClusterEvent("repair", ("d0.t0.g0",)), "which is up"),
        ({"kind": "fail", "nodes": ["d0.t0.g0"], "extra": 1}, "extra"),
        ({"kind": "speed", "nodes": ["d0.t0.g0"], "speed": 2.0}, "speed"),
        ({"kind": "fail", "nodes": "d0.t0.g0"}, "list"),
    ],
)
def test_bad_events_are_clear_errors(event, message):
    with pytest.raises(ValueError, match=message):
        apply_events(two_domains(), [event])


def test_migration_by_hand():
    inst = two_domains()
    old = plan_for(inst)
    assert migration(inst, old, old) == 0
    # swap d0's spare in for g1: g1 leaves (1), t1.g1 joins (1)
    new = Plan(
        inst.name,
        (
            Replica(3, 1, (Stage("d0", ("d0.t0.g0", "d0.t1.g1", "d0.t1.g0"), 1.0),)),
            old.replicas[1],
        ),
    )
    assert migration(inst, old, new) == 2
    # swapping the replicas' order moves every used GPU (3 + 4)
    assert migration(inst, old, Plan(inst.name, old.replicas[::-1])) == 7


def test_failure_refilled_from_the_spare_moves_one_gpu():
    inst = two_domains()
    out = replan(inst, plan_for(inst), [ClusterEvent("fail", ("d0.t0.g1",))], tolerance=1.0)
    assert out.choice == "local"
    assert out.moved == 1  # the spare d0.t1.g1 joins; the failed GPU is not counted
    assert "d0.t1.g1" in out.plan.replicas[0].stages[0].gpus
    check(out.instance, out.plan)


def test_no_event_and_a_spare_failure_move_nothing():
    inst = two_domains()
    plan = plan_for(inst)
    # with a loose tolerance the running plan stays as it is
    assert replan(inst, plan, [], tolerance=1.0).moved == 0
    out = replan(inst, plan, [Event(1.0, "fail", ("d0.t1.g1",), "hardware")])
    assert out.choice == "local" and out.moved == 0


def test_a_plan_far_from_the_bound_is_upgraded():
    # d0 runs TP3 although all 4 GPUs are healthy: goodput (1 + 2) / (2 * 1.01);
    # TP4 everywhere gives 2 replicas x 2 sequences / 2 s = 2.0, moving one GPU
    inst = two_domains()
    out = replan(inst, plan_for(inst), [])
    assert out.local_goodput == pytest.approx(3 / 2.02, rel=1e-12)
    assert out.choice == "global" and out.goodput == pytest.approx(2.0, rel=1e-12)
    assert out.moved == 1 and out.gap == pytest.approx(0.0, abs=1e-8)  # validator slack


def test_global_mode_is_the_fast_plan_renumbered():
    inst = two_domains()
    out = replan(inst, plan_for(inst), [ClusterEvent("fail", ("d1.t0.g0",))], mode="global")
    fast = solve(out.instance, "fast")
    assert out.choice == "global"
    assert out.goodput == pytest.approx(fast.objective, rel=1e-12)
    assert out.moved <= migration(out.instance, plan_for(inst), fast.plan)


def test_replan_rejects_a_bad_plan_and_bad_settings():
    inst = two_domains()
    bad = Plan(inst.name, (Replica(4, 1, (Stage("d0", ("d0.t0.g0",) * 4, 1.0),)),))
    with pytest.raises(Exception, match=r"gpu-reused|stage"):
        replan(inst, bad, [])
    with pytest.raises(ValueError, match="tolerance"):
        replan(inst, plan_for(inst), [], tolerance=-1)
    with pytest.raises(ValueError, match="mode"):
        replan(inst, plan_for(inst), [], mode="best")  # type: ignore[arg-type]


@given(instances(), st.data())
@settings(deadline=None)
def test_replanned_plans_are_valid_on_a_fresh_instance(inst, data):
    plan = solve(inst, "fast").plan
    assert plan is not None
    a = inst.arrays
    healthy = [g for g, ok in zip(a.gpu_ids, a.healthy, strict=True) if ok]
    failed = [g for g, ok in zip(a.gpu_ids, a.healthy, strict=True) if not ok]
    kind = data.draw(st.sampled_from(["fail", "repair", "speed"] if failed else ["fail", "speed"]))
    pool = failed if kind == "repair" else healthy
    if not pool:
        return
    node = data.draw(st.sampled_from(pool))
    event = ClusterEvent(kind, (node,), 0.6 if kind == "speed" else None)
    mode = data.draw(st.sampled_from(["auto", "local", "global"]))
    out = replan(inst, plan, [event], mode=mode)
    g = inst.cluster.copy()
    if kind == "fail":
        topology.fail_gpus(g, [node])
    elif kind == "repair":
        topology.repair_gpus(g, [node])
    else:
        topology.set_speed(g, [node], 0.6)
    fresh = Instance(inst.name, g, inst.job)
    ev = check(fresh, out.plan)
    assert ev.goodput == pytest.approx(out.goodput, rel=1e-12)
    assert out.goodput <= out.bound * (1 + 1e-9)
    assert 0 <= out.moved <= int(fresh.arrays.healthy.sum())
    if out.choice == "local":
        assert out.goodput == out.local_goodput


def test_cli_replan_writes_a_valid_plan_and_instance(tmp_path, capsys):
    from ntp_opt import load_instance, load_plan, save_instance, save_plan
    from ntp_opt.app.cli import main

    inst = two_domains()
    save_instance(inst, tmp_path / "i.json")
    save_plan(certified(inst, plan_for(inst)), tmp_path / "p.json")
    events = tmp_path / "events.json"
    events.write_text('[{"kind": "fail", "nodes": ["d1.t0.g0"]}]')
    argv = [
        "replan",
        str(tmp_path / "i.json"),
        str(tmp_path / "p.json"),
        "--events",
        str(events),
        "--event",
        "speed:d0.t0.g0=0.9",
        "-o",
        str(tmp_path / "new.json"),
        "--instance-out",
        str(tmp_path / "after.json"),
    ]
    assert main(argv) == 0
    after = load_instance(tmp_path / "after.json")
    assert not after.arrays.healthy[after.arrays.gpu_index["d1.t0.g0"]]
    assert after.arrays.speed[after.arrays.gpu_index["d0.t0.g0"]] == 0.9
    check(after, load_plan(tmp_path / "new.json"))
    assert "GPUs move" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ("explode:d0", "expected fail:NODE"),
        ("speed:d0.t0.g0", "=SPEED"),
        ("speed:d0.t0.g0=fast", "not a number"),
        ("fail:nope", "not a GPU or tray"),
    ],
)
def test_cli_replan_bad_events(tmp_path, capsys, event, message):
    from ntp_opt import save_instance, save_plan
    from ntp_opt.app.cli import main

    inst = two_domains()
    save_instance(inst, tmp_path / "i.json")
    save_plan(certified(inst, plan_for(inst)), tmp_path / "p.json")
    assert (
        main(["replan", str(tmp_path / "i.json"), str(tmp_path / "p.json"), "--event", event]) == 2
    )
    assert message in capsys.readouterr().err


def four_domains() -> tuple[Instance, Plan]:
    # 4 domains of 4 GPUs, PP2, DP2: replica A on (d0, d1), B on (d2, d3)
    g = topology.build_cluster(4, 4, 2, 2)
    job = Job(tp=4, tp_min=3, pp=2, dp=2, global_batch=8, max_boost=0.0, batch_policy="elastic")
    inst = Instance("four", g, job)

    def stage(d: str) -> Stage:
        return Stage(d, tuple(f"{d}.t{t}.g{k}" for t in range(2) for k in range(2)), 1.0)

    plan = Plan(
        inst.name,
        (Replica(4, 4, (stage("d0"), stage("d1"))), Replica(4, 4, (stage("d2"), stage("d3")))),
    )
    return inst, plan


def test_a_swap_packs_two_damaged_domains_into_one_replica():
    # d0 and d2 each lose a GPU: recourse runs both replicas at TP3
    # (goodput (3 + 3) / (4 * 1.01) = 1.485). Swapping d0 with d3 (or d2
    # with d1) leaves one full replica: b = (4, 3), theta = 4 * 1.01,
    # goodput 7 / 4.04 = 1.733, moving 4 + 3 GPUs.
    inst, plan = four_domains()
    out = replan(inst, plan, [ClusterEvent("fail", ("d0.t0.g0", "d2.t0.g0"))])
    assert out.details["local"]["goodput"] == pytest.approx(6 / 4.04, rel=1e-12)
    assert out.choice == "swap"
    assert out.goodput == pytest.approx(7 / 4.04, rel=1e-12)
    assert out.moved == 7
    groups = sorted(sorted(st.domain for st in r.stages) for r in out.plan.replicas)
    assert groups in ([["d0", "d2"], ["d1", "d3"]],)
    check(out.instance, out.plan)
    # with a loose tolerance only what recourse needs moves: at TP3, d1 and d3
    # each leave one GPU unused
    loose = replan(inst, plan, [ClusterEvent("fail", ("d0.t0.g0", "d2.t0.g0"))], tolerance=0.5)
    assert loose.choice == "local" and loose.moved == 2


def test_a_repaired_replica_returns_to_full_degree():
    inst, plan = four_domains()
    first = replan(inst, plan, [ClusterEvent("fail", ("d0.t0.g0",))], tolerance=0.5)
    assert {r.tp for r in first.plan.replicas} == {3, 4}
    back = replan(first.instance, first.plan, [ClusterEvent("repair", ("d0.t0.g0",))])
    assert {r.tp for r in back.plan.replicas} == {4}
    assert back.goodput == pytest.approx(2.0, rel=1e-12)
    # two GPUs rejoin replica A: the repaired one (d0) and the one d1 left
    # unused at TP3
    assert back.choice == "swap" and back.moved == 2


def test_replanned_plans_carry_the_validators_metrics(tmp_path):
    # a straggler makes replan redo the boosts: the plan it returns must still
    # be savable (its metrics are the validator's) and reload to the same plan
    from ntp_opt import load_plan, save_plan

    base, plan = four_domains()
    g = topology.build_cluster(4, 4, 2, 2, rack_power_factor=1.5)
    g.graph["power_budget_w"] = 1.5 * float(base.arrays.tdp.sum())  # room to boost
    inst = Instance("four", g, base.job.model_copy(update={"max_boost": 0.3}))
    out = replan(inst, plan, [ClusterEvent("speed", ("d0.t0.g0",), 0.8)], mode="local")
    assert max(st.power for r in out.plan.replicas for st in r.stages) > 1.0  # re-boosted
    save_plan(out.plan, tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json")
    assert again.replicas == out.plan.replicas
    assert out.plan.metrics["goodput"] == pytest.approx(out.goodput)
    assert out.plan.metrics["moved"] == out.moved


def reference_align(old: Plan, new: Plan) -> Plan:
    """The greedy renumbering of :func:`align`, by GPU ids and sets (as first written)."""
    where = {
        g: (r, j)
        for r, rep in enumerate(old.replicas)
        for j, s in enumerate(rep.stages)
        for g in s.gpus
    }
    pairs = sorted(
        (-c, r, o)
        for r, rep in enumerate(new.replicas)
        for o, c in Counter(where[g][0] for g in rep.gpus() if g in where).items()
    )
    slot_of: dict[int, int] = {}
    for _, r, o in pairs:
        if r not in slot_of and o not in slot_of.values():
            slot_of[r] = o
    taken = set(slot_of.values())
    free = iter(i for i in range(max(len(new.replicas), len(old.replicas))) if i not in taken)
    for r in range(len(new.replicas)):
        if r not in slot_of:
            slot_of[r] = next(free)
    reps = []
    for r in sorted(slot_of, key=slot_of.__getitem__):
        rep = new.replicas[r]
        if slot_of[r] < len(old.replicas):
            olds = old.replicas[slot_of[r]].stages
            score = sorted(
                (-len(set(s.gpus) & set(o.gpus)), k, j)
                for k, s in enumerate(rep.stages)
                for j, o in enumerate(olds)
                if set(s.gpus) & set(o.gpus)
            )
            pos: dict[int, int] = {}
            for _, k, j in score:
                if k not in pos and j not in pos.values():
                    pos[k] = j
            rest = iter(j for j in range(len(rep.stages)) if j not in pos.values())
            for k in range(len(rep.stages)):
                if k not in pos:
                    pos[k] = next(rest)
            rep = Replica(
                rep.tp,
                rep.local_batch,
                tuple(sorted(rep.stages, key=lambda s: pos[rep.stages.index(s)])),
            )
        reps.append(rep)
    return Plan(new.instance, tuple(reps), dict(new.metrics))


@given(instances(), st.data())
@settings(deadline=None, max_examples=15)
def test_align_undoes_a_shuffle_and_matches_the_greedy_by_ids(inst, data):
    plan = solve(inst, "fast").plan
    assert plan is not None
    seed = data.draw(st.integers(0, 2**16))
    rng = random.Random(seed)
    reps = [
        Replica(rep.tp, rep.local_batch, tuple(rng.sample(rep.stages, len(rep.stages))))
        for rep in plan.replicas
    ]
    shuffled = Plan(plan.instance, tuple(rng.sample(reps, len(reps))), dict(plan.metrics))
    assert align(inst, plan, shuffled) == plan  # every replica and stage back in place
    a = inst.arrays
    healthy = [g for g, ok in zip(a.gpu_ids, a.healthy, strict=True) if ok]
    if not healthy:
        return
    node = data.draw(st.sampled_from(healthy))
    after = apply_events(inst, [ClusterEvent("fail", (node,))])
    fresh = solve(after, "fast").plan
    if fresh is None:
        return
    for new in (fresh, shuffled):
        assert align(after, plan, new) == reference_align(plan, new)
    # the kept layout of an aligned global plan is the one read from the plan
    rp = Replanner(inst, shuffled, mode="global")
    rp.replan([ClusterEvent("fail", (node,))])
    want = Layout.from_plan(rp.instance, rp.plan)
    for name in ("replica", "stage", "domain", "offsets", "gpus", "power", "degree", "batch"):
        assert np.array_equal(getattr(rp.state.layout, name), getattr(want, name)), name
    assert rp.state.layout.metrics == want.metrics
