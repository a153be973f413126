"""Host-compact stages (ntp_opt.model.hosts) and where the export puts inactive ranks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ntp_opt import solve
from ntp_opt.app.export import (
    MegatronError,
    equal_batch,
    export_megatron,
    import_megatron,
    megatron_export,
)
from ntp_opt.app.importers import import_k8s
from ntp_opt.app.importers.cli import load_job
from ntp_opt.model import topology
from ntp_opt.model.hosts import host_splits, pack_hosts, pack_plan_hosts
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules.expected import expected_goodput
from ntp_opt.rules.validate import evaluate
from tests.strategies import instances, valid_plans

ROOT = Path(__file__).resolve().parents[2]
DGX256 = ROOT / "tests" / "fixtures" / "import" / "dgx-h100-k8s-256"


def _draws(inst: Instance, plan: Plan) -> np.ndarray:
    """Per rack, then the site: the power the plan draws (computed here from the arrays)."""
    a = inst.arrays
    job = inst.job
    watts = np.where(a.healthy, a.tdp * job.idle_power_fraction, 0.0)
    for rep in plan.replicas:
        for st_ in rep.stages:
            for g in st_.gpus:
                watts[a.gpu_index[g]] = a.tdp[a.gpu_index[g]] * st_.power
    per_rack = np.bincount(a.gpu_rack, weights=watts, minlength=len(a.rack_ids))
    return np.append(per_rack, watts.sum())


def _kinds(inst: Instance, stage: Stage) -> Counter[tuple[Any, ...]]:
    """The stage's GPUs by (domain, rack, speed, tdp, max power, tray risk-free)."""
    a = inst.arrays
    out: Counter[tuple[Any, ...]] = Counter()
    for g in stage.gpus:
        i = a.gpu_index[g]
        out[(a.gpu_domain[i], a.gpu_rack[i], a.speed[i], a.tdp[i], a.max_power[i])] += 1
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_packing_keeps_goodput_power_and_every_stage_s_kinds(data: st.DataObject) -> None:
    inst = data.draw(instances())
    plan = data.draw(valid_plans(inst))
    packed = pack_plan_hosts(inst, plan)
    before, after = evaluate(inst, plan), evaluate(inst, packed)
    assert after.feasible
    assert after.goodput == pytest.approx(before.goodput, rel=1e-12, abs=1e-12)
    assert np.allclose(_draws(inst, packed), _draws(inst, plan), rtol=1e-12)
    for rep0, rep1 in zip(plan.replicas, packed.replicas, strict=True):
        assert (rep0.tp, rep0.local_batch) == (rep1.tp, rep1.local_batch)
        for s0, s1 in zip(rep0.stages, rep1.stages, strict=True):
            assert (s0.domain, s0.power) == (s1.domain, s1.power)
            assert _kinds(inst, s0) == _kinds(inst, s1)
    assert pack_plan_hosts(inst, packed) == packed  # idempotent
    lay = Layout.from_plan(inst, plan)
    assert host_splits(inst, pack_hosts(inst, lay)) <= host_splits(inst, lay)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_rank_on_a_healthy_gpu_of_its_own(data: st.DataObject) -> None:
    inst = data.draw(instances())
    plan = data.draw(valid_plans(inst, min_replicas=1))
    spares = data.draw(st.sampled_from([[], ["spare1"], ["spare1", "spare2", "spare3"]]))
    try:
        ex = megatron_export(inst, plan, reorder=True, placeholder_hosts=spares)
    except MegatronError as err:
        rules = {v.rule for v in err.violations}
        assert rules <= {"megatron-degrees", "megatron-batch", "megatron-placeholders"}
        if "megatron-placeholders" in rules:  # only when the slots are really too few
            a = inst.arrays
            world = len(plan.replicas) * inst.job.pp * inst.job.tp
            named = len(spares) * int(np.bincount(a.gpu_tray).max())
            assert world > int(a.healthy.sum()) + named
        return
    a = inst.arrays
    planned = {
        g: (r, k)
        for r, rep in enumerate(plan.replicas)
        for k, s in enumerate(rep.stages)
        for g in s.gpus
    }
    slots = set()
    for row in ex.rows:
        assert (row.host, row.device) not in slots  # never two ranks on one GPU
        slots.add((row.host, row.device))
        if row.gpu is None:
            assert row.host in spares and not row.active
        else:
            assert a.healthy[a.gpu_index[row.gpu]]  # never a failed GPU
            assert row.active == (row.gpu in planned)
    if ex.torchrun_hosts is not None:  # each host's ranks one contiguous run
        for _, host, n, first in ex.torchrun_hosts:
            assert {r.host for r in ex.rows[first : first + n]} == {host}


