"""docs/model.md, spec v1.1 attributes: max_power_w, uuid, host, index; the hardware table."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_opt import evaluate, solve
from ntp_opt.model import hardware, topology
from ntp_opt.model.failures import failed_instance
from ntp_opt.model.files import InputError, instance_from_dict, instance_to_dict, load_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.topology import TopologyError, check_topology
from ntp_opt.planners.bounds import capacity_bound
from ntp_opt.planners.exact.backends import available_backends
from ntp_opt.rules.recourse import adapt
from ntp_opt.solve import EXACT, PLANNERS
from ntp_opt.workflows.replan import ClusterEvent, reboost, replan
from tests.bruteforce import brute_force, plan_figures
from tests.helpers import make_instance
from tests.planners.exact.test_milp import exact_instance
from tests.strategies import preset_instances, with_cluster


@pytest.fixture(scope="module")
def inst():
    return make_instance(failed=2, seed=3)


def _gpu_rows(data):
    return [i for i, n in enumerate(data["cluster"]["nodes"]) if n["kind"] == "gpu"]


def _tray_rows(data):
    return [i for i, n in enumerate(data["cluster"]["nodes"]) if n["kind"] == "tray"]


def test_new_attributes_round_trip(inst):
    data = copy.deepcopy(instance_to_dict(inst))
    g, t = _gpu_rows(data)[0], _tray_rows(data)[0]
    data["cluster"]["nodes"][g].update(
        max_power_w=1200.0, uuid="GPU-0b1c2d3e", host="gb-001", index=3
    )
    data["cluster"]["nodes"][t]["host"] = "gb-001"
    back = instance_from_dict(data)
    gid = data["cluster"]["nodes"][g]["id"]
    tid = data["cluster"]["nodes"][t]["id"]
    attrs = back.cluster.nodes[gid]
    assert (attrs["max_power_w"], attrs["uuid"], attrs["host"], attrs["index"]) == (
        1200.0,
        "GPU-0b1c2d3e",
        "gb-001",
        3,
    )
    assert back.cluster.nodes[tid]["host"] == "gb-001"
    assert instance_to_dict(back) == data
    # compiled: the given limit where set, inf (job cap only) elsewhere
    a = back.arrays
    assert a.max_power[a.gpu_index[gid]] == 1200.0
    assert np.isinf(np.delete(a.max_power, a.gpu_index[gid])).all()


def test_absent_attributes_stay_absent(inst):
    data = instance_to_dict(inst)
    assert all("max_power_w" not in data["cluster"]["nodes"][i] for i in _gpu_rows(data))
    assert np.isinf(inst.arrays.max_power).all()


@pytest.mark.parametrize(
    ("update", "needle"),
    [
        ({"max_power_w": 900.0}, "max_power_w: 900 is below tdp_w 1000"),
        ({"max_power_w": -1.0}, "max_power_w"),
        ({"uuid": ""}, "uuid"),
        ({"host": 7}, "host"),
        ({"index": -1}, "index"),
        ({"index": 1.5}, "index"),
        ({"index": True}, "index"),
    ],
)
def test_bad_gpu_attributes_name_the_field(inst, update, needle):
    data = copy.deepcopy(instance_to_dict(inst))
    g = _gpu_rows(data)[0]
    data["cluster"]["nodes"][g].update(update)
    with pytest.raises(InputError) as err:
        instance_from_dict(data, "x.json")
    assert f"x.json: cluster.nodes[{g}]." in str(err.value)
    assert needle in str(err.value)


def test_check_topology_on_graphs(inst):
    G = nx_copy(inst)
    gid = next(n for n, k in G.nodes(data="kind") if k == "gpu")
    tid = next(n for n, k in G.nodes(data="kind") if k == "tray")
    G.nodes[gid].update(max_power_w=999.0, index=-2, uuid=3)
    G.nodes[tid]["host"] = ""
    with pytest.raises(TopologyError) as err:
        check_topology(G)
    text = "\n".join(err.value.problems)
    assert f"GPU {gid!r} has max_power_w 999.0 below its tdp_w 1000.0" in text
    assert "has index -2" in text and "has uuid 3" in text
    assert f"tray {tid!r} has host ''" in text
    G.nodes[gid].update(max_power_w=1000.0, index=0, uuid="GPU-x")
    G.nodes[tid]["host"] = "h0"
    check_topology(G)
    # a GPU with only kind and max_power_w is checked as well
    G2 = nx_copy(inst)
    for key in ("state", "speed", "p_fail", "tdp_w"):
        G2.nodes[gid].pop(key, None)
    G2.nodes[gid]["max_power_w"] = 500.0  # below the default tdp 1000
    with pytest.raises(TopologyError, match="below its tdp_w"):
        check_topology(G2)


def nx_copy(inst):
    import networkx as nx

    return nx.Graph(inst.cluster)


def test_instance_rejects_limit_below_tdp_from_python(inst):
    G = nx_copy(inst)
    gid = next(n for n, k in G.nodes(data="kind") if k == "gpu")
    G.nodes[gid]["max_power_w"] = 10.0
    with pytest.raises(TopologyError):
        Instance("x", G, inst.job)


# --- hardware table ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA-H100-80GB-HBM3", "h100-sxm"),
        ("NVIDIA-H100-80GB-HBM3-SHARED", "h100-sxm"),
        ("NVIDIA H100 SXM5 80GB", "h100-sxm"),
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA-H200", "h200-sxm"),
        ("NVIDIA H200 141GB HBM3e", "h200-sxm"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA-B200", "b200"),
        ("NVIDIA GB200", "gb200"),
        ("NVIDIA-GB200", "gb200"),
        ("gb200", "gb200"),
        ("h100-sxm", "h100-sxm"),
    ],
)
def test_lookup_known_names(name, key):
    found = hardware.lookup(name)
    assert found is not None and found.key == key


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H100 PCIe",
        "NVIDIA-H100-PCIe",
        "NVIDIA H100 NVL",
        "NVIDIA H200 NVL",
        "NVIDIA GH200 480GB",
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA GeForce RTX 4090",
        "",
        "Some Future GPU",
    ],
)
def test_lookup_unknown_names(name):
    assert hardware.lookup(name) is None


def test_table_values():
    # docs/model.md, spec section 6b board powers; maxima as documented in ntp_opt.model.hardware
    expected = {
        "h100-sxm": (700, 700),
        "h200-sxm": (700, 700),
        "b200": (1000, 1000),
        "gb200": (1200, 1200),
    }
    assert {k: (p.tdp_w, p.max_power_w) for k, p in hardware.PRODUCTS.items()} == expected
    assert all(math.isclose(p.max_multiplier, 1.0) for p in hardware.PRODUCTS.values())
    with pytest.raises(KeyError, match="known: h100-sxm"):
        hardware.product("tpu-v5")


# --- planners honour the limits ------------------------------------------------------------


def _with_limits(g, limit_of) -> None:
    """Set ``max_power_w`` on every GPU: ``limit_of(gpu id, tdp)`` (None: leave it absent)."""
    for n, d in g.nodes(data=True):
        if d["kind"] == "gpu":
            mx = limit_of(n, d["tdp_w"])
            if mx is not None:
                d["max_power_w"] = mx


def _h100(max_equals_nominal: bool = True) -> Instance:
    # 8 DGX nodes (NVL8), 3 failed GPUs, racks with 30 % power headroom: without board
    # limits the power-aware planners boost the reduced replicas
    g = topology.dgx_h100(8, rack_power_factor=1.3)
    g.graph["power_budget_w"] *= 1.3
    topology.fail_gpus(g, ["d0.t0.g0", "d2.t0.g3", "d5.t0.g7"])
    if max_equals_nominal:
        _with_limits(g, lambda n, tdp: 700.0)
    job = Job(tp=8, tp_min=6, pp=2, dp=4, global_batch=32, batch_policy="elastic")
    return Instance("h100", g, job)


def _powers(plan):
    return [sg.power for rep in plan.replicas for sg in rep.stages]


def _planners():
    out = []
    for name in PLANNERS:
        backend = EXACT.get(name, (None,))[0]
        if backend is not None and backend not in available_backends():
            continue
        out.append(name)
    return out


@pytest.fixture(scope="module")
def h100():
    return _h100()


def test_h100_control_boosts_without_limits():
    # the same cluster without max_power_w: boosting is possible and pays
    inst = _h100(max_equals_nominal=False)
    for name in ("ntp-pw", "optimal"):
        res = solve(inst, name, time_limit=30)
        assert max(_powers(res.plan)) > 1.0, name


@pytest.mark.parametrize("name", _planners())
def test_h100_every_planner_never_boosts(h100, name):
    res = solve(h100, name, time_limit=30)
    assert res.plan.replicas, name
    assert set(_powers(res.plan)) == {1.0}
    assert evaluate(h100, res.plan).feasible


def test_h100_bound_is_the_no_boost_bound(h100):
    # no board accepts more than its nominal power: the bound equals the bound of the
    # same instance with boost switched off, and is below the bound without limits
    no_boost = Instance("h100", h100.cluster, h100.job.model_copy(update={"max_boost": 0.0}))
    assert capacity_bound(h100) == capacity_bound(no_boost)
    assert capacity_bound(h100) < capacity_bound(_h100(max_equals_nominal=False))
    assert solve(h100, "optimal").objective == pytest.approx(
        solve(h100, "optimal-nopower").objective, rel=1e-9
    )


def test_h100_recourse_and_replan_never_boost(h100):
    plan = solve(h100, "ntp-pw").plan
    mask = np.zeros(h100.arrays.n_gpus, dtype=bool)
    mask[[h100.arrays.gpu_index["d1.t0.g0"], h100.arrays.gpu_index["d3.t0.g1"]]] = True
    after = adapt(h100, plan, mask, boost=True)
    assert set(_powers(after)) <= {1.0}
    for mode in ("local", "global"):
        out = replan(h100, plan, [ClusterEvent("fail", ("d1.t0.g0", "d3.t0.g1"))], mode=mode)
        assert set(_powers(out.plan)) <= {1.0}
        assert evaluate(out.instance, out.plan).feasible
    # reboost of any plan on these boards changes nothing
    assert reboost(h100, plan) == plan


def _gb200(seed: int) -> Instance:
    # 2 NVL72 racks, GB200 boards at 1200 W with per-GPU maximum limits between
    # 1320 W (1.1 x) and 1560 W (1.3 x), racks and site with 25 % headroom, 5 failed
    # GPUs: a stage's boost is capped by its lowest board (a 1200 W board in each
    # 64-GPU stage would forbid any boost, as on H100 above)
    rng = np.random.default_rng(seed)
    g = topology.gb200_nvl72(2, rack_power_factor=1.25)
    g.graph["power_budget_w"] *= 1.25
    topology.fail_random(g, count=5, seed=seed)
    choices = [1320.0, 1380.0, 1440.0, 1560.0]
    _with_limits(g, lambda n, tdp: float(rng.choice(choices)))
    job = Job(tp=72, tp_min=64, tp_allowed=[64, 68, 72], pp=1, dp=2, global_batch=32)
    return Instance(f"gb200-{seed}", g, job)


@pytest.mark.parametrize("name", [n for n in _planners() if "nopower" not in n])
def test_gb200_boosts_stay_within_each_board(name):
    inst = _gb200(1)
    res = solve(inst, name, time_limit=30)
    assert evaluate(inst, res.plan).feasible
    g = inst.cluster
    for rep in res.plan.replicas:
        for sg in rep.stages:
            for gid in sg.gpus:
                d = g.nodes[gid]
                assert sg.power * d["tdp_w"] <= d["max_power_w"] * (1 + 1e-9), (name, gid)


def test_gb200_some_planner_boosts_within_limits():
    inst = _gb200(1)
    powers = _powers(solve(inst, "ntp-pw").plan) + _powers(solve(inst, "optimal").plan)
    assert max(powers) > 1.0
    # a stage of >= 64 GPUs leaves out at most 8 of its domain's 72, and every domain
    # has more than 8 boards limited to 1320 W: no stage may go above 1.1
    for d in ("d0", "d1"):
        low = [n for n in inst.cluster if str(n).startswith(f"{d}.")
               and inst.cluster.nodes[n].get("max_power_w") == 1320.0]  # fmt: skip
        assert len(low) > 8
    assert max(powers) <= 1.1 * (1 + 1e-9)


def test_gb200_recourse_boost_respects_refilled_boards():
    inst = _gb200(2)
    plan = solve(inst, "optimal").plan
    rng = np.random.default_rng(0)
    for _ in range(5):
        mask = rng.random(inst.arrays.n_gpus) < 0.03
        after = adapt(inst, plan, mask, boost=True)
        failed = failed_instance(inst, mask)
        assert evaluate(failed, after).feasible


# --- the exact planner against the brute force, with random board limits ---------------------

N_LIMITS = 12  # random instances


def _limited(seed: int) -> Instance:
    """test_milp's random instance with random max_power_w in {1, 1.1, 1.2, 1.5} x tdp or
    absent: per GPU on odd seeds, per domain on even ones (the exact model's scope,
    docs/model.md). Every other pair of seeds has a large max_boost, so that limits
    below 1 + max_boost bind."""
    base = exact_instance(seed)
    rng = np.random.default_rng(1000 + seed)
    g = nx_copy(base)
    factors = [1.0, 1.1, 1.2, 1.5, None]
    per_domain: dict[str, float | None] = {}

    def limit(n: str, tdp: float) -> float | None:
        key = n if seed % 2 else n.split(".")[0]
        if key not in per_domain:
            per_domain[key] = factors[int(rng.integers(0, 5))]
        f = per_domain[key]
        return None if f is None else f * tdp

    _with_limits(g, limit)
    job = base.job
    if seed % 4 >= 2:
        job = job.model_copy(update={"max_boost": 1.0, "power_exponent": 0.65})
    return Instance(f"limited-{seed}", g, job)


@pytest.mark.parametrize("seed", range(N_LIMITS))
def test_exact_equals_brute_force_with_board_limits(seed):
    inst = _limited(seed)
    best, plan = brute_force(inst)
    _, problems = plan_figures(inst, plan)
    assert not problems and evaluate(inst, plan).feasible
    res = solve(inst, "optimal", log=True)
    assert evaluate(inst, res.plan).feasible
    assert res.bound is not None and res.bound >= best * (1 - 1e-9)
    assert res.objective <= best * (1 + 1e-6)
    if seed % 2 == 0:  # one limit per domain: in the exact model's scope
        assert res.status == "optimal"
    if res.status == "optimal":
        assert res.objective == pytest.approx(best, rel=1e-5, abs=1e-9)
    else:  # only where a faster GPU has a lower limit than a slower one (docs/model.md)
        assert "accepts less power" in res.log


def test_board_limits_change_optima():
    # the family is not trivial: the limits lower some optima
    changed = 0
    for seed in range(N_LIMITS):
        inst = _limited(seed)
        free = Instance("free", exact_instance(seed).cluster, inst.job)
        changed += brute_force(inst)[0] < brute_force(free)[0] * (1 - 1e-9)
    assert changed >= 3


# --- ntp-opt gen --product -----------------------------------------------------------------


def test_gen_product(tmp_path, capsys):
    from ntp_opt.app.cli import main
    from ntp_opt.model.files import load_instance

    out = tmp_path / "h100.json"
    args = ["gen", "--builder", "dgx-h100", "--gpus", "64", "--tp", "8", "--fail-count", "3"]
    assert main([*args, "--product", "h100-sxm", "-o", str(out)]) == 0
    inst = load_instance(out)
    assert set(inst.arrays.tdp.tolist()) == {700.0}
    assert set(inst.arrays.max_power.tolist()) == {700.0}
    assert inst.meta["product"] == "h100-sxm"
    assert set(_powers(solve(inst, "ntp-pw").plan)) <= {1.0}
    # GB200 boards run at 1000 W: 200 W of headroom each, 1.2 x
    out = tmp_path / "gb200.json"
    args = ["gen", "--builder", "nvl72", "--gpus", "144", "--tp", "72", "-o", str(out)]
    assert main([*args, "--product", "gb200", "--tdp-w", "1000"]) == 0
    inst = load_instance(out)
    assert set(inst.arrays.tdp.tolist()) == {1000.0}
    assert set(inst.max_multiplier.tolist()) == {1.2}
    # without --product: the builder's defaults, no max_power_w (as before)
    out = tmp_path / "plain.json"
    assert main([*args[:-1], str(out)]) == 0
    inst = load_instance(out)
    assert set(inst.arrays.tdp.tolist()) == {1200.0}
    assert np.isinf(inst.arrays.max_power).all()
    capsys.readouterr()
    assert main([*args, "--product", "gb200", "--tdp-w", "1300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ntp-opt: error: --tdp-w 1300 is above the NVIDIA GB200 maximum")
    assert "Traceback" not in err


# --- instances without max_power_w keep their meaning ---------------------------------------

ROOT = Path(__file__).resolve().parents[2]
_BEST = json.loads((ROOT / "instances" / "best_known.json").read_text())["instances"]
_REPLAY = [
    k
    for k, v in _BEST.items()
    if v["gpus"] <= 1152 and (v["goodput_planner"] not in EXACT or v["gap"] < 1e-6)
]


@pytest.mark.parametrize("name", _REPLAY)
def test_best_known_values_do_not_move(name):
    """The stored best-known goodput of small bundled instances (instances/best_known.json,
    written before v1.1) is reproduced by the planner that found it, and no bound drops
    below it."""
    row = _BEST[name]
    inst = load_instance(ROOT / "instances" / row["file"])
    assert np.isinf(inst.arrays.max_power).all()  # no instance carries max_power_w
    res = solve(inst, row["goodput_planner"], seed=row["goodput_seed"], time_limit=60)
    assert res.evaluation.relative_goodput == pytest.approx(row["goodput"], rel=1e-9, abs=0)
    rel = capacity_bound(inst) * inst.job.seq_time_s / inst.job.dp
    assert rel >= row["goodput"] * (1 - 1e-9)


def test_info_reports_board_limits(tmp_path, capsys):
    from ntp_opt.app.cli import main

    out = tmp_path / "gb.json"
    args = ["gen", "--builder", "nvl72", "--gpus", "144", "--tp", "72", "-o", str(out)]
    assert main([*args, "--product", "gb200"]) == 0
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    assert "below tdp_w x (1 + max_boost) on 144 GPUs; 144 of them cannot boost" in (
        capsys.readouterr().out
    )


def test_board_limits_break_domain_interchangeability():
    from ntp_opt.workflows.simulate import interchangeable_domains

    g = topology.build_cluster(3, 8, 4, 2)
    job = Job(tp=8, pp=1, dp=3, global_batch=24)
    assert interchangeable_domains(Instance("same", g, job)) is None
    _with_limits(g, lambda n, tdp: tdp)  # one limit everywhere: still interchangeable
    assert interchangeable_domains(Instance("same", g, job)) is None
    g.nodes["d1.t0.g0"]["max_power_w"] = 1200.0
    assert "max_power_w" in interchangeable_domains(Instance("mixed", g, job))


# --- property: random board limits on the presets --------------------------------------------


@st.composite
def limited_presets(draw: st.DrawFn) -> Instance:
    """A preset instance (tests/strategies.py) with random board limits, per GPU or per tray,
    of 1, 1.1 or 1.2 x tdp_w or absent."""
    inst = draw(preset_instances())
    per_tray = draw(st.booleans())
    factors = st.sampled_from([1.0, 1.1, 1.2, None])
    seen: dict[str, float | None] = {}

    def change(g) -> None:
        for n, d in g.nodes(data=True):
            if d["kind"] != "gpu":
                continue
            key = n.rsplit(".", 1)[0] if per_tray else n
            if key not in seen:
                seen[key] = draw(factors)
            if seen[key] is not None:
                d["max_power_w"] = seen[key] * d["tdp_w"]

    return with_cluster(inst, change)


def _within_boards(inst: Instance, plan) -> bool:
    g = inst.cluster
    return all(
        sg.power * g.nodes[x]["tdp_w"] <= g.nodes[x].get("max_power_w", math.inf) * (1 + 1e-9)
        for rep in plan.replicas
        for sg in rep.stages
        for x in sg.gpus
    )


@settings(max_examples=min(6, settings().max_examples))
@given(inst=limited_presets(), seed=st.integers(0, 2**16))
def test_heuristics_and_recourse_respect_random_board_limits(inst, seed):
    for name in ("ntp-pw", "fast"):
        plan = solve(inst, name).plan
        assert _within_boards(inst, plan), name
        mask = np.random.default_rng(seed).random(inst.arrays.n_gpus) < 0.05
        after = adapt(inst, plan, mask, boost=True)
        assert _within_boards(inst, after), name
        assert evaluate(failed_instance(inst, mask), after).feasible
        assert _within_boards(inst, reboost(inst, plan))
