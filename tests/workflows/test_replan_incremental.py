"""Incremental re-planning (issue 15): the index-space path equals the reference one.

* :func:`ntp_opt.workflows.incremental.recourse_layout` equals
  :func:`ntp_opt.rules.recourse.adapt_indices` plan for plan;
* :func:`ntp_opt.workflows.incremental.reboost_layout` equals the list-form
  re-boost it replaced (kept below as the reference);
* :func:`ntp_opt.rules.validate.evaluate_layout` equals
  :func:`ntp_opt.rules.validate.evaluate`, figure for figure, violations
  included, also when it starts from the last check kept in a memo (random
  edits and events), and :func:`ntp_opt.rules.power.redraw` equals the full
  draw bit for bit;
* a :class:`Replanner` replaying an event sequence returns what the one-shot
  :func:`replan` returns from the same plan, and every plan it returns passes
  the full validator.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt import Instance, Plan, Replica, Stage, check, solve
from ntp_opt.model.layout import Layout
from ntp_opt.planners.fast_cuts import boost_floor
from ntp_opt.planners.packing import Slot, boost_slowest, split_groups
from ntp_opt.rules.power import can_boost, gpu_draw, rack_and_site_draw, redraw
from ntp_opt.rules.recourse import adapt_indices
from ntp_opt.rules.tolerances import FLOAT_NOISE
from ntp_opt.rules.validate import evaluate, evaluate_layout
from ntp_opt.workflows.events import apply_events
from ntp_opt.workflows.incremental import reboost_layout, recourse_layout
from ntp_opt.workflows.replan import ClusterEvent, Replanner, replan
from tests.strategies import instances, valid_plans


def ref_reboost(instance: Instance, plan: Plan) -> Plan | None:
    """The list-form re-boost of ``replan.reboost`` before issue 15 (unvalidated)."""
    a = instance.arrays
    if not plan.replicas or not can_boost(instance):
        return None
    index = a.gpu_index
    groups = [
        (
            rep.tp,
            [
                Slot(a.domain_index[st.domain], np.array([index[g] for g in st.gpus]), rep.tp)
                for st in rep.stages
            ],
        )
        for rep in plan.replicas
    ]

    def split_for(powers):
        split = split_groups(instance, groups, powers)
        return None if split is None else (split.goodput, split.batches)

    keep = split_for([[st.power for st in rep.stages] for rep in plan.replicas])
    value = -1.0 if keep is None else keep[0]
    best = None
    for powers in (boost_slowest(instance, groups), boost_floor(instance, groups)):
        got = split_for(powers)
        if (
            got is not None
            and got[0] > value * (1 + FLOAT_NOISE)
            and (best is None or got[0] > best[0])
        ):
            best = (got[0], powers, got[1])
    if best is None:
        return None
    _, powers, batches = best
    powers = ref_trim(instance, groups, powers, batches)
    reps = tuple(
        Replica(
            tp=rep.tp,
            local_batch=b,
            stages=tuple(
                Stage(st.domain, st.gpus, float(pw)) for st, pw in zip(rep.stages, p, strict=True)
            ),
        )
        for rep, p, b in zip(plan.replicas, powers, batches, strict=True)
        if b > 0
    )
    return Plan(plan.instance, reps, {"policy": "reboost"})


def same_but_last_bits(got: Plan, ref: Plan) -> bool:
    """The same replicas, batches and GPUs, the multipliers equal to the last few bits:
    the package computes ``x ** (1 / alpha)`` with numpy's ``pow`` on arrays, the
    reference above with Python's on floats, which may differ by an ulp or two."""
    if len(got.replicas) != len(ref.replicas):
        return False
    for x, y in zip(got.replicas, ref.replicas, strict=True):
        if (x.tp, x.local_batch, len(x.stages)) != (y.tp, y.local_batch, len(y.stages)):
            return False
        for s, t in zip(x.stages, y.stages, strict=True):
            if (s.domain, s.gpus) != (t.domain, t.gpus) or not math.isclose(
                s.power, t.power, rel_tol=1e-12
            ):
                return False
    return True