def _nvl72_tp16(risky: bool = False) -> tuple[Instance, Plan]:
    """One NVL72 rack (18 trays of 4), TP16 reducible to 14, PP4: one TP14 replica whose
    four stages take every fourth GPU (each stage touches 14 trays)."""
    g = topology.gb200_nvl72(1)
    if risky:
        g.nodes["d0.t0"]["p_fail"] = 0.2
        g.nodes["d0.t5.g1"]["p_fail"] = 0.1
    job = Job(tp=16, tp_allowed=(14, 16), pp=4, dp=1, global_batch=8, batch_policy="elastic")
    inst = Instance("nvl72-tp16", g, job)
    gpus = topology.gpus(g)
    stages = tuple(Stage("d0", tuple(gpus[k::4][:14]), 1.0) for k in range(4))
    return inst, Plan(inst.name, (Replica(14, 8, stages),))


def test_nvl72_stages_packed_host_by_host_and_torchrun_launches() -> None:
    inst, plan = _nvl72_tp16()
    assert evaluate(inst, plan).feasible
    assert host_splits(inst, Layout.from_plan(inst, plan)) == 14
    packed = pack_plan_hosts(inst, plan)
    trays = [sorted({g.rsplit(".", 1)[0] for g in st_.gpus}) for st_ in packed.replicas[0].stages]
    # 14 GPUs = 3 whole trays + 2 GPUs of a fourth, whose other 2 stay idle
    assert [len(t) for t in trays] == [4, 4, 4, 4]
    assert len({t for ts in trays for t in ts}) == 16
    ex = megatron_export(inst, packed)
    assert ex.torchrun_hosts is not None and ex.torchrun_note == ""
    assert [n for _, _, n, _ in ex.torchrun_hosts] == [4] * 16  # 14 active + 2 inactive per stage
    for row in ex.rows:
        if not row.active:  # the stage's inactive ranks on its last host's idle GPUs
            block = [r for r in ex.rows if (r.dp, r.pp) == (row.dp, row.pp) and r.active]
            assert row.host == block[-1].host and row.gpu not in {r.gpu for r in block}
    # the unpacked plan: the same slots, but no torchrun
    ex0 = megatron_export(inst, plan)
    assert ex0.torchrun_hosts is None and "gaps" in ex0.torchrun_note


def test_a_plan_breaking_gpu_rules_comes_back_unchanged() -> None:
    inst, plan = _nvl72_tp16()
    st0, st1, *rest = plan.replicas[0].stages
    for bad in (
        Stage("d0", (*st0.gpus[:-1], st1.gpus[0]), 1.0),  # a GPU twice
        Stage("d0", (*st0.gpus[:-1], "no-such-gpu"), 1.0),  # an unknown GPU
        Stage("d9", st0.gpus, 1.0),  # an unknown domain
    ):
        wrong = Plan(plan.instance, (Replica(14, 8, (bad, st1, *rest)),))
        assert not evaluate(inst, wrong).feasible
        assert pack_plan_hosts(inst, wrong) is wrong


