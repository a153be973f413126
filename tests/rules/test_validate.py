"""The validator names every rule a corrupted plan breaks."""

from __future__ import annotations

import dataclasses

import pytest

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.planners import heuristics as baselines
from ntp_opt.rules.validate import PlanError, check, evaluate, validate
from ntp_opt.rules.violations import RULES
from tests.helpers import make_instance, planned


@pytest.fixture(scope="module")
def inst() -> Instance:
    # 8 domains of 8 GPUs, 3 failed, racks with 30 % headroom, fixed batch
    return make_instance(failed=3, rack_power_factor=1.3, seed=3, tp_min=6)


@pytest.fixture(scope="module")
def plan(inst: Instance) -> Plan:
    p = planned(baselines.ntp_pw, inst)
    assert validate(inst, p) == []
    assert p.n_replicas == 4
    return p


def replace_stage(plan: Plan, r: int, k: int, **changes) -> Plan:
    reps = list(plan.replicas)
    stages = list(reps[r].stages)
    stages[k] = dataclasses.replace(stages[k], **changes)
    reps[r] = dataclasses.replace(reps[r], stages=tuple(stages))
    return Plan(plan.instance, tuple(reps))


def replace_replica(plan: Plan, r: int, **changes) -> Plan:
    reps = list(plan.replicas)
    reps[r] = dataclasses.replace(reps[r], **changes)
    return Plan(plan.instance, tuple(reps))


def rules(inst: Instance, plan: Plan) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for v in validate(inst, plan):
        assert v.rule in RULES
        out.setdefault(v.rule, []).append(v.message)
    return out


def unused_healthy(inst: Instance, plan: Plan, domain=None, other_than=None):
    used = set(plan.used_gpus())
    a = inst.arrays
    for i, g in enumerate(a.gpu_ids):
        d = a.domain_ids[a.gpu_domain[i]]
        if g in used or not a.healthy[i]:
            continue
        if domain is not None and d != domain:
            continue
        if other_than is not None and d == other_than:
            continue
        return g
    raise AssertionError("no such GPU")


def test_duplicate_gpu(inst, plan):
    g = plan.replicas[0].stages[0].gpus[0]
    gpus = (g, *plan.replicas[1].stages[0].gpus[1:])
    bad = replace_stage(plan, 1, 0, gpus=gpus, domain=plan.replicas[0].stages[0].domain)
    found = rules(inst, bad)
    assert "gpu-reused" in found
    assert any(
        repr(g) in m and "replica 1 stage 0" in m and "replica 0 stage 0" in m
        for m in found["gpu-reused"]
    )


def test_failed_gpu(inst, plan):
    a = inst.arrays
    i = next(i for i in range(a.n_gpus) if not a.healthy[i])
    g, d = a.gpu_ids[i], a.domain_ids[a.gpu_domain[i]]
    st = plan.replicas[2].stages[0]
    bad = replace_stage(plan, 2, 0, domain=d, gpus=(g, *st.gpus[1:]))
    found = rules(inst, bad)
    assert any(repr(g) in m and "replica 2 stage 0" in m for m in found["gpu-failed"])


def test_gpu_outside_domain(inst, plan):
    st = plan.replicas[0].stages[1]
    g = unused_healthy(inst, plan, other_than=st.domain)
    bad = replace_stage(plan, 0, 1, gpus=(*st.gpus[:-1], g))
    found = rules(inst, bad)
    assert list(found) == ["gpu-outside-domain"]
    assert repr(g) in found["gpu-outside-domain"][0]
    assert repr(st.domain) in found["gpu-outside-domain"][0]


@pytest.mark.parametrize("node", ["no-such-gpu", "d0.t0", "d0"])
def test_unknown_gpu(inst, plan, node):
    st = plan.replicas[0].stages[0]
    bad = replace_stage(plan, 0, 0, gpus=(node, *st.gpus[1:]))
    assert any(repr(node) in m for m in rules(inst, bad)["gpu-unknown"])


def test_unknown_domain(inst, plan):
    bad = replace_stage(plan, 1, 1, domain="d99")
    assert "'d99'" in rules(inst, bad)["domain-unknown"][0]


def test_wrong_tp_count(inst, plan):
    st = plan.replicas[3].stages[1]
    bad = replace_stage(plan, 3, 1, gpus=st.gpus[:-1])
    found = rules(inst, bad)
    assert list(found) == ["stage-size"]
    assert "replica 3 stage 1" in found["stage-size"][0]