def ref_trim(instance: Instance, groups, powers, batches) -> list[list[float]]:
    """Each stage's multiplier lowered to what its replica's batch needs (issue 32):
    ``max(1, (need / base) ** (1 / alpha))`` with the trim's margin, never raised, and
    kept only if the goodput at these batches does not drop."""
    from ntp_opt.rules.boost import TRIM_MARGIN
    from ntp_opt.rules.goodput import goodput, overhead_factor, replica_speed

    job = instance.job
    a = instance.arrays
    tps = [t for t, _ in groups]

    def speeds(pw):
        return [
            replica_speed(job, t, [float(a.speed[s.gpus[:t]].min()) for s in slots], p)
            for (t, slots), p in zip(groups, pw, strict=True)
        ]

    theta = max(b / v for b, v in zip(batches, speeds(powers), strict=True) if b > 0)
    theta *= overhead_factor(job, tps)
    out = []
    for (t, slots), p, b in zip(groups, powers, batches, strict=True):
        need = b * overhead_factor(job, tps) / theta
        row = []
        for s, pw in zip(slots, p, strict=True):
            base = job.tp_factor(t) * float(a.speed[s.gpus[:t]].min()) / job.seq_time_s
            want = (need / base) ** (1 / job.power_exponent) * (1 + TRIM_MARGIN)
            row.append(min(float(pw), max(want, 1.0)))
        out.append(row)
    if goodput(job, tps, batches, speeds(out)) < goodput(job, tps, batches, speeds(powers)):
        return powers
    return out


def _events(data: st.DataObject, inst: Instance, n: int) -> list[ClusterEvent]:
    """``n`` events valid one after the other (fail, repair, speed, tray failure)."""
    out = []
    cur = inst
    for _ in range(n):
        a = cur.arrays
        up = [g for g, ok in zip(a.gpu_ids, a.healthy, strict=True) if ok]
        down = [g for g, ok in zip(a.gpu_ids, a.healthy, strict=True) if not ok]
        kinds = ["fail", "speed"] + (["repair"] if down else [])
        trays = [
            t
            for i, t in enumerate(a.tray_ids)
            if a.healthy[a.gpu_tray == i].all() and (a.gpu_tray == i).any()
        ]
        kinds += ["tray"] if trays and len(up) > 4 else []
        kind = data.draw(st.sampled_from(kinds))
        if kind == "tray":
            ev = ClusterEvent("fail", (data.draw(st.sampled_from(trays)),))
        elif kind == "repair":
            ev = ClusterEvent("repair", (data.draw(st.sampled_from(down)),))
        elif kind == "fail":
            if not up:
                break
            ev = ClusterEvent("fail", (data.draw(st.sampled_from(up)),))
        else:
            speed = data.draw(st.sampled_from([0.5, 0.8, 1.0]))
            ev = ClusterEvent("speed", (data.draw(st.sampled_from(up or list(a.gpu_ids))),), speed)
        out.append(ev)
        cur = apply_events(cur, [ev])
    return out


@given(instances(), st.data())
def test_recourse_and_reboost_on_the_layout_equal_the_reference(inst, data):
    plan = data.draw(valid_plans(inst))
    layout = Layout.from_plan(inst, plan)
    (ev,) = _events(data, inst, 1) or [None]
    if ev is None:
        return
    new = apply_events(inst, [ev])
    mask = inst.arrays.healthy & ~new.arrays.healthy
    local, lay = recourse_layout(new, plan, layout, mask)
    assert local == adapt_indices(new, plan, mask, layout)
    assert lay.to_plan(new).replicas == local.replicas
    got = reboost_layout(new, local, lay)
    ref = ref_reboost(new, local)
    assert (got is None) == (ref is None)
    if got is not None:
        assert same_but_last_bits(got.plan, ref)
        assert same_but_last_bits(got.layout.to_plan(new), ref)
    if local.replicas:  # recourse's goodput is the split re-boosting starts from
        again = reboost_layout(new, local, lay, keep=local.metrics["goodput"])
        assert (again is None) == (got is None)
        assert again is None or (
            again.plan == got.plan and again.layout.batch.tolist() == got.layout.batch.tolist()
        )
    memo: dict = {}  # a re-planning memo: its kept splits change no result
    for _ in range(2):
        local_m, lay_m = recourse_layout(new, plan, layout, mask, memo)
        assert local_m == local and lay_m.batch.tolist() == lay.batch.tolist()
        got_m = reboost_layout(new, local, lay, memo=memo)
        assert (got_m is None) == (got is None)
        assert got_m is None or got_m.plan == got.plan
    assert "splits" in memo


@given(instances(), st.data())
def test_the_index_space_check_equals_the_validator(inst, data):
    plan = data.draw(valid_plans(inst))
    layout = Layout.from_plan(inst, plan)
    assert evaluate_layout(inst, plan, layout) == evaluate(inst, plan)
    # after events the same plan may break rules: the same violations, named
    events = _events(data, inst, 2)
    new = apply_events(inst, events)
    assert evaluate_layout(new, plan, layout) == evaluate(new, plan)


