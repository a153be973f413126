"""Megatron-LM NTP export: restrictions, the optimal-megatron planner, and round trips.

Expected values are worked out by hand in the comments (MODEL.md section 3:
``v_r = t_r / T * slowest / c``, ``theta = max_r b_r / v_r * (1 + rho [some
t_r < T])``, goodput ``= sum_r b_r / theta``) or come from the independent
brute-force planner (tests/bruteforce.py), never from the code under test.

Rank numbering (Megatron's default order ``tp-cp-ep-dp-pp``):
``rank = tp + T * (dp + DP * pp)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import networkx as nx
import pytest

from ntp_opt import topology
from ntp_opt.cli import main
from ntp_opt.export import (
    CONFIG_NAME,
    RANKS_NAME,
    export_megatron,
    import_megatron,
    megatron_config,
    rank_table,
)
from ntp_opt.files import InputError, load_instance, save_instance, save_plan
from ntp_opt.instance import Instance
from ntp_opt.job import Job
from ntp_opt.megatron import MegatronError, megatron_compatible, megatron_order
from ntp_opt.plan import Plan, Replica, Stage
from ntp_opt.solve import solve
from ntp_opt.validate import PlanError, certified, evaluate

from .bruteforce import brute_force
from .helpers import HANG_GUARD, make_instance

ROOT = Path(__file__).resolve().parent.parent
TL = HANG_GUARD  # every exact solve here finishes; the limit only guards against a hang


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


def _hand_plan(hand: Instance, reduced_first: bool = True) -> Plan:
    # replica TP6 on d0's six healthy GPUs (local ranks 0,1,3,4,6,7), TP8 on d1
    small = Replica(6, 3, (Stage("d0", _gpus(0, [0, 1, 3, 4, 6, 7])),))
    full = Replica(8, 5, (Stage("d1", _gpus(1, list(range(8)))),))
    reps = (small, full) if reduced_first else (full, small)
    return certified(hand, Plan("hand", reps))


# --- the configuration and the rank table, by hand ---------------------------------


def test_hand_config(hand: Instance) -> None:
    cfg = megatron_config(hand, _hand_plan(hand))
    assert cfg["nonuniform_tp"] == {
        "tp_base": 8,
        "tp_spares": 2,
        "num_reduced_tp_dp_ranks": 1,
        "non_active_ranks_per_dp": {"0,0,0": [6, 7]},
    }
    assert cfg["world_size"] == 16  # 2 replicas x 1 stage x 8 ranks
    assert cfg["data_parallel_size"] == 2
    assert cfg["tp_domain_sizes"] == [6, 8]
    assert cfg["local_batch_per_dp"] == [3, 5]
    assert cfg["uniform_local_batch"] is False
    assert cfg["power_boost"] is False
    args = cfg["megatron_args"]
    assert args[args.index("--nonuniform-tp-spares") + 1] == "2"
    assert args[args.index("--nonuniform-tp-num-reduced-dp-ranks") + 1] == "1"
    assert json.loads(args[args.index("--nonuniform-tp-non-active-ranks-json") + 1]) == {
        "0,0,0": [6, 7]
    }


def test_hand_rank_table(hand: Instance) -> None:
    rows = rank_table(hand, _hand_plan(hand))
    assert [r.rank for r in rows] == list(range(16))
    # dp 0: active local ranks 0..5 on the plan's GPUs, in plan order
    assert [r.gpu for r in rows[:6]] == list(_gpus(0, [0, 1, 3, 4, 6, 7]))
    assert all(r.active and r.dp == 0 and r.pp == 0 for r in rows[:6])
    # d0 has no healthy GPU left, so inactive ranks 6, 7 take healthy unused GPUs
    # elsewhere: d2 is unused, its first GPUs in graph order
    assert [(r.gpu, r.active, r.tp) for r in rows[6:8]] == [
        ("d2.t0.g0", False, 6),
        ("d2.t0.g1", False, 7),
    ]
    assert rows[6].power is None and rows[6].power_w is None
    # rank 13 = tp 5 of dp 1: d1's GPU of local rank 5 = tray 1, index 1
    r13 = rows[13]
    assert (r13.dp, r13.tp, r13.gpu, r13.host, r13.local) == (1, 5, "d1.t1.g1", "d1.t1", 1)
    assert r13.power == 1.0 and r13.power_w == 1000.0


def test_rank_order_pp(tmp_path: Path) -> None:
    # pp = 2, dp = 2, T = 4: rank of (dp, pp, tp) is tp + 4 (dp + 2 pp)
    g = topology.build_cluster(4, 4, 4, 1)
    job = Job(tp=4, tp_min=3, pp=2, dp=2, global_batch=4, max_boost=0.0)
    inst = Instance("pp", g, job)
    stages = [Stage(f"d{i}", _gpus(i, [0, 1, 2, 3])) for i in range(4)]
    plan = certified(
        inst,
        Plan("pp", (Replica(4, 2, (stages[0], stages[1])), Replica(4, 2, (stages[2], stages[3])))),
    )
    rows = rank_table(inst, plan)
    by_rank = {r.rank: (r.dp, r.pp, r.tp, r.gpu) for r in rows}
    assert by_rank[0] == (0, 0, 0, "d0.t0.g0")
    assert by_rank[4] == (1, 0, 0, "d2.t0.g0")  # dp 1 stage 0 is replica 1's first stage
    assert by_rank[8] == (0, 1, 0, "d1.t0.g0")  # dp 0 stage 1
    assert by_rank[15] == (1, 1, 3, "d3.t0.g3")
    cfg = megatron_config(inst, plan)
    assert cfg["nonuniform_tp"]["tp_spares"] == 0
    assert "--nonuniform-mode" not in cfg["megatron_args"]


# --- restrictions ------------------------------------------------------------------


def test_order_error_and_reorder(hand: Instance) -> None:
    plan = _hand_plan(hand, reduced_first=False)
    problems = megatron_compatible(hand, plan)
    assert [v.rule for v in problems] == ["megatron-order"]
    assert "replica 1" in problems[0].message
    with pytest.raises(MegatronError, match="megatron-order"):
        megatron_config(hand, plan)
    cfg = megatron_config(hand, plan, reorder=True)
    assert cfg["local_batch_per_dp"] == [3, 5]  # the reduced replica moved first
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
                Replica(6, 2, (Stage("d1", _gpus(1, list(range(2, 8)))),)),
                Replica(8, 4, (Stage("d2", _gpus(2, list(range(8)))),)),
            ),
        ),
    )
    with pytest.raises(MegatronError) as err:
        megatron_config(inst, plan)
    assert [v.rule for v in err.value.violations] == ["megatron-degrees"]
    assert "[7, 6]" in str(err.value) and "tp_base=8" in str(err.value)


def test_uniform_batch_and_empty(hand: Instance) -> None:
    problems = megatron_compatible(hand, _hand_plan(hand), uniform_batch=True)
    assert [v.rule for v in problems] == ["megatron-batch"]
    assert "[3, 5]" in problems[0].message
    empty = certified(hand, Plan("hand", ()))
    assert [v.rule for v in megatron_compatible(hand, empty)] == ["megatron-empty"]
    with pytest.raises(MegatronError, match="paused"):
        megatron_config(hand, empty)


def test_slots() -> None:
    # one domain of 9 GPUs, T = 8 with degree 4 allowed: two TP4 replicas use 8 GPUs
    # but their world is 2 x 8 = 16 ranks > 9 GPUs
    g = topology.build_cluster(1, 9, 9, 1)
    job = Job(tp=8, tp_min=4, tp_allowed=(4, 8), pp=1, dp=2, global_batch=2, max_boost=0.0)
    inst = Instance("slots", g, job)
    gpus = [f"d0.t0.g{k}" for k in range(9)]
    plan = certified(
        inst,
        Plan(
            "slots",
            (
                Replica(4, 1, (Stage("d0", tuple(gpus[:4])),)),
                Replica(4, 1, (Stage("d0", tuple(gpus[4:8])),)),
            ),
        ),
    )
    rules = [v.rule for v in megatron_compatible(inst, plan)]
    assert rules == ["megatron-slots"]


def test_infeasible_plan_refused(hand: Instance) -> None:
    # d0.t0.g2 has failed: the validator's error comes first
    bad = Plan("hand", (Replica(6, 3, (Stage("d0", _gpus(0, [0, 1, 2, 3, 4, 5])),)),))
    with pytest.raises(PlanError, match="gpu-failed"):
        megatron_config(hand, bad)


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


def _restricted(instance: Instance, t: int) -> Instance:
    job = Job(**{**instance.job.model_dump(), "tp_allowed": (t, instance.job.tp)})
    return Instance(instance.name, instance.cluster, job)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimal_megatron_against_brute_force(seed: int) -> None:
    # small clusters: 3 domains of 4 GPUs, 3 random failures, TP4 allowing 2 and 3
    inst = make_instance(
        domains=3,
        size=4,
        tray=2,
        failed=3,
        seed=seed,
        name=f"bf{seed}",
        tp=4,
        tp_min=2,
        pp=1,
        dp=3,
        global_batch=6,
        batch_policy="elastic",
    )
    # the best Megatron plan is the best over its one reduced degree t
    want = max(brute_force(_restricted(inst, t))[0] for t in (2, 3))
    free, _ = brute_force(inst)
    res = solve(inst, "optimal-megatron", time_limit=TL)
    assert res.plan is not None and res.objective is not None
    assert res.status == "optimal"
    assert res.objective == pytest.approx(want, rel=1e-5)
    assert res.objective <= free * (1 + 1e-6)
    assert evaluate(inst, res.plan).feasible
    assert megatron_compatible(inst, res.plan) == []


@pytest.mark.parametrize("name", ["tiny.json", "default.json"])
def test_optimal_megatron_library(name: str) -> None:
    inst = load_instance(ROOT / "instances" / name)
    free = solve(inst, "optimal", time_limit=TL)
    meg = solve(inst, "optimal-megatron", time_limit=TL)
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


def _cases() -> list[tuple[str, Instance, str]]:
    tiny = load_instance(ROOT / "instances" / "tiny.json")
    default = load_instance(ROOT / "instances" / "default.json")
    pp2 = make_instance(failed=5, seed=3, name="pp2", tp_min=6)
    return [
        ("tiny", tiny, "optimal-megatron"),
        ("default-optimal", default, "optimal"),  # reduced replicas last: reordered
        ("pp2", pp2, "megatron-ntp-reordered"),
        ("tiny-int", _int_ids(tiny), "optimal-megatron"),
    ]


@pytest.mark.parametrize("case", range(4))
def test_round_trip(case: int, tmp_path: Path) -> None:
    label, inst, solver = _cases()[case]
    res = solve(inst, solver, time_limit=TL)
    assert res.plan is not None
    plan = megatron_order(res.plan, inst.job.tp)
    assert any(r.tp < inst.job.tp for r in plan.replicas), f"{label}: want a reduced replica"
    export_megatron(inst, res.plan, tmp_path, reorder=True)
    back = import_megatron(tmp_path, inst)
    assert back.instance == inst.name
    assert back.replicas == plan.replicas
    assert evaluate(inst, back).goodput == pytest.approx(evaluate(inst, plan).goodput)
    lines = (tmp_path / RANKS_NAME).read_text().splitlines()
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert len(lines) == 1 + cfg["world_size"]  # header + one line per rank
    gpus = [line.split()[2] for line in lines[1:]]
    assert len(set(gpus)) == len(gpus)  # every rank has its own GPU slot
    if case == 0:  # string ids: reading without the instance gives the same plan
        assert import_megatron(tmp_path / CONFIG_NAME).replicas == plan.replicas


def _exported(tmp_path: Path) -> tuple[Instance, Path]:
    inst = load_instance(ROOT / "instances" / "tiny.json")
    res = solve(inst, "optimal-megatron", time_limit=TL)
    assert res.plan is not None
    export_megatron(inst, res.plan, tmp_path)
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


def test_import_rejects_other_format(tmp_path: Path) -> None:
    (tmp_path / CONFIG_NAME).write_text('{"format": "something/else@1"}')
    with pytest.raises(InputError, match="format"):
        import_megatron(tmp_path)


# --- the command line ----------------------------------------------------------------


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inst = _two_domains()
    save_instance(inst, tmp_path / "inst.json")
    res = solve(inst, "optimal", time_limit=TL)
    assert res.plan is not None
    save_plan(res.plan, tmp_path / "plan.json")
    argv = ["export", "--to", "megatron-ntp", str(tmp_path / "plan.json")]
    argv += ["--instance", str(tmp_path / "inst.json"), "-o", str(tmp_path / "out")]
    assert main(argv) == 1  # TP3 + TP2: two reduced degrees
    err = capsys.readouterr().err
    assert "megatron-degrees" in err and "plan.json" in err
    meg = solve(inst, "optimal-megatron", time_limit=TL)
    assert meg.plan is not None
    save_plan(meg.plan, tmp_path / "plan.json")
    assert main(argv) == 0
    assert (tmp_path / "out" / CONFIG_NAME).exists() and (tmp_path / "out" / RANKS_NAME).exists()
    cfg = json.loads((tmp_path / "out" / CONFIG_NAME).read_text())
    assert cfg["nonuniform_tp"]["tp_spares"] == 2 and cfg["world_size"] == 8
    assert math.isclose(cfg["metrics"]["goodput"], 1.0, rel_tol=1e-6)


def test_optimal_megatron_tiny_time_limit() -> None:
    # a limit too short for any search: the heuristic fallback, still expressible
    inst = load_instance(ROOT / "instances" / "default.json")
    res = solve(inst, "optimal-megatron", time_limit=0.01)
    assert res.status == "feasible" and res.limit == "time_limit" and res.bound is None
    assert res.plan is not None and evaluate(inst, res.plan).feasible
    assert megatron_compatible(inst, res.plan) == []