def test_tp_not_allowed(inst, plan):
    rep = plan.replicas[0]
    stages = tuple(dataclasses.replace(s, gpus=s.gpus[:5]) for s in rep.stages)
    bad = replace_replica(plan, 0, tp=5, stages=stages)
    found = rules(inst, bad)
    assert list(found) == ["tp-allowed"]
    assert "replica 0" in found["tp-allowed"][0] and "5" in found["tp-allowed"][0]


def test_stage_count(inst, plan):
    bad = replace_replica(plan, 2, stages=plan.replicas[2].stages[:1])
    found = rules(inst, bad)
    assert "stage-count" in found and "replica 2" in found["stage-count"][0]


@pytest.mark.parametrize("batch", [0, -1, 100, 2.5, True])
def test_batch_range(inst, plan, batch):
    bad = replace_replica(plan, 1, local_batch=batch)
    found = rules(inst, bad)
    assert any("replica 1" in m for m in found["batch-range"])


def test_batch_sum_fixed(inst, plan):
    assert inst.job.batch_policy == "fixed"
    r = next(i for i, rep in enumerate(plan.replicas) if rep.local_batch > 1)
    bad = replace_replica(plan, r, local_batch=plan.replicas[r].local_batch - 1)
    found = rules(inst, bad)
    assert list(found) == ["batch-sum"]
    assert str(inst.job.global_batch) in found["batch-sum"][0]


def test_batch_sum_elastic():
    inst = make_instance(batch_policy="elastic", global_batch=10, max_local_batch=4)
    plan = planned(baselines.ntp, inst)
    assert validate(inst, plan) == []
    over = Plan(plan.instance, tuple(dataclasses.replace(r, local_batch=4) for r in plan.replicas))
    assert "batch-sum" in rules(inst, over)
    # fewer than B is fine for elastic
    under = Plan(plan.instance, tuple(dataclasses.replace(r, local_batch=1) for r in plan.replicas))
    assert validate(inst, under) == []


@pytest.mark.parametrize("power", [0.9, 1.31, float("nan"), float("inf")])
def test_power_range(inst, plan, power):
    bad = replace_stage(plan, 0, 0, power=power)
    assert any("replica 0 stage 0" in m for m in rules(inst, bad)["power-range"])


def test_board_power():
    # 1 domain of 4 GPUs (1000 W each), racks and site with ample room; one board
    # accepts at most 1100 W: a stage on it may run at 1.1 x, not above
    from ntp_opt.model import topology
    from ntp_opt.model.job import Job

    g = topology.build_cluster(1, 4, 2, 2, rack_power_factor=2.0)
    g.graph["power_budget_w"] = 8000.0
    g.nodes["d0.t1.g0"]["max_power_w"] = 1100.0
    inst = Instance("board", g, Job(tp=4, pp=1, dp=1, global_batch=2))
    gpus = ("d0.t0.g0", "d0.t0.g1", "d0.t1.g0", "d0.t1.g1")

    def plan_at(pw: float) -> Plan:
        return Plan("board", (Replica(4, 2, (Stage("d0", gpus, pw),)),))

    assert validate(inst, plan_at(1.1)) == []  # 1.1 x 1000 W = 1100 W: on the limit
    assert validate(inst, plan_at(1.0)) == []
    found = rules(inst, plan_at(1.2))
    assert list(found) == ["board-power"]
    (msg,) = found["board-power"]
    assert msg == (
        "replica 0 stage 0: GPU 'd0.t1.g0' at power multiplier 1.2 asks for 1200 W, "
        "above its max_power_w 1100 W"
    )
    # the job's cap still applies to the other boards: 1.35 > 1 + max_boost
    found = rules(inst, plan_at(1.35))
    assert set(found) == {"power-range", "board-power"}
    # a GPU without max_power_w is limited by the job only (its default, tdp * 1.3)
    g.nodes["d0.t1.g0"].pop("max_power_w")
    assert validate(Instance("board", g, inst.job), plan_at(1.3)) == []


def test_rack_power():
    # racks budgeted at exactly their GPUs' TDP; two idle domains leave site headroom
    inst = make_instance(dp=3, global_batch=12)
    plan = planned(baselines.dp_drop, inst)
    assert plan.n_replicas == 3
    bad = replace_stage(plan, 0, 0, power=1.2)
    found = rules(inst, bad)
    assert list(found) == ["rack-power"]
    a = inst.arrays
    rack = a.rack_ids[a.gpu_rack[a.gpu_index[plan.replicas[0].stages[0].gpus[0]]]]
    assert repr(rack) in found["rack-power"][0]


