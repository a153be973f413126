"""Megatron-LM NTP export: restrictions, launch files, power limits, round trips.

Expected values are worked out by hand in the comments (docs/model.md, spec section 3:
``v_r = t_r / T * slowest / c``, ``theta = max_r b_r / v_r * (1 + rho [some
t_r < T])``, goodput ``= sum_r b_r / theta``) or come from the independent
brute-force planner (tests/bruteforce.py), never from the code under test.

Rank numbering (Megatron's ``tp-cp-ep-pp-dp``, ``--use-tp-pp-dp-mapping``):
``rank = tp + T * (pp + PP * dp)``. Whether Megatron's own functions derive
the plan from an export is tests/planners/test_megatron_conformance.py's job.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import networkx as nx
import pytest

from ntp_opt.app.cli import main
from ntp_opt.app.export import (
    ARGS_NAME,
    CONFIG_NAME,
    EXTRAS_NAME,
    HOSTFILE_NAME,
    POWER_RESTORE_NAME,
    POWER_SET_NAME,
    RANKS_NAME,
    TORCHRUN_HOSTS_NAME,
    equal_batch,
    export_megatron,
    import_megatron,
    megatron_export,
    read_config_module,
)
from ntp_opt.model import topology
from ntp_opt.model.files import InputError, load_instance, save_instance, save_plan
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.planners.megatron import (
    MegatronError,
    launch_batch,
    launch_counts,
    megatron_compatible,
    megatron_order,
    solve_megatron,
)
from ntp_opt.rules.validate import PlanError, certified, evaluate
from ntp_opt.solve import Result, solve
from tests.bruteforce import brute_force
from tests.helpers import HANG_GUARD, make_instance

ROOT = Path(__file__).resolve().parents[2]
TL = HANG_GUARD  # every exact solve here finishes; the limit only guards against a hang


@functools.cache
def _library(name: str) -> Instance:
    """A bundled instance, loaded once for the file (the tests only read it)."""
    return load_instance(ROOT / "instances" / name)


@functools.cache
def _solved(name: str, solver: str) -> Result:
    """One solve of a bundled instance per planner for the whole file: the exact
    planners are deterministic without a time limit (threads=1), so the tests that
    need the same solve share it instead of repeating it."""
    return solve(_library(name), solver, time_limit=TL)


def _gpus(domain: int, ranks: list[int], tray: int = 4) -> tuple[str, ...]:
    """GPU ids of local ranks in ``build_cluster(..., size, tray, ...)`` graph order."""
    return tuple(f"d{domain}.t{r // tray}.g{r % tray}" for r in ranks)


@pytest.fixture
def hand() -> Instance:
    """3 domains of 8 GPUs (trays of 4), d0.t0.g2 and d0.t1.g1 failed; TP8 allowing 6."""
    g = topology.build_cluster(3, 8, 4, 2)
    topology.fail_gpus(g, ["d0.t0.g2", "d0.t1.g1"])
    job = Job(
        tp=8,
        tp_min=6,
        tp_allowed=(6, 8),
        pp=1,
        dp=2,
        global_batch=8,
        max_local_batch=5,
        max_boost=0.0,
    )
    return Instance("hand", g, job)


def _hand_plan(
    hand: Instance, reduced_first: bool = True, batches: tuple[int, int] = (4, 4)
) -> Plan:
    # replica TP6 on d0's six healthy GPUs (local ranks 0,1,3,4,6,7), TP8 on d1
    small = Replica(6, batches[0], (Stage("d0", _gpus(0, [0, 1, 3, 4, 6, 7])),))
    full = Replica(8, batches[1], (Stage("d1", _gpus(1, list(range(8)))),))
    reps = (small, full) if reduced_first else (full, small)
    return certified(hand, Plan("hand", reps))


# --- the configuration and the rank table, by hand ---------------------------------


def test_hand_config(hand: Instance, tmp_path: Path) -> None:
    ex = megatron_export(hand, _hand_plan(hand))
    want = {
        "tp_base": 8,
        "tp_spares": 2,
        "num_reduced_tp_dp_ranks": 1,  # PP 1 x 1 reduced replica
        "non_active_ranks_per_dp": {(0, 0, 0): [6, 7]},
    }
    assert ex.ntp_kwargs == want
    # PP = 1: the default rank order is the same, no mapping flag
    assert ex.megatron_args == [
        "--tensor-model-parallel-size",
        "8",
        "--pipeline-model-parallel-size",
        "1",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "1",  # the job's default micro_batch
    ]
    e = ex.extras
    assert (e["world_size"], e["data_parallel_size"], e["local_batch"]) == (16, 2, 4)
    assert e["tp_per_dp"] == [6, 8] and e["placeholder_ranks"] == 2 and e["power_boost"] is False
    export_megatron(hand, _hand_plan(hand), tmp_path)
    assert read_config_module(tmp_path / CONFIG_NAME) == want
    # the module builds NonuniformTPConfig with exactly these keyword arguments
    seen: dict[str, Any] = {}
    fake = types.ModuleType("megatron.core.distributed.nonuniform_tp")
    fake.NonuniformTPConfig = lambda **kw: seen.update(kw) or "cfg"  # type: ignore[attr-defined]
    names = ["megatron", "megatron.core", "megatron.core.distributed", fake.__name__]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names[:-1]:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[fake.__name__] = fake
    try:
        ns: dict[str, Any] = {}
        exec((tmp_path / CONFIG_NAME).read_text(), ns)
        assert ns["ntp_config"]() == "cfg"
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    assert seen == want and isinstance(next(iter(seen["non_active_ranks_per_dp"])), tuple)
    # only Megatron's fields in the module; the rest in the sidecar
    assert "local_batch" not in (tmp_path / CONFIG_NAME).read_text()
    assert json.loads((tmp_path / EXTRAS_NAME).read_text())["local_batch"] == 4


def test_hand_rank_table(hand: Instance) -> None:
    rows = megatron_export(hand, _hand_plan(hand)).rows
    assert [r.rank for r in rows] == list(range(16))
    # dp 0: active local ranks 0..5, host by host, each host's GPUs by device index
    assert [(r.gpu, r.host, r.device) for r in rows[:6]] == [
        ("d0.t0.g0", "d0.t0", 0),
        ("d0.t0.g1", "d0.t0", 1),
        ("d0.t0.g3", "d0.t0", 3),
        ("d0.t1.g0", "d0.t1", 0),
        ("d0.t1.g2", "d0.t1", 2),
        ("d0.t1.g3", "d0.t1", 3),
    ]
    assert all(r.active and r.dp == 0 and r.pp == 0 for r in rows[:6])
    # inactive ranks 6, 7 go to a host that runs no active rank: d2 is unused,
    # its first tray d2.t0, devices 0 and 1
    assert [(r.host, r.device, r.gpu, r.active, r.tp) for r in rows[6:8]] == [
        ("d2.t0", 0, "d2.t0.g0", False, 6),
        ("d2.t0", 1, "d2.t0.g1", False, 7),
    ]
    assert rows[6].power is None and rows[6].power_w is None
    # rank 13 = tp 5 of dp 1: d1's tray 1, device 1
    r13 = rows[13]
    assert (r13.dp, r13.tp, r13.gpu, r13.host, r13.device) == (1, 5, "d1.t1.g1", "d1.t1", 1)
    assert r13.power == 1.0 and r13.power_w == 1000


def test_rank_order_pp(tmp_path: Path) -> None:
    # pp = 2, dp = 2, T = 4: rank of (dp, pp, tp) is tp + 4 (pp + 2 dp)
    g = topology.build_cluster(4, 4, 4, 1)
    job = Job(tp=4, tp_min=3, pp=2, dp=2, global_batch=4, max_boost=0.0)
    inst = Instance("pp", g, job)
    stages = [Stage(f"d{i}", _gpus(i, [0, 1, 2, 3])) for i in range(4)]
    plan = certified(
        inst,
        Plan("pp", (Replica(4, 2, (stages[0], stages[1])), Replica(4, 2, (stages[2], stages[3])))),
    )
    ex = megatron_export(inst, plan)
    by_rank = {r.rank: (r.dp, r.pp, r.tp, r.gpu) for r in ex.rows}
    assert by_rank[0] == (0, 0, 0, "d0.t0.g0")
    assert by_rank[4] == (0, 1, 0, "d1.t0.g0")  # dp 0 stage 1
    assert by_rank[8] == (1, 0, 0, "d2.t0.g0")  # dp 1 stage 0
    assert by_rank[15] == (1, 1, 3, "d3.t0.g3")
    assert ex.ntp_kwargs["tp_spares"] == 0 and ex.ntp_kwargs["non_active_ranks_per_dp"] is None
    assert ex.ntp_kwargs["num_reduced_tp_dp_ranks"] == 0
    assert "--use-tp-pp-dp-mapping" in ex.megatron_args


def test_pp2_reduced_blocks() -> None:
    # PP2: replica 0 at TP3 (d0 has a failed GPU, d1 one too), replica 1 at TP4.
    # Blocks of 4 ranks: replica 0 = blocks 0, 1, so num_reduced_tp_dp_ranks = 2
    g = topology.build_cluster(4, 4, 4, 1)
    topology.fail_gpus(g, ["d0.t0.g3", "d1.t0.g0"])
    job = Job(tp=4, tp_min=3, pp=2, dp=2, global_batch=4, max_boost=0.0)
    inst = Instance("pp2r", g, job)
    plan = certified(
        inst,
        Plan(
            "pp2r",
            (
                Replica(3, 2, (Stage("d0", _gpus(0, [0, 1, 2])), Stage("d1", _gpus(1, [1, 2, 3])))),
                Replica(
                    4, 2, (Stage("d2", _gpus(2, [0, 1, 2, 3])), Stage("d3", _gpus(3, [0, 1, 2, 3])))
                ),
            ),
        ),
    )
    ex = megatron_export(inst, plan, placeholder_hosts=["spare-a", "spare-b"])
    assert ex.ntp_kwargs == {
        "tp_base": 4,
        "tp_spares": 1,
        "num_reduced_tp_dp_ranks": 2,
        "non_active_ranks_per_dp": {(0, 0, 0): [3], (0, 0, 1): [3]},
    }
    # ranks 3 and 7 are the inactive ones, each on its own placeholder host
    inactive = [(r.rank, r.host, r.device) for r in ex.rows if not r.active]
    assert inactive == [(3, "spare-a", 0), (7, "spare-b", 0)]
    assert [r.gpu for r in ex.rows[4:7]] == list(_gpus(1, [1, 2, 3]))


# --- restrictions ------------------------------------------------------------------


def test_order_error_and_reorder(hand: Instance) -> None:
    plan = _hand_plan(hand, reduced_first=False)
    problems = megatron_compatible(hand, plan)
    assert [v.rule for v in problems] == ["megatron-order"]
    assert "replica 1" in problems[0].message
    # the CLI option first, the function for Python callers
    assert "export with --reorder" in problems[0].message
    assert "ntp_opt.planners.megatron.megatron_order" in problems[0].message
    with pytest.raises(MegatronError, match="megatron-order"):
        megatron_export(hand, plan)
    ex = megatron_export(hand, plan, reorder=True)
    assert ex.extras["tp_per_dp"] == [6, 8]  # the reduced replica moved first
    assert megatron_order(plan, 8).replicas == _hand_plan(hand).replicas


def test_two_reduced_degrees_named() -> None:
    # d0 has 1 failed GPU (TP7 fits), d1 has 2 (TP6); both reduced, two degrees
    g = topology.build_cluster(3, 8, 4, 2)
    topology.fail_gpus(g, ["d0.t0.g0", "d1.t0.g0", "d1.t0.g1"])
    job = Job(tp=8, tp_min=6, pp=1, dp=3, global_batch=9, max_local_batch=4, max_boost=0.0)
    inst = Instance("two", g, job)
    plan = certified(
        inst,
        Plan(
            "two",
            (
                Replica(7, 3, (Stage("d0", _gpus(0, list(range(1, 8)))),)),
                Replica(6, 3, (Stage("d1", _gpus(1, list(range(2, 8)))),)),
                Replica(8, 3, (Stage("d2", _gpus(2, list(range(8)))),)),
            ),
        ),
    )
    with pytest.raises(MegatronError) as err:
        megatron_export(inst, plan)
    assert [v.rule for v in err.value.violations] == ["megatron-degrees"]
    assert "[7, 6]" in str(err.value) and "tp_base=8" in str(err.value)


def test_batch_refused_and_equal_batch(hand: Instance) -> None:
    plan = _hand_plan(hand, batches=(3, 5))
    with pytest.raises(MegatronError) as err:
        megatron_export(hand, plan)
    assert [v.rule for v in err.value.violations] == ["megatron-batch"]
    assert "[3, 5]" in str(err.value) and "micro-batch calculator" in str(err.value)
    # fixed B = 8 over 2 replicas: 4 each; TP6 replica speed 6/8 (c = 1), TP8 speed 1
    # theta = max(4 / 0.75, 4 / 1) * 1.01 = 5.3867, goodput 8 / theta = 1.48515
    eq = equal_batch(hand, plan)
    assert [r.local_batch for r in eq.replicas] == [4, 4]
    assert eq.metrics["goodput"] == pytest.approx(8 / (4 / 0.75 * 1.01))
    assert megatron_export(hand, eq).extras["global_batch"] == 8


def test_equal_batch_rebalances_power() -> None:
    # TP3 on d0 (one failed GPU) and TP4 on d1, elastic B = 4, at most 2 each.
    # Equal batch b = min(2, 4 // 2) = 2; the TP3 replica needs pi = (4/3)^(1/0.65)
    # = 1.557 to keep up, more than 1 + max_boost, so it gets 1.3 (rack d0:
    # 3 x 1300 W <= 4000 W; site 3900 + 4000 <= 8000 W): v = 0.75 x 1.3^0.65.
    g = topology.build_cluster(2, 4, 2, 2)
    topology.fail_gpus(g, ["d0.t0.g0"])
    job = Job(
        tp=4, tp_min=3, pp=1, dp=2, global_batch=4, max_local_batch=2,
        batch_policy="elastic", max_boost=0.3,
    )  # fmt: skip
    inst = Instance("eq", g, job)
    plan = certified(
        inst,
        Plan(
            "eq",
            (
                Replica(3, 1, (Stage("d0", ("d0.t0.g1", "d0.t1.g0", "d0.t1.g1")),)),
                Replica(4, 2, (Stage("d1", _gpus(1, [0, 1, 2, 3], tray=2)),)),
            ),
        ),
    )
    eq = equal_batch(inst, plan)
    assert [r.local_batch for r in eq.replicas] == [2, 2]
    assert eq.replicas[0].stages[0].power == pytest.approx(1.3, abs=1e-6)
    assert eq.replicas[1].stages[0].power == pytest.approx(1.0)
    v = 0.75 * 1.3**0.65
    assert eq.metrics["goodput"] == pytest.approx(4 / (2 / v * 1.01), rel=1e-6)


def test_empty_refused(hand: Instance) -> None:
    empty = certified(hand, Plan("hand", ()))
    assert [v.rule for v in megatron_compatible(hand, empty)] == ["megatron-empty"]
    with pytest.raises(MegatronError, match="paused"):
        megatron_export(hand, empty)


def test_placeholders_need_idle_hosts() -> None:
    # one domain of 8 GPUs on 2 hosts, one failed; TP8 allowing 7: the TP7 replica
    # uses both hosts, so its inactive rank 7 has no idle host in the cluster
    g = topology.build_cluster(1, 8, 4, 2)
    topology.fail_gpus(g, ["d0.t1.g3"])
    job = Job(tp=8, tp_min=7, pp=1, dp=1, global_batch=1, max_boost=0.0)
    inst = Instance("ph", g, job)
    plan = certified(inst, Plan("ph", (Replica(7, 1, (Stage("d0", _gpus(0, list(range(7)))),)),)))
    with pytest.raises(MegatronError) as err:
        megatron_export(inst, plan)
    assert [v.rule for v in err.value.violations] == ["megatron-placeholders"]
    assert "--placeholder-hosts" in str(err.value)
    with pytest.raises(MegatronError, match="run active ranks"):
        megatron_export(inst, plan, placeholder_hosts=["d0.t1"])
    ex = megatron_export(inst, plan, placeholder_hosts=["cpu-node"])
    assert [(r.rank, r.host, r.device, r.gpu) for r in ex.rows if not r.active] == [
        (7, "cpu-node", 0, None)
    ]


def test_infeasible_and_foreign_plan_refused(hand: Instance) -> None:
    # d0.t0.g2 has failed: the validator's error comes first
    bad = Plan("hand", (Replica(6, 4, (Stage("d0", _gpus(0, [0, 1, 2, 3, 4, 5])),)),))
    with pytest.raises(PlanError, match="gpu-failed"):
        megatron_export(hand, bad)
    other = Plan("other", _hand_plan(hand).replicas)
    with pytest.raises(PlanError, match="instance"):
        megatron_export(hand, other)


# --- host names, device indices and power limits ---------------------------------------


def _boost_instance() -> Instance:
    """2 domains of 4 GPUs (trays of 2), d0.t0.g0 failed; TP4 allowing 3; real host names."""
    g = topology.build_cluster(2, 4, 2, 2)
    topology.fail_gpus(g, ["d0.t0.g0"])
    for tray, host in (("d0.t0", "node-a"), ("d0.t1", "node-b"), ("d1.t0", "node-c")):
        g.nodes[tray]["host"] = host
    g.nodes["d1.t1.g0"]["host"] = "node-d"  # a GPU's own host wins over its tray's
    g.nodes["d1.t1.g1"]["host"] = "node-d"
    g.nodes["d0.t1.g0"]["index"] = 1  # devices of node-b swapped
    g.nodes["d0.t1.g1"]["index"] = 0
    g.nodes["d0.t1.g1"]["max_power_w"] = 1250.0  # a board limit above the asked 1200 W
    job = Job(tp=4, tp_min=3, pp=1, dp=2, global_batch=4, max_local_batch=2, max_boost=0.3)
    return Instance("boost", g, job)


def _boost_plan(inst: Instance) -> Plan:
    return certified(
        inst,
        Plan(
            "boost",
            (
                Replica(3, 2, (Stage("d0", ("d0.t0.g1", "d0.t1.g0", "d0.t1.g1"), 1.2),)),
                Replica(4, 2, (Stage("d1", _gpus(1, [0, 1, 2, 3], tray=2)),)),
            ),
        ),
    )


def test_hosts_devices_and_power(tmp_path: Path) -> None:
    inst = _boost_instance()
    # TP3 on d0 at 1.2 x TDP: 3 x 1200 W + 0 (failed) <= 4 x 1000 W rack budget
    plan = _boost_plan(inst)
    ex = export_megatron(inst, plan, tmp_path, placeholder_hosts=["spare"])
    got = [(r.rank, r.host, r.device, r.gpu, r.power_w) for r in ex.rows]
    assert got == [
        (0, "node-a", 1, "d0.t0.g1", 1200),  # floor(1.2 x 1000)
        (1, "node-b", 0, "d0.t1.g1", 1200),  # within its max_power_w
        (2, "node-b", 1, "d0.t1.g0", 1200),
        (3, "spare", 0, None, None),
        (4, "node-c", 0, "d1.t0.g0", 1000),
        (5, "node-c", 1, "d1.t0.g1", 1000),
        (6, "node-d", 0, "d1.t1.g0", 1000),
        (7, "node-d", 1, "d1.t1.g1", 1000),
    ]
    assert (tmp_path / HOSTFILE_NAME).read_text().split() == [
        "node-a", "node-b", "node-b", "spare", "node-c", "node-c", "node-d", "node-d"
    ]  # fmt: skip
    power = (tmp_path / POWER_SET_NAME).read_text()
    assert "node-a)\n  nvidia-smi -i 1 -pl 1200\n  ;;" in power
    assert "node-b)\n  nvidia-smi -i 0 -pl 1200\n  nvidia-smi -i 1 -pl 1200\n  ;;" in power
    assert "node-c" not in power  # not boosted
    restore = (tmp_path / POWER_RESTORE_NAME).read_text()
    assert "node-b)\n  nvidia-smi -i 0 -pl 1000\n  nvidia-smi -i 1 -pl 1000\n  ;;" in restore
    hosts = (tmp_path / TORCHRUN_HOSTS_NAME).read_text().splitlines()[1:]
    assert hosts == ["0 node-a 1 0", "1 node-b 2 1", "2 spare 1 3", "3 node-c 2 4", "4 node-d 2 6"]
    args = (tmp_path / ARGS_NAME).read_text().split()
    assert args[args.index("--global-batch-size") + 1] == "4"  # global batch 2 x 2
    # power-limits alone, for any valid plan; this instance file has no host,
    # index or max_power_w attributes: hosts are trays, devices tray positions
    plain = Instance("boost", topology.build_cluster(2, 4, 2, 2), inst.job)
    topology.fail_gpus(plain.cluster, ["d0.t0.g0"])
    save_instance(plain, tmp_path / "i.json")
    save_plan(plan, tmp_path / "p.json")
    argv = ["export", "--to", "power-limits", str(tmp_path / "p.json")]
    assert main([*argv, "--instance", str(tmp_path / "i.json"), "-o", str(tmp_path / "pw")]) == 0
    power = (tmp_path / "pw" / POWER_SET_NAME).read_text()
    want = "d0.t0)\n  nvidia-smi -i 1 -pl 1200\n  ;;\nd0.t1)\n  nvidia-smi -i 0 -pl 1200\n"
    assert want + "  nvidia-smi -i 1 -pl 1200\n  ;;\n*) ;;" in power


def test_duplicate_device_refused() -> None:
    inst = _boost_instance()
    inst.cluster.nodes["d0.t1.g1"]["index"] = 1  # two GPUs of node-b at device 1
    with pytest.raises(MegatronError, match="both device 1 of host 'node-b'"):
        megatron_export(inst, _boost_plan(inst), placeholder_hosts=["spare"])


def _raw_instance(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """GPU attributes and GPU -> tray straight from the instance JSON."""
    data = json.loads(path.read_text())
    nodes = {str(n["id"]): n for n in data["cluster"]["nodes"]}
    tray_of = {}
    for e in data["cluster"]["edges"]:
        a, b = str(e["source"]), str(e["target"])
        for x, y in ((a, b), (b, a)):
            if nodes[x]["kind"] == "gpu" and nodes[y]["kind"] == "tray":
                tray_of[x] = y
    return nodes, tray_of


def test_default_launch_files(tmp_path: Path) -> None:
    """Every rank of default.json's export on a healthy GPU of its planned host, once.

    Checked from the instance and plan JSON files and the launcher files alone.
    """
    inst = load_instance(ROOT / "instances" / "default.json")
    res = solve(inst, "megatron-ntp-reordered")
    assert res.plan is not None
    save_plan(res.plan, tmp_path / "plan.json")
    out = tmp_path / "out"
    spares = [f"spare{i}" for i in range(64)]
    argv = ["export", "--to", "megatron-ntp", str(tmp_path / "plan.json"), "--instance"]
    argv += [str(ROOT / "instances" / "default.json"), "-o", str(out)]
    assert main([*argv, "--placeholder-hosts", ",".join(spares)]) == 0
    nodes, tray_of = _raw_instance(ROOT / "instances" / "default.json")
    plan = json.loads((tmp_path / "plan.json").read_text())
    # device index = position in the tray, in the file's node order
    position: dict[str, int] = {}
    count: dict[str, int] = {}
    for gid, n in nodes.items():
        if n["kind"] == "gpu":
            position[gid] = count.get(tray_of[gid], 0)
            count[tray_of[gid]] = position[gid] + 1
    stage_of = {
        str(g): (r, k)
        for r, rep in enumerate(plan["replicas"])
        for k, st in enumerate(rep["stages"])
        for g in st["gpus"]
    }
    hostfile = (out / HOSTFILE_NAME).read_text().split()
    lines = [ln.split() for ln in (out / RANKS_NAME).read_text().splitlines()[1:]]
    world = 16 * 8 * 32
    assert len(hostfile) == len(lines) == world
    used: set[tuple[str, int]] = set()
    active_hosts, placed = set(), set()
    for rank, (line, host) in enumerate(zip(lines, hostfile, strict=True)):
        r, h, dev, gpu, _dom, dp, pp, tp, active = line[:9]
        assert int(r) == rank and h == host
        assert int(tp) + 32 * (int(pp) + 8 * int(dp)) == rank
        assert (host, int(dev)) not in used  # each GPU at most once
        used.add((host, int(dev)))
        if active == "1":
            assert nodes[gpu]["state"] == "healthy"
            assert stage_of[gpu] == (int(dp), int(pp))  # the plan's replica and stage
            assert host == tray_of[gpu] and int(dev) == position[gpu]  # its planned host
            active_hosts.add(host)
            placed.add(gpu)
        elif gpu == "-":  # a named placeholder host
            assert host in spares
        else:  # an idle healthy GPU of the cluster, on its own host
            assert nodes[gpu]["state"] == "healthy" and gpu not in stage_of
            assert host == tray_of[gpu] and int(dev) == position[gpu]
    assert placed == set(stage_of)  # every planned GPU has its rank
    assert not active_hosts & set(spares)
    # torchrun: node ranks in order, each host's ranks contiguous, same hosts
    rows = [ln.split() for ln in (out / TORCHRUN_HOSTS_NAME).read_text().splitlines()[1:]]
    covered: list[int] = []
    for n, (node_rank, host, nproc, first) in enumerate(rows):
        assert int(node_rank) == n and int(first) == len(covered)
        covered += range(int(first), int(first) + int(nproc))
        assert {hostfile[x] for x in range(int(first), int(first) + int(nproc))} == {host}
    assert covered == list(range(world))


# --- the optimal-megatron planner ----------------------------------------------------


def _two_domains() -> Instance:
    """d0: 3 healthy of 4, d1: 2 healthy of 4; T=4 with 2, 3 allowed; no boost, rho=0.

    Unrestricted (hand): TP3 (v=0.75) + TP2 (v=0.5), elastic B=5, cap 3: at
    theta=4 the batches are 3 (cap) and 2, goodput 5/4 = 1.25 (theta=8/3 gives
    3/2.667=1.125, theta=2 gives 1, either alone 0.75).
    Megatron (one reduced degree): t=3 runs only d0 (0.75); t=2 runs TP2 on
    both domains, v=0.5 each: b each, theta=2b, goodput 1.0.
    """
    g = topology.build_cluster(2, 4, 2, 2)
    topology.fail_gpus(g, ["d0.t0.g0", "d1.t0.g0", "d1.t0.g1"])
    job = Job(
        tp=4,
        tp_min=2,
        pp=1,
        dp=2,
        global_batch=5,
        max_local_batch=3,
        batch_policy="elastic",
        max_boost=0.0,
        reshard_overhead=0.0,
    )
    return Instance("two-domains", g, job)


def test_optimal_megatron_hand() -> None:
    inst = _two_domains()
    free = solve(inst, "optimal", time_limit=TL)
    meg = solve(inst, "optimal-megatron", time_limit=TL)
    assert free.status == "optimal" and meg.status == "optimal"
    assert free.objective == pytest.approx(1.25, rel=1e-6)
    assert meg.objective == pytest.approx(1.0, rel=1e-6)
    assert meg.plan is not None and megatron_compatible(inst, meg.plan) == []
    assert sorted(r.tp for r in meg.plan.replicas) == [2, 2]


#: (seed, policy, max_boost, stragglers, micro_batch) of the random brute-force cases
LAUNCH_CASES = [
    (0, "fixed", 0.3, 0, 1),
    (1, "fixed", 0.0, 2, 1),
    (2, "fixed", 0.3, 2, 1),
    (3, "elastic", 0.3, 0, 1),
    (4, "elastic", 0.0, 2, 1),
    (5, "elastic", 0.3, 2, 2),
    (6, "fixed", 0.3, 1, 2),
]


def _launch_problems(inst: Instance, plan: Plan) -> list[str]:
    """Megatron's restrictions ``plan`` breaks, but ``megatron-slots``: four TP2
    replicas of TP4 need 16 slots on 12 GPUs, and the export puts the inactive
    ranks on placeholder hosts."""
    found = megatron_compatible(inst, plan, uniform_batch=True)
    return [v.rule for v in found if v.rule != "megatron-slots"]


@pytest.mark.parametrize(("seed", "policy", "boost", "stragglers", "mbs"), LAUNCH_CASES)
def test_optimal_megatron_against_brute_force(
    seed: int, policy: str, boost: float, stragglers: int, mbs: int, tmp_path: Path
) -> None:
    # 3 domains of 4 GPUs, 3 random failures, TP4 allowing 2 and 3, up to 4 replicas of
    # at most 3 sequences, B = 6: fixed admits 2 x 3 and 3 x 2 (micro-batch 2: 3 x 2 only)
    inst = make_instance(
        domains=3,
        size=4,
        tray=2,
        failed=3,
        stragglers=stragglers,
        seed=seed,
        name=f"bf{seed}",
        tp=4,
        tp_min=2,
        pp=1,
        dp=3,
        dp_max=4,
        global_batch=6,
        max_local_batch=3,
        batch_policy=policy,
        max_boost=boost,
        micro_batch=mbs,
    )
    # the reference: every launchable plan (one reduced degree, one batch), enumerated
    want, ref = brute_force(inst, launchable=True)
    free, _ = brute_force(inst)
    assert want <= free * (1 + 1e-9)
    if ref.replicas:  # the reference's own restriction, checked by the package's rules
        assert _launch_problems(inst, megatron_order(ref, 4)) == []
    res = solve(inst, "optimal-megatron", time_limit=TL)
    assert res.plan is not None and res.objective is not None
    assert res.status == "optimal"
    assert res.objective == pytest.approx(want, rel=1e-5, abs=1e-12)
    # the bound is a goodput of this instance (sequences/s), not of a derived one
    assert res.bound is not None and res.bound == pytest.approx(want, rel=1e-5, abs=1e-12)
    assert evaluate(inst, res.plan).feasible
    if not res.plan.replicas:
        return
    assert _launch_problems(inst, res.plan) == []
    spares = [f"spare{i}" for i in range(8)]
    ex = export_megatron(inst, res.plan, tmp_path, placeholder_hosts=spares)  # no equal_batch
    b = res.plan.replicas[0].local_batch
    assert b % mbs == 0 and ex.extras["local_batch"] == b
    assert ex.megatron_args[ex.megatron_args.index("--micro-batch-size") + 1] == str(mbs)
    if boost == 0.0:
        assert all(st.power == 1.0 for r in res.plan.replicas for st in r.stages)


def test_launch_batch() -> None:
    fixed = Job(tp=4, pp=1, dp=4, dp_max=6, global_batch=24, max_local_batch=8)
    # 24 = n b with b <= 8: n in {3, 4, 6} (b 8, 6, 4); n = 8, 12, 24 exceed dp_max
    assert [launch_batch(fixed, n) for n in range(1, 8)] == [None, None, 8, 6, None, 4, None]
    assert launch_counts(fixed) == [3, 4, 6]
    mb4 = fixed.model_copy(update={"micro_batch": 4})  # 6 is not a multiple of 4
    assert launch_counts(mb4) == [3, 6]
    elastic = fixed.model_copy(update={"batch_policy": "elastic", "micro_batch": 3})
    # b = 3 floor(min(8, 24 // n) / 3): n=1..3 -> 6, n=4 -> 6, n=5 (24//5=4) -> 3, n=6 -> 3
    assert [launch_batch(elastic, n) for n in range(1, 8)] == [6, 6, 6, 6, 3, 3, None]
    assert launch_counts(elastic) == [1, 2, 3, 4, 5, 6]
    big = elastic.model_copy(update={"micro_batch": 9})  # above max_local_batch: none
    assert launch_counts(big) == [] and launch_batch(big, 1) is None


def _three_domains(global_batch: int, max_local_batch: int) -> Instance:
    """d0: 4 healthy, d1: 3, d2: 2; T=4 allowing 3; fixed; no boost, rho=0; dp 3.

    At most two replicas fit (one stage of degree >= 3 in d0 and in d1): TP4 on d0
    (v=1) and TP3 on d1 (v=0.75). One local batch b: theta = b / 0.75, goodput
    2 b / theta = 1.5 whatever b is; one replica alone: TP4 on d0, goodput 1.0.
    """
    g = topology.build_cluster(3, 4, 2, 2)
    topology.fail_gpus(g, ["d1.t0.g0", "d2.t0.g0", "d2.t0.g1"])
    job = Job(
        tp=4,
        tp_min=3,
        pp=1,
        dp=3,
        global_batch=global_batch,
        max_local_batch=max_local_batch,
        batch_policy="fixed",
        max_boost=0.0,
        reshard_overhead=0.0,
    )
    return Instance(f"three-{global_batch}", g, job)


def test_optimal_megatron_fixed_counts() -> None:
    # B = 10, at most 5 each: two replicas of 5 (three would take 10/3)
    res = solve(_three_domains(10, 5), "optimal-megatron", time_limit=TL)
    assert res.status == "optimal" and res.plan is not None
    assert res.objective == pytest.approx(1.5, rel=1e-6)
    assert [r.local_batch for r in res.plan.replicas] == [5, 5]
    assert res.plan.replicas[0].tp == 3  # reduced first
    # B = 5, at most 5 each: 5 does not split over 2 replicas; one replica of 5
    res = solve(_three_domains(5, 5), "optimal-megatron", time_limit=TL)
    assert res.status == "optimal" and res.plan is not None
    assert res.objective == pytest.approx(1.0, rel=1e-6)
    assert [(r.tp, r.local_batch) for r in res.plan.replicas] == [(4, 5)]
    # B = 9, at most 5 each: 3 x 3 needs a third replica that does not fit, 1 x 9 is
    # above the cap: the job pauses. Free batches (5 + 4) would run at 9 / (4 / 0.75)
    # = 1.6875 but cannot be launched.
    inst = _three_domains(9, 5)
    res = solve(inst, "optimal-megatron", time_limit=TL)
    assert res.status == "optimal" and res.plan is not None and not res.plan.replicas
    assert res.objective == 0.0 and res.bound == 0.0
    old = solve_megatron(inst, one_batch=False)
    assert old.plan is not None and old.stats["goodput"] == pytest.approx(1.6875, rel=1e-6)
    assert [v.rule for v in megatron_compatible(inst, old.plan, uniform_batch=True)] == [
        "megatron-batch"
    ]
    with pytest.raises(MegatronError, match="megatron-batch"):
        equal_batch(inst, old.plan)


def test_micro_batch(tmp_path: Path) -> None:
    # fixed B = 12 over at most 2 replicas of 6: micro-batch 4 refuses 6 (2 x 6);
    # one replica of 12 is above the cap: paused. Micro-batch 3 or 2 takes 2 x 6.
    inst = _three_domains(12, 6)
    for mbs, goodput in ((4, 0.0), (3, 1.5), (2, 1.5)):
        job = inst.job.model_copy(update={"micro_batch": mbs})
        res = solve(inst.with_job(job), "optimal-megatron", time_limit=TL)
        assert res.status == "optimal" and res.objective == pytest.approx(goodput, abs=1e-9)
    mb3 = inst.with_job(inst.job.model_copy(update={"micro_batch": 3}))
    res = solve(mb3, "optimal-megatron", time_limit=TL)
    assert res.plan is not None
    ex = export_megatron(mb3, res.plan, tmp_path / "launch", placeholder_hosts=["p0"])
    assert ex.megatron_args[-4:] == ["--global-batch-size", "12", "--micro-batch-size", "3"]
    # a plan of two replicas of 6 with micro-batch 4 is refused by the export
    mb4 = inst.with_job(inst.job.model_copy(update={"micro_batch": 4}))
    rules = [v.rule for v in megatron_compatible(mb4, res.plan, uniform_batch=True)]
    assert rules == ["megatron-micro-batch"]
    with pytest.raises(MegatronError, match="megatron-micro-batch"):
        export_megatron(mb4, res.plan, tmp_path / "refused", placeholder_hosts=["p0"])
    # the field survives a file round trip; the default is not written
    save_instance(mb3, tmp_path / "mb3.json")
    assert load_instance(tmp_path / "mb3.json").job.micro_batch == 3
    save_instance(inst, tmp_path / "mb1.json")
    assert "micro_batch" not in json.loads((tmp_path / "mb1.json").read_text())["job"]
    assert load_instance(tmp_path / "mb1.json").job.micro_batch == 1


@pytest.mark.parametrize("name", ["tiny.json", "default.json"])
def test_optimal_megatron_library(name: str) -> None:
    inst = _library(name)
    free = _solved(name, "optimal")
    meg = _solved(name, "optimal-megatron")
    assert meg.plan is not None and free.bound is not None and meg.objective is not None
    assert meg.objective <= free.bound * (1 + 1e-9)  # never above the unrestricted bound
    assert evaluate(inst, meg.plan).feasible
    assert megatron_compatible(inst, meg.plan) == []
    if name != "tiny.json":
        return
    nopower = solve(inst, "optimal-megatron-nopower", time_limit=TL)
    assert nopower.plan is not None
    assert all(st.power == 1.0 for r in nopower.plan.replicas for st in r.stages)
    assert megatron_compatible(inst, nopower.plan) == []


# --- round trips ---------------------------------------------------------------------


def _int_ids(instance: Instance) -> Instance:
    """The same instance with every node id an integer (graph order)."""
    mapping = {n: i for i, n in enumerate(instance.cluster.nodes)}
    g = nx.relabel_nodes(nx.Graph(instance.cluster), mapping)
    return Instance(instance.name + "-int", g, instance.job)


def _case(case: int) -> tuple[str, Instance, Result]:
    """Round-trip case ``case``: its label, instance and solve."""
    if case == 0:
        return "tiny", _library("tiny.json"), _solved("tiny.json", "optimal-megatron")
    if case == 1:  # reduced replicas last: reordered
        return "default-optimal", _library("default.json"), _solved("default.json", "optimal")
    if case == 2:
        pp2 = make_instance(failed=5, seed=3, name="pp2", tp_min=6)
        return "pp2", pp2, solve(pp2, "megatron-ntp-reordered")
    tiny_int = _int_ids(_library("tiny.json"))
    return "tiny-int", tiny_int, solve(tiny_int, "optimal-megatron", time_limit=TL)


@pytest.mark.parametrize("case", range(4))
def test_round_trip(case: int, tmp_path: Path) -> None:
    label, inst, res = _case(case)
    assert res.plan is not None
    plan = equal_batch(inst, megatron_order(res.plan, inst.job.tp))
    assert any(r.tp < inst.job.tp for r in plan.replicas), f"{label}: want a reduced replica"
    spares = [f"spare{i}" for i in range(32)]
    ex = export_megatron(inst, plan, tmp_path, reorder=True, placeholder_hosts=spares)
    back = import_megatron(tmp_path, inst)
    assert back.instance == inst.name
    assert back.replicas == plan.replicas
    assert evaluate(inst, back).goodput == pytest.approx(evaluate(inst, plan).goodput)
    lines = (tmp_path / RANKS_NAME).read_text().splitlines()
    assert len(lines) == 1 + ex.extras["world_size"]  # header + one line per rank
    slots = [tuple(line.split()[1:3]) for line in lines[1:]]
    assert len(set(slots)) == len(slots)  # every rank has its own (host, device)
    if case == 0:  # string ids: reading without the instance gives the same plan
        assert import_megatron(tmp_path).replicas == plan.replicas


def _exported(tmp_path: Path) -> tuple[Instance, Path]:
    # tiny: TP4 job, replica 0 at TP3 on d0 (one failed GPU), replica 1 at TP4
    inst = _library("tiny.json")
    res = _solved("tiny.json", "optimal-megatron")
    assert res.plan is not None
    export_megatron(inst, equal_batch(inst, res.plan), tmp_path)
    return inst, tmp_path / RANKS_NAME


def _rewrite(path: Path, edit: Any) -> None:
    lines = path.read_text().splitlines()
    path.write_text("\n".join(edit(lines)) + "\n")


def test_import_rejects_missing_rank(tmp_path: Path) -> None:
    inst, ranks = _exported(tmp_path)
    _rewrite(ranks, lambda lines: lines[:-1])
    with pytest.raises(InputError, match="7 ranks, the world has 8"):
        import_megatron(tmp_path, inst)


def test_import_rejects_wrong_active_flag(tmp_path: Path) -> None:
    inst, ranks = _exported(tmp_path)

    def flip(lines: list[str]) -> list[str]:
        cells = lines[1].split()  # rank 0: active local rank 0 of the reduced replica
        cells[8], cells[9], cells[10] = "0", "-", "-"
        return [lines[0], " ".join(cells), *lines[2:]]

    _rewrite(ranks, flip)
    with pytest.raises(InputError, match=r"dp=0 pp=0: inactive local ranks \[0, 3\]"):
        import_megatron(tmp_path, inst)


def test_import_rejects_bad_numbering_and_columns(tmp_path: Path) -> None:
    inst, ranks = _exported(tmp_path)
    _rewrite(ranks, lambda lines: [lines[0], lines[2], lines[1], *lines[3:]])
    import_megatron(tmp_path, inst)  # line order does not matter, numbers do

    def renumber(lines: list[str]) -> list[str]:
        a, b = lines[1].split(), lines[2].split()
        a[0], b[0] = b[0], a[0]
        return [lines[0], " ".join(a), " ".join(b), *lines[3:]]

    _rewrite(ranks, renumber)
    with pytest.raises(InputError, match="line 2: rank 0 is not tp"):
        import_megatron(tmp_path, inst)
    _rewrite(ranks, lambda lines: [lines[0], "0 d0", *lines[2:]])
    with pytest.raises(InputError, match="line 2: 2 columns, expected 11"):
        import_megatron(tmp_path, inst)


def test_import_rejects_other_format_and_config(tmp_path: Path) -> None:
    inst, _ = _exported(tmp_path)
    text = (tmp_path / CONFIG_NAME).read_text()
    (tmp_path / CONFIG_NAME).write_text(
        text.replace('"num_reduced_tp_dp_ranks": 1', '"num_reduced_tp_dp_ranks": 2')
    )
    with pytest.raises(InputError, match="num_reduced_tp_dp_ranks: 2, expected PP 1 x 1"):
        import_megatron(tmp_path, inst)
    (tmp_path / CONFIG_NAME).write_text("import os\nNTP_CONFIG_KWARGS = os.environ\n")
    with pytest.raises(InputError, match="not a literal"):
        import_megatron(tmp_path, inst)
    (tmp_path / EXTRAS_NAME).write_text('{"format": "something/else@1"}')
    with pytest.raises(InputError, match="format"):
        import_megatron(tmp_path)


# --- the command line ----------------------------------------------------------------


def _one_error_line(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("ntp-opt: error: ") and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    return err


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inst = _two_domains()
    save_instance(inst, tmp_path / "inst.json")
    res = solve(inst, "optimal", time_limit=TL)
    assert res.plan is not None
    save_plan(res.plan, tmp_path / "plan.json")
    argv = ["export", "--to", "megatron-ntp", str(tmp_path / "plan.json")]
    argv += ["--instance", str(tmp_path / "inst.json"), "-o", str(tmp_path / "out")]
    assert main(argv) == 2  # TP3 + TP2: two reduced degrees
    _one_error_line(capsys, "megatron-degrees", "plan.json: ")
    assert not (tmp_path / "out").exists()  # nothing written
    # a plan for another instance
    save_plan(Plan("elsewhere", res.plan.replicas, res.plan.metrics), tmp_path / "plan.json")
    assert main(argv) == 2
    _one_error_line(capsys, "instance", "'elsewhere'")
    meg = solve(inst, "optimal-megatron", time_limit=TL)
    assert meg.plan is not None
    save_plan(meg.plan, tmp_path / "plan.json")
    assert main([*argv, "--placeholder-hosts", "p0,p1", "--placeholder-gpus", "2"]) == 0
    out = tmp_path / "out"
    assert (out / CONFIG_NAME).exists() and (out / RANKS_NAME).exists()
    kw = read_config_module(out / CONFIG_NAME)
    assert kw["tp_spares"] == 2 and len((out / RANKS_NAME).read_text().splitlines()) == 1 + 8
    extras = json.loads((out / EXTRAS_NAME).read_text())
    assert math.isclose(extras["metrics"]["goodput"], 1.0, rel_tol=1e-6)


def test_cli_placeholders_and_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inst = load_instance(ROOT / "instances" / "default.json")
    res = solve(inst, "megatron-ntp-reordered")
    assert res.plan is not None
    save_plan(res.plan, tmp_path / "plan.json")
    argv = ["export", "--to", "megatron-ntp", str(tmp_path / "plan.json"), "--instance"]
    argv += [str(ROOT / "instances" / "default.json"), "-o", str(tmp_path / "out")]
    assert main(argv) == 2
    _one_error_line(capsys, "megatron-placeholders", "--placeholder-hosts")
    hand = Instance(
        "hand2",
        topology.build_cluster(2, 4, 2, 2),
        Job(tp=4, tp_min=3, pp=1, dp=2, global_batch=4, max_local_batch=3, max_boost=0.0),
    )
    plan = certified(
        hand,
        Plan(
            "hand2",
            (
                Replica(4, 1, (Stage("d0", _gpus(0, [0, 1, 2, 3], tray=2)),)),
                Replica(4, 3, (Stage("d1", _gpus(1, [0, 1, 2, 3], tray=2)),)),
            ),
        ),
    )
    save_instance(hand, tmp_path / "h.json")
    save_plan(plan, tmp_path / "hp.json")
    argv = ["export", "--to", "megatron-ntp", str(tmp_path / "hp.json"), "--instance"]
    argv += [str(tmp_path / "h.json"), "-o", str(tmp_path / "o2")]
    assert main(argv) == 2
    _one_error_line(capsys, "megatron-batch", "[1, 3]")
    assert main([*argv, "--equal-batch"]) == 0  # fixed B = 4 over 2 replicas: 2 each
    assert "--global-batch-size 4" in (tmp_path / "o2" / ARGS_NAME).read_text()
    assert json.loads((tmp_path / "o2" / EXTRAS_NAME).read_text())["local_batch"] == 2


def test_optimal_megatron_tiny_time_limit() -> None:
    # a limit too short for any search: the heuristic fallback, still expressible
    inst = load_instance(ROOT / "instances" / "default.json")
    res = solve(inst, "optimal-megatron", time_limit=0.01)
    assert res.status == "feasible" and res.limit == "time_limit" and res.bound is None
    assert res.plan is not None and evaluate(inst, res.plan).feasible
    assert megatron_compatible(inst, res.plan) == []