def _edited(data: st.DataObject, inst: Instance, plan: Plan) -> Plan:
    """``plan`` with one stage's multiplier or one of its GPUs replaced at random (any
    multiplier, any GPU: the plan may break rules), claiming the validator's goodput."""
    r = data.draw(st.integers(0, len(plan.replicas) - 1))
    rep = plan.replicas[r]
    s = data.draw(st.integers(0, len(rep.stages) - 1))
    stage = rep.stages[s]
    if data.draw(st.booleans()):
        hi = 1.0 + inst.job.max_boost
        power = data.draw(st.sampled_from([1.0, 1.0, 0.5 * (1.0 + hi), hi, 2.0 * hi]))
        stage = dataclasses.replace(stage, power=power)
    else:
        a = inst.arrays
        k = data.draw(st.integers(0, len(stage.gpus) - 1))
        near = a.domain_gpus[a.domain_index[stage.domain]]  # mostly: the same domain
        pool = near if data.draw(st.integers(0, 3)) else np.arange(a.n_gpus)
        gpu = a.gpu_ids[int(data.draw(st.sampled_from(pool.tolist())))]
        stage = dataclasses.replace(stage, gpus=(*stage.gpus[:k], gpu, *stage.gpus[k + 1 :]))
    stages = (*rep.stages[:s], stage, *rep.stages[s + 1 :])
    reps = (*plan.replicas[:r], dataclasses.replace(rep, stages=stages), *plan.replicas[r + 1 :])
    edited = Plan(plan.instance, reps, dict(plan.metrics))
    return edited.with_metrics(goodput=evaluate(inst, edited).goodput)


@given(instances(), st.data())
def test_the_check_from_the_last_one_equals_the_validator(inst, data):
    """With a memo, ``evaluate_layout`` draws again only the GPUs whose multiplier or
    health changed since the last check that passed: after random edits and events,
    the same figures and violations as the validator."""
    plan = data.draw(valid_plans(inst, min_replicas=1))
    memo: dict = {}
    cur = inst
    passed = 0
    for _ in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()):
            cur = apply_events(cur, _events(data, cur, 1))
        else:
            plan = _edited(data, cur, plan)
        ref = evaluate(cur, plan)
        assert evaluate_layout(cur, plan, Layout.from_plan(cur, plan, strict=False), memo) == ref
        passed += ref.feasible
    if passed:
        assert "drawn" in memo  # the draw of a check that passed is kept


@given(instances(), st.data())
def test_a_redraw_equals_the_full_draw(inst, data):
    a = inst.arrays
    power_of = np.zeros(a.n_gpus)
    last = None
    for _ in range(data.draw(st.integers(1, 5))):
        at = data.draw(st.lists(st.integers(0, a.n_gpus - 1), max_size=6))
        power_of = power_of.copy()
        power_of[at] = data.draw(st.sampled_from([0.0, 1.0, 1.1, 1.35]))
        last, changed = redraw(inst, power_of, last)
        rack, site = rack_and_site_draw(inst, power_of)
        assert last.rack.tobytes() == rack.tobytes() and last.site == site  # bit for bit
        assert last.per_gpu.tobytes() == gpu_draw(inst, power_of).tobytes()
        assert changed is None or set(changed.tolist()) <= set(at)


@given(instances(), st.data())
def test_a_replanner_replays_events_as_one_shot_replans(inst, data):
    plan = solve(inst, "fast").plan
    assert plan is not None
    mode = data.draw(st.sampled_from(["auto", "local"]))
    events = _events(data, inst, data.draw(st.integers(1, 4)))
    runner = Replanner(inst, plan, mode=mode, check="full")
    cur_inst, cur_plan = inst, plan
    for ev in events:
        out = runner.replan([ev])
        ref = replan(cur_inst, cur_plan, [ev], mode=mode, bound=mode == "auto")
        assert out.plan.replicas == ref.plan.replicas
        assert {k: v for k, v in out.plan.metrics.items() if k != "bound"} == {
            k: v for k, v in ref.plan.metrics.items() if k != "bound"
        }
        assert (out.choice, out.moved, out.goodput) == (ref.choice, ref.moved, ref.goodput)
        if out.bound_kind == "incremental":  # valid; settled, so within tolerance
            assert out.goodput <= out.bound * (1 + 1e-9)
            assert out.bound * (1 - 1e-3) <= ref.bound * (1 + 1e-9)
        else:
            assert out.bound == ref.bound
        assert out.instance == ref.instance
        assert check(out.instance, out.plan).goodput == out.goodput  # the full validator
        assert runner.plan is out.plan and runner.instance is out.instance
        if mode == "local":
            assert out.bound == math.inf and out.bound_kind == "skipped"
        cur_inst, cur_plan = out.instance, out.plan