def test_site_power(inst, plan):
    # racks have 30 % headroom, the site none beyond what failed/idle GPUs free
    bad = Plan(
        plan.instance,
        tuple(
            dataclasses.replace(
                r, stages=tuple(dataclasses.replace(s, power=1.25) for s in r.stages)
            )
            for r in plan.replicas
        ),
    )
    found = rules(inst, bad)
    assert list(found) == ["site-power"]


def test_too_many_replicas():
    inst = make_instance(dp=4, dp_max=3, batch_policy="elastic")
    plan = planned(baselines.ntp, inst)
    assert plan.n_replicas == 3
    spare = [
        d
        for d in inst.arrays.domain_ids
        if d not in {s.domain for r in plan.replicas for s in r.stages}
    ]
    extra = Replica(
        8,
        1,
        tuple(
            Stage(d, tuple(g for g in inst.arrays.gpu_ids if g.startswith(f"{d}.")))
            for d in spare[:2]
        ),
    )
    bad = Plan(plan.instance, (*plan.replicas, extra))
    found = rules(inst, bad)
    assert list(found) == ["replica-count"]


def test_instance_name_and_metrics(inst, plan):
    assert "instance" in rules(inst, Plan("other", plan.replicas))
    lying = plan.with_metrics(goodput=plan.metrics["goodput"] * 1.01)
    assert "metrics" in rules(inst, lying)
    assert validate(inst, plan.with_metrics(goodput=plan.metrics["goodput"])) == []


def test_every_rule_is_exercised():
    # keep RULES and this file in step: a new rule needs a test above
    tested = {
        "instance",
        "replica-count",
        "tp-allowed",
        "batch-range",
        "stage-count",
        "domain-unknown",
        "power-range",
        "board-power",
        "stage-size",
        "gpu-unknown",
        "gpu-failed",
        "gpu-outside-domain",
        "gpu-reused",
        "batch-sum",
        "rack-power",
        "site-power",
        "metrics",
    }
    assert tested == set(RULES)


def test_check_raises_with_every_violation(inst, plan):
    bad = replace_replica(plan, 0, tp=5)
    with pytest.raises(PlanError) as err:
        check(inst, bad)
    rules_hit = {v.rule for v in err.value.violations}
    assert {"tp-allowed", "stage-size"} <= rules_hit
    assert "replica 0" in str(err.value)


def test_empty_plan_is_the_paused_job(inst):
    ev = evaluate(inst, Plan(inst.name, ()))
    assert ev.feasible and ev.goodput == 0.0 and ev.gpus_used == 0
    # every healthy GPU idles at 10 % of TDP
    healthy = int(inst.arrays.healthy.sum())
    assert ev.site_power_w == pytest.approx(healthy * 1000.0 * 0.1)


def test_evaluate_power_accounting(inst, plan):
    ev = evaluate(inst, plan)
    a = inst.arrays
    used = {a.gpu_index[g]: s.power for r in plan.replicas for s in r.stages for g in s.gpus}
    expect = sum(
        1000.0 * (used[i] if i in used else (0.1 if a.healthy[i] else 0.0)) for i in range(a.n_gpus)
    )
    assert ev.site_power_w == pytest.approx(expect)
    assert sum(ev.rack_power_w) == pytest.approx(expect)
    assert ev.gpus_used == len(used)


def test_violations_come_in_plan_order(inst, plan):
    # replica 1 stage 0 borrows its first GPU from replica 0 stage 1 (another
    # domain, already used) and names an unknown GPU last: per stage, its
    # violations follow its GPUs in order, each GPU's rules in RULES order
    st = plan.replicas[1].stages[0]
    donor = plan.replicas[0].stages[1]
    gpus = (donor.gpus[0], *st.gpus[1:-1], "no-such-gpu")
    bad = replace_stage(plan, 1, 0, gpus=gpus, power=2.0)
    found = [(v.rule, v.replica, v.stage) for v in validate(inst, bad)]
    assert found[:4] == [
        ("power-range", 1, 0),
        ("gpu-outside-domain", 1, 0),
        ("gpu-reused", 1, 0),
        ("gpu-unknown", 1, 0),
    ]
    reused = next(v for v in validate(inst, bad) if v.rule == "gpu-reused")
    assert reused.message.endswith("is already used by replica 0 stage 1")
    assert reused.node == donor.gpus[0]


def test_checked_and_certify_serve_any_evaluator(inst, plan):
    from ntp_opt.rules.validate import certified, certify, checked

    assert checked(evaluate, inst, plan) == check(inst, plan)
    assert certify(evaluate, inst, plan) == certified(inst, plan)
    with pytest.raises(PlanError) as err:
        checked(evaluate, inst, Plan("other", plan.replicas))
    assert [v.rule for v in err.value.violations] == ["instance"]