def test_packing_never_moves_gpus_of_trays_that_may_fail() -> None:
    inst, plan = _nvl72_tp16(risky=True)
    packed = pack_plan_hosts(inst, plan)
    owner0 = {g: k for k, s in enumerate(plan.replicas[0].stages) for g in s.gpus}
    owner1 = {g: k for k, s in enumerate(packed.replicas[0].stages) for g in s.gpus}
    for g in topology.gpus(inst.cluster):
        if g.startswith(("d0.t0.", "d0.t5.")):
            assert owner0.get(g) == owner1.get(g)
    assert owner0 != owner1  # the others did move
    for radius in ("gpu", "tray"):
        e0 = expected_goodput(inst, plan, method="exact", blast_radius=radius)
        e1 = expected_goodput(inst, packed, method="exact", blast_radius=radius)
        assert e1.mean == pytest.approx(e0.mean, rel=1e-12)


def test_solve_packs_hosts_and_exports_round_trip(tmp_path: Path) -> None:
    g = topology.gb200_nvl72(1)
    topology.fail_gpus(g, ["d0.t3.g1", "d0.t9.g2"])
    job = Job(tp=16, tp_allowed=(14, 16), pp=4, dp=1, global_batch=8, batch_policy="elastic")
    inst = Instance("nvl72-tp16", g, job)
    res = solve(inst, "ntp-pw")
    assert res.plan is not None
    assert host_splits(inst, Layout.from_plan(inst, res.plan)) == 0
    ex = export_megatron(inst, res.plan, tmp_path)
    assert ex.torchrun_hosts is not None
    assert import_megatron(tmp_path, inst).replicas == res.plan.replicas


# --- inactive ranks on idle GPUs of any host ---------------------------------------------


def _dgx(n: int, failed: list[str], tp: list[int]) -> tuple[Instance, Plan]:
    """``n`` DGX nodes (one domain each), TP8 PP1; replica r runs TP tp[r] on node r."""
    g = topology.dgx_h100(n)
    topology.fail_gpus(g, failed)
    job = Job(tp=8, tp_min=7, pp=1, dp=len(tp), global_batch=len(tp), batch_policy="elastic")
    inst = Instance("dgx", g, job)
    reps = []
    for r, t in enumerate(tp):
        gpus = [x for x in topology.gpus(g) if x.startswith(f"d{r}.") and x not in failed][:t]
        reps.append(Replica(t, 1, (Stage(f"d{r}", tuple(gpus), 1.0),)))
    return inst, Plan("dgx", tuple(reps))


def test_inactive_ranks_on_the_next_block_s_host_and_on_idle_hosts() -> None:
    # node 0 (one failed GPU) and node 1 run TP7, node 2 (two failed) is idle
    inst, plan = _dgx(3, ["d0.t0.g0", "d2.t0.g0", "d2.t0.g1"], [7, 7])
    ex = megatron_export(inst, plan)
    host = {row.rank: (row.host, row.gpu) for row in ex.rows}
    # rank 7 (node 0's inactive rank) precedes node 1's ranks 8..14 on node 1's idle GPU
    assert host[7] == ("d1.t0", "d1.t0.g7")
    # rank 15 (node 1's): no GPU left next to it; the idle node takes it
    assert host[15] == ("d2.t0", "d2.t0.g2")
    assert ex.torchrun_hosts == [(0, "d0.t0", 7, 0), (1, "d1.t0", 8, 7), (2, "d2.t0", 1, 15)]


def test_no_torchrun_when_an_idle_host_must_take_two_blocks_inactive_ranks() -> None:
    inst, plan = _dgx(3, ["d0.t0.g0", "d1.t0.g0", "d2.t0.g0", "d2.t0.g1"], [7, 7])
    ex = megatron_export(inst, plan)
    inactive = [row for row in ex.rows if not row.active]
    assert [(r.rank, r.host) for r in inactive] == [(7, "d2.t0"), (15, "d2.t0")]
    assert len({r.gpu for r in inactive}) == 2
    assert ex.torchrun_hosts is None
    assert "host d2.t0 holds ranks 7..15 with gaps" in ex.torchrun_note
    assert "inactive ranks" in ex.torchrun_note and "srun" in ex.torchrun_note