def test_a_what_if_leaves_the_replanner_alone():
    inst = solve_default_instance()
    plan = solve(inst, "fast").plan
    runner = Replanner(inst, plan, mode="local")
    g = next(iter(plan.used_gpus()))
    out = runner.replan([ClusterEvent("fail", g)], commit=False)
    assert runner.plan is plan and runner.instance is inst
    assert g not in set(out.plan.used_gpus())


def solve_default_instance() -> Instance:
    from ntp_opt.model import topology
    from ntp_opt.model.job import Job

    g = topology.build_cluster(4, 4, 2, 2)
    job = Job(tp=4, tp_min=2, pp=2, dp=2, global_batch=8, batch_policy="elastic")
    return Instance("four", g, job)


def test_bad_settings_are_refused():
    inst = solve_default_instance()
    plan = solve(inst, "fast").plan
    with pytest.raises(ValueError, match="check"):
        Replanner(inst, plan, check="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bound"):
        Replanner(inst, plan, mode="auto", bound=False)
    with pytest.raises(ValueError, match="bound"):
        replan(inst, plan, [], bound=False)


@given(instances(), st.data())
def test_the_incremental_bound_is_valid_and_its_rows_are_the_full_ones(inst, data):
    from ntp_opt.planners.bounds.rows import domain_rows, domain_rows_after
    from ntp_opt.planners.bounds.stage import stage_bound, stage_bound_at, stage_bound_point

    rows = domain_rows(inst)
    value, points = stage_bound_point(inst, rows)
    assert value == stage_bound(inst)
    if inst.job.batch_policy == "elastic":  # at its own multipliers: the same number
        assert stage_bound_at(inst, points, rows) == value
    events = _events(data, inst, data.draw(st.integers(1, 3)))
    new = apply_events(inst, events)
    a = inst.arrays
    changed = (a.healthy != new.arrays.healthy) | (a.speed != new.arrays.speed)
    touched = sorted({int(a.gpu_domain[i]) for i in np.flatnonzero(changed)})
    after = domain_rows_after(new, rows, touched)
    full = domain_rows(new)
    assert after.width == full.width and np.array_equal(after.key, full.key)
    (got_rows, got_counts), (rows_f, counts_f) = after.classes(), full.classes()
    assert np.array_equal(got_rows, rows_f) and got_counts.tolist() == counts_f.tolist()
    assert np.array_equal(got_rows[after.domain_class()], full.key + 0.0)
    bound = stage_bound_at(new, points, after)
    assert bound == stage_bound_at(new, points)
    plan = solve(new, "fast").plan
    assert plan is not None
    assert evaluate(new, plan).goodput <= bound * (1 + 1e-9)


@given(instances(), st.data())
def test_the_boost_memos_change_no_result(inst, data):
    """``boost_stages`` and ``boost_floor_stages`` give the same with a memo kept from an
    earlier call (other rooms, same stages) as without one: a bisection's kept path is
    replayed at the same rooms and bisected again at others."""
    from ntp_opt.rules.boost import boost_floor_stages, boost_stages
    from ntp_opt.rules.power import headroom
    from ntp_opt.workflows.incremental import stages_of

    plan = data.draw(valid_plans(inst))
    if not plan.replicas:
        return
    lay = Layout.from_plan(inst, plan)
    stages = stages_of(lay)
    used = np.zeros(inst.arrays.n_gpus)
    used[lay.gpus] = 1.0
    rack_room, site_room = headroom(inst, used)
    ones = np.ones(lay.n_stages)
    every = list(range(lay.n_replicas))
    memo: dict = {}
    other = data.draw(st.sampled_from([0.0, 0.3, 0.9, 1.1]))
    for scale in (1.0, other, other, 1.0):
        rooms = (rack_room * scale, site_room * scale)
        plain = boost_stages(inst, stages, lay.degree, ones, every, *rooms, steps=50)
        kept = boost_stages(inst, stages, lay.degree, ones, every, *rooms, steps=50, memo=memo)
        assert plain[0].tolist() == kept[0].tolist() and plain[1] == kept[1]
        floor = boost_floor_stages(inst, stages, lay.degree, *rooms)
        again = boost_floor_stages(inst, stages, lay.degree, *rooms, memo=memo)
        assert floor.tolist() == again.tolist()


def test_a_kept_bisection_path_gives_the_bisection_at_every_room():
    """Slow replicas in tight rooms bisect: the memo's kept path (replayed at the same
    rooms, bisected again at others) gives what no memo gives, room after room."""
    from ntp_opt.rules.boost import boost_stages
    from ntp_opt.workflows.incremental import stages_of

    inst = solve_default_instance()
    plan = solve(inst, "fast").plan
    assert plan is not None
    lay = Layout.from_plan(inst, plan)
    ids = inst.arrays.gpu_ids
    slow = apply_events(inst, [ClusterEvent("speed", ids[g], 0.7) for g in lay.gpus[::3]])
    stages = stages_of(lay)
    ones = np.ones(lay.n_stages)
    every = list(range(lay.n_replicas))
    rack_room = np.zeros(len(slow.arrays.rack_ids))
    memo: dict = {}
    bisected = set()
    for watts in (50.0, 200.0, 200.0, 50.0, 1000.0, 1000.0, 50.0):
        rooms = (rack_room + watts, 2 * watts)
        plain = boost_stages(slow, stages, lay.degree, ones, every, *rooms, steps=50)
        kept = boost_stages(slow, stages, lay.degree, ones, every, *rooms, steps=50, memo=memo)
        assert plain[0].tolist() == kept[0].tolist() and plain[1] == kept[1]
        bisected.add(tuple(plain[0].tolist()))
    assert len(bisected) == 3 and all(1.0 < max(pw) < 1.3 for pw in bisected)
    for _ in range(2):  # no bisection step: the kept empty path replays too
        rooms = (rack_room + 50.0, 100.0)
        plain = boost_stages(slow, stages, lay.degree, ones, every, *rooms, steps=0)
        kept = boost_stages(slow, stages, lay.degree, ones, every, *rooms, steps=0, memo=memo)
        assert plain[0].tolist() == kept[0].tolist() and plain[1] == kept[1]
    assert any(key[0] == "path" for key in memo if isinstance(key, tuple))


def test_a_replanner_finds_trays_in_the_arrays_and_names_unknown_nodes():
    inst = solve_default_instance()
    plan = solve(inst, "fast").plan
    runner = Replanner(inst, plan, mode="local", check="full")
    tray = inst.arrays.tray_ids[0]
    out = runner.replan([ClusterEvent("fail", tray)], commit=False)
    assert "cluster" not in vars(out.instance)  # the graph is built only when read
    assert out.instance == apply_events(inst, [ClusterEvent("fail", tray)])
    assert out.instance.cluster.nodes[inst.arrays.gpu_ids[0]]["state"] == "failed"
    with pytest.raises(ValueError, match="not a GPU or tray"):
        runner.replan([ClusterEvent("fail", "nope")])


def test_the_swap_plan_settled_by_the_incremental_bound_is_the_full_bounds_choice():
    """A chain of failures on a 16k NVL32 cluster (elastic) where the local plan
    is below the incremental bound, the swap plan is made first and the
    incremental bound settles the choice with it: the same plan, choice and
    migration as the one-shot re-plan, which searches the full bound."""
    from ntp_opt.model import topology
    from ntp_opt.model.job import Job

    gpus = 16384
    g = topology.nvl32(gpus // 32, rack_power_factor=1.3)
    job = Job(
        tp=32,
        tp_allowed=(28, 30, 32),
        pp=8,
        dp=gpus // 256,
        global_batch=gpus // 16,
        batch_policy="elastic",
    )
    topology.fail_random(g, fraction=1e-3, seed=1)
    topology.add_stragglers(g, count=4, speed=(0.7, 0.95), seed=2)
    inst = Instance("nvl32", g, job, {}, copy_graph=False)
    plan = solve(inst, "fast").plan
    assert plan is not None
    runner = Replanner(inst, plan)
    rng = np.random.default_rng(7)
    cur_inst, cur_plan = inst, plan
    paths = []
    for _ in range(6):
        used = np.zeros(inst.arrays.n_gpus, dtype=bool)
        used[runner.state.layout.gpus] = True
        gpu = inst.arrays.gpu_ids[int(rng.choice(np.flatnonzero(used)))]
        out = runner.replan([ClusterEvent("fail", gpu)])
        ref = replan(cur_inst, cur_plan, [ClusterEvent("fail", gpu)])
        assert out.plan.replicas == ref.plan.replicas
        assert (out.choice, out.moved, out.goodput) == (ref.choice, ref.moved, ref.goodput)
        assert out.goodput <= out.bound * (1 + 1e-9)
        paths.append((out.bound_kind, "swap" in out.details, out.choice))
        cur_inst, cur_plan = out.instance, out.plan
    # the path this test is about: settled by the incremental bound, swap plan made
    assert ("incremental", True, "local") in paths