def test_named_hosts_only_when_the_cluster_is_short_or_they_keep_torchrun() -> None:
    inst, plan = _dgx(2, ["d0.t0.g0", "d1.t0.g0"], [7, 7])  # no healthy GPU left
    with pytest.raises(MegatronError) as err:
        megatron_export(inst, plan)
    assert err.value.violations[0].rule == "megatron-placeholders"
    assert "0 healthy GPUs no active rank uses" in str(err.value)
    ex = megatron_export(inst, plan, placeholder_hosts=["spare1", "spare2"], placeholder_gpus=8)
    assert [(r.rank, r.host, r.device) for r in ex.rows if not r.active] == [
        (7, "spare1", 0),
        (15, "spare2", 0),
    ]
    # node 2 idle: it takes rank 7 (rank 15 would break its run): spare1 keeps torchrun
    inst, plan = _dgx(3, ["d0.t0.g0", "d1.t0.g0"], [7, 7])
    ex = megatron_export(inst, plan, placeholder_hosts=["spare1"])
    assert [(r.rank, r.host) for r in ex.rows if not r.active] == [(7, "d2.t0"), (15, "spare1")]
    assert ex.torchrun_hosts is not None
    # node 1 has room for rank 7, the idle node 2 for rank 15: spare1 stays unused
    inst, plan = _dgx(3, ["d0.t0.g0"], [7, 7])
    ex = megatron_export(inst, plan, placeholder_hosts=["spare1"])
    assert [(r.rank, r.host) for r in ex.rows if not r.active] == [(7, "d1.t0"), (15, "d2.t0")]
    assert ex.torchrun_hosts is not None


# --- the DGX H100 Kubernetes fixture --------------------------------------------------------


def _dgx256(job: str) -> Instance:
    cluster = import_k8s(
        DGX256 / "nodes.json",
        nvidia_smi=DGX256 / "nvidia-smi",
        rack_label="example.com/rack",
        warn=lambda _: None,
        name="dgx256",
    )
    return Instance("dgx256", cluster, load_job(DGX256 / job))


def test_dgx256_fixture_has_34_failed_gpus_in_four_racks() -> None:
    inst = _dgx256("job-elastic.json")
    a = inst.arrays
    assert (a.n_gpus, int((~a.healthy).sum())) == (256, 34)
    assert (len(a.tray_ids), a.n_domains, len(a.rack_ids)) == (32, 32, 4)
    per_host = Counter(a.tray_ids[t] for t in a.gpu_tray[~a.healthy])
    assert per_host["h100-011"] == 8
    assert {h for h, n in per_host.items() if n == 2} == {
        "h100-006",
        "h100-015",
        "h100-027",
        "h100-029",
    }
    assert sorted(per_host.values()).count(1) == 18


@pytest.mark.parametrize(
    ("job", "policy"), [("job-elastic.json", "ntp-pw"), ("job-elastic.json", "optimal")]
)
def test_dgx256_exports_without_extra_hosts(job: str, policy: str) -> None:
    inst = _dgx256(job)
    res = solve(inst, policy, time_limit=10)
    assert res.plan is not None and res.plan.replicas
    plan = equal_batch(inst, res.plan)  # as export --equal-batch
    ex = megatron_export(inst, plan, reorder=True)
    a = inst.arrays
    seen = set()
    for row in ex.rows:
        assert row.gpu is not None  # every rank on a GPU of the cluster
        i = a.gpu_index[row.gpu]
        assert a.healthy[i] and row.gpu not in seen
        seen.add(row.gpu)
    assert len(ex.rows) == 8 * 4 * len(plan.replicas)


def test_dgx256_fixed_job_pauses() -> None:
    # B = 512 needs 8 replicas of at most 64; only 27 nodes have 7 healthy GPUs (6 replicas)
    res = solve(_dgx256("job-fixed.json"), "optimal", time_limit=10)
    assert res.status == "optimal" and res.plan is not None and res.plan.replicas == ()
