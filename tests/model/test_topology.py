"""Tests for ntp_opt.model.topology: builders, failure/straggler/risk helpers, check_topology."""

from __future__ import annotations

import math
import pickle
import re
from collections.abc import Callable, Hashable

import networkx as nx
import numpy as np
import pytest

from ntp_opt.model import topology as topo
from ntp_opt.model.topology import (
    BUILDERS,
    DEFAULT_TDP_W,
    NIC_GBPS_PER_GPU,
    TopologyError,
    add_stragglers,
    build,
    build_cluster,
    check_topology,
    dgx_h100,
    domains,
    fail_gpus,
    fail_random,
    fail_trays,
    gb200_nvl72,
    gpus,
    nvl32,
    nvl36x2,
    racks,
    repair_gpus,
    set_p_fail,
    set_speed,
    trays,
)

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def nbrs(G: nx.Graph, n: Hashable, kind: str) -> list[Hashable]:
    return [v for v in G.adj[n] if G.nodes[v]["kind"] == kind]


def rack_gpus(G: nx.Graph, r: Hashable) -> list[Hashable]:
    return [g for t in nbrs(G, r, "tray") for g in nbrs(G, t, "gpu")]


def domain_gpus(G: nx.Graph, d: Hashable) -> list[Hashable]:
    return [g for t in nbrs(G, d, "tray") for g in nbrs(G, t, "gpu")]


def count_kinds(G: nx.Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, k in G.nodes(data="kind"):
        out[k] = out.get(k, 0) + 1
    return out


def state(G: nx.Graph, g: Hashable) -> str:
    return G.nodes[g]["state"]


def small() -> nx.Graph:
    """2 domains of 8 GPUs (2 trays x 4), one domain per rack, one leaf per domain."""
    return build_cluster(2, 8, 4, 2, domains_per_leaf=1)


# --------------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------------

# (builder call, domains, domain size, trays/domain, racks, GPUs per rack, tdp, name)
PRESETS = [
    (lambda: dgx_h100(8), 8, 8, 1, 2, 32, 700.0, "dgx-h100-64"),
    (lambda: nvl32(3), 3, 32, 8, 3, 32, 1000.0, "nvl32-96"),
    (lambda: gb200_nvl72(2), 2, 72, 18, 2, 72, 1200.0, "nvl72-144"),
    (lambda: nvl36x2(2), 2, 72, 18, 4, 36, 1200.0, "nvl36x2-144"),
]


@pytest.mark.parametrize(
    ("make", "n_dom", "dsize", "tpd", "n_racks", "per_rack", "tdp", "name"), PRESETS
)
def test_preset_structure(
    make: Callable[[], nx.Graph],
    n_dom: int,
    dsize: int,
    tpd: int,
    n_racks: int,
    per_rack: int,
    tdp: float,
    name: str,
) -> None:
    G = make()
    counts = count_kinds(G)
    assert counts["domain"] == n_dom
    assert counts["tray"] == n_dom * tpd
    assert counts["gpu"] == n_dom * dsize
    assert counts["rack"] == n_racks
    assert G.graph["name"] == name
    for d in domains(G):
        assert G.nodes[d]["size"] == dsize
        assert len(domain_gpus(G, d)) == dsize
    for r in racks(G):
        assert len(rack_gpus(G, r)) == per_rack
        assert G.nodes[r]["power_budget_w"] == pytest.approx(per_rack * tdp)
    assert all(G.nodes[g]["tdp_w"] == tdp for g in gpus(G))
    assert G.graph["power_budget_w"] == pytest.approx(n_dom * dsize * tdp)
    check_topology(G)


def test_nvl36x2_domains_span_exactly_two_racks() -> None:
    G = nvl36x2(3)
    for d in domains(G):
        rs = {r for t in nbrs(G, d, "tray") for r in nbrs(G, t, "rack")}
        assert len(rs) == 2
    for r in racks(G):
        ds = {d for t in nbrs(G, r, "tray") for d in nbrs(G, t, "domain")}
        assert len(ds) == 1
        assert len(nbrs(G, r, "tray")) == 9


def test_dgx_racks_hold_four_domains() -> None:
    G = dgx_h100(8)
    for r in racks(G):
        ds = {d for t in nbrs(G, r, "tray") for d in nbrs(G, t, "domain")}
        assert len(ds) == 4
    assert all(len(nbrs(G, d, "tray")) == 1 for d in domains(G))


def test_nvl32_one_domain_per_rack_and_custom_tray_size() -> None:
    G = nvl32(2, gpus_per_tray=8)
    assert len(trays(G)) == 8
    for r in racks(G):
        assert len({d for t in nbrs(G, r, "tray") for d in nbrs(G, t, "domain")}) == 1
    with pytest.raises(ValueError, match="gpus_per_tray"):
        nvl32(2, gpus_per_tray=3)


def test_node_ids_and_insertion_order() -> None:
    G = build_cluster(2, 4, 2, 1, name="x")
    assert list(G)[:8] == [
        "d0",
        "d0.t0",
        "d0.t0.g0",
        "d0.t0.g1",
        "d0.t1",
        "d0.t1.g0",
        "d0.t1.g1",
        "d1",
    ]
    assert gpus(G) == [f"d{i}.t{j}.g{k}" for i in range(2) for j in range(2) for k in range(2)]
    assert trays(G) == ["d0.t0", "d0.t1", "d1.t0", "d1.t1"]
    assert racks(G) == ["r0", "r1", "r2", "r3"]
    # rack of a tray = global tray index // trays_per_rack
    assert nbrs(G, "d1.t1", "rack") == ["r3"]
    assert nbrs(G, "d1.t1.g0", "tray") == ["d1.t1"]
    assert nbrs(G, "d1.t1", "domain") == ["d1"]


def test_switch_fabric() -> None:
    G = build_cluster(5, 8, 8, 1, domains_per_leaf=2, num_spines=3)
    leaves = [n for n, d in G.nodes(data=True) if d.get("tier") == "leaf"]
    spines = [n for n, d in G.nodes(data=True) if d.get("tier") == "spine"]
    assert leaves == ["leaf0", "leaf1", "leaf2"]
    assert spines == ["spine0", "spine1", "spine2"]
    for i, d in enumerate(domains(G)):
        assert nbrs(G, d, "switch") == [f"leaf{i // 2}"]
        assert G.edges[d, f"leaf{i // 2}"]["bandwidth_gbps"] == NIC_GBPS_PER_GPU * 8
    for leaf in leaves:
        assert sorted(nbrs(G, leaf, "switch")) == spines
    # leaf2 carries one domain, its uplink bandwidth is spread over the 3 spines
    assert G.edges["leaf2", "spine0"]["bandwidth_gbps"] == pytest.approx(NIC_GBPS_PER_GPU * 8 / 3)
    assert all(math.isfinite(bw) and bw > 0 for *_, bw in G.edges(data="bandwidth_gbps") if bw)


def test_default_spines_and_partial_last_rack() -> None:
    G = build_cluster(5, 8, 8, 4)  # 5 DGX-like domains, 4 per rack -> 2 racks, r1 partial
    assert len([n for n, t in G.nodes(data="tier") if t == "spine"]) == 1
    assert G.nodes["r0"]["power_budget_w"] == pytest.approx(32 * DEFAULT_TDP_W)
    assert G.nodes["r1"]["power_budget_w"] == pytest.approx(8 * DEFAULT_TDP_W)
    assert G.graph["name"] == "cluster-5x8"
    check_topology(G)


def test_rack_power_factor_and_tdp_override() -> None:
    G = build("nvl32", 64, tdp_w=900.0, rack_power_factor=0.8, name="mine")
    assert G.graph["name"] == "mine"
    assert G.nodes["r0"]["power_budget_w"] == pytest.approx(0.8 * 32 * 900.0)
    assert G.graph["power_budget_w"] == pytest.approx(64 * 900.0)
    check_topology(G)


@pytest.mark.parametrize(("kind", "size"), [("dgx-h100", 8), ("nvl32", 32), ("nvl72", 72)])
def test_build_by_gpu_count(kind: str, size: int) -> None:
    G = build(kind, 3 * size)
    assert len(gpus(G)) == 3 * size
    assert len(domains(G)) == 3
    assert G.graph["name"] == f"{kind}-{3 * size}"
    with pytest.raises(ValueError, match=f"multiple of the {kind} domain size \\({size}\\)"):
        build(kind, 3 * size + 4)


def test_build_nvl36x2_and_builders_table() -> None:
    assert set(BUILDERS) == {"dgx-h100", "nvl32", "nvl72", "nvl36x2"}
    G = build("nvl36x2", 144)
    assert len(racks(G)) == 4


def test_build_unknown_kind_lists_known() -> None:
    with pytest.raises(ValueError, match="unknown cluster kind 'nvl99'") as info:
        build("nvl99", 64)
    for k in BUILDERS:
        assert k in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_domains": 0}, "num_domains"),
        ({"domain_size": -8}, "domain_size"),
        ({"gpus_per_tray": 2.0}, "gpus_per_tray"),
        ({"trays_per_rack": True}, "trays_per_rack"),
        ({"domains_per_leaf": 0}, "domains_per_leaf"),
        ({"num_spines": 0}, "num_spines"),
        ({"tdp_w": 0.0}, "tdp_w"),
        ({"tdp_w": math.nan}, "tdp_w"),
        ({"rack_power_factor": -1.0}, "rack_power_factor"),
        ({"gpus_per_tray": 3}, "multiple of gpus_per_tray"),
        ({"trays_per_rack": 3}, "trays_per_rack \\(3\\) must divide or be a multiple"),
    ],
)
def test_build_cluster_rejects_bad_arguments(kwargs: dict[str, object], needle: str) -> None:
    args: dict[str, object] = {
        "num_domains": 2,
        "domain_size": 8,
        "gpus_per_tray": 4,
        "trays_per_rack": 2,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        build_cluster(**args)  # type: ignore[arg-type]


def test_build_rejects_bad_gpu_count() -> None:
    with pytest.raises(ValueError, match="num_gpus"):
        build("nvl32", 0)


# --------------------------------------------------------------------------------------------
# failure, straggler and risk helpers
# --------------------------------------------------------------------------------------------


def test_fail_and_repair_gpus() -> None:
    G = small()
    assert fail_gpus(G, ["d1.t0.g1", "d0.t1.g2", "d1.t0.g1"]) == ["d0.t1.g2", "d1.t0.g1"]
    assert state(G, "d0.t1.g2") == "failed"
    assert fail_gpus(G, ["d0.t1.g2"]) == []  # already failed: nothing changed
    assert fail_gpus(G, "d0.t0.g0") == ["d0.t0.g0"]  # a single string id
    assert repair_gpus(G, ["d0.t1.g2", "d0.t1.g3"]) == ["d0.t1.g2"]
    assert state(G, "d0.t1.g2") == "healthy"
    check_topology(G)


def test_helpers_reject_unknown_and_wrong_kind_ids() -> None:
    G = small()
    with pytest.raises(KeyError, match=re.escape("d7.t0.g0")):
        fail_gpus(G, ["d0.t0.g0", "d7.t0.g0"])
    assert state(G, "d0.t0.g0") == "healthy"  # validated before mutating
    with pytest.raises(ValueError, match=re.escape("'d0.t0'")):
        fail_gpus(G, ["d0.t0"])
    with pytest.raises(ValueError, match=re.escape("'d0.t0.g0'")):
        fail_trays(G, ["d0.t0.g0"])
    with pytest.raises(KeyError, match="nope"):
        repair_gpus(G, ["nope"])
    with pytest.raises(ValueError, match="'r0'"):
        set_speed(G, ["r0"], 0.5)
    with pytest.raises(ValueError, match="'d0'"):
        set_p_fail(G, 0.1, ["d0"])


def test_fail_trays_takes_all_gpus() -> None:
    G = small()
    fail_gpus(G, ["d1.t1.g0"])
    out = fail_trays(G, ["d1.t1", "d0.t0"])
    assert out == ["d0.t0.g0", "d0.t0.g1", "d0.t0.g2", "d0.t0.g3"] + [
        f"d1.t1.g{k}" for k in (1, 2, 3)
    ]
    assert all(
        state(G, f"d{d}.t{t}.g{k}") == "failed" for d, t in ((0, 0), (1, 1)) for k in range(4)
    )
    assert all(state(G, f"d0.t1.g{k}") == "healthy" for k in range(4))


def test_fail_random_matches_documented_rng_and_is_deterministic() -> None:
    G1, G2, G3 = nvl32(4), nvl32(4), nvl32(4)
    out1 = fail_random(G1, count=10, seed=7)
    out2 = fail_random(G2, count=10, seed=7)
    out3 = fail_random(G3, count=10, seed=8)
    assert out1 == out2
    assert out1 != out3
    cand = gpus(nvl32(4))
    idx = np.random.default_rng(7).choice(len(cand), size=10, replace=False)
    assert out1 == sorted((cand[i] for i in idx), key=cand.index)
    assert [g for g in gpus(G1) if state(G1, g) == "failed"] == out1


def test_fail_random_fraction_counts() -> None:
    G = nvl32(4)  # 128 GPUs, 32 trays
    assert len(fail_random(G, fraction=0.1)) == 13  # round(12.8)
    G = nvl32(4)
    out = fail_random(G, fraction=0.25, unit="tray", seed=3)
    assert len(out) == 8 * 4  # 8 whole trays
    failed_trays = {t for g in out for t in nbrs(G, g, "tray")}
    assert len(failed_trays) == 8
    assert all(state(G, g) == "failed" for t in failed_trays for g in nbrs(G, t, "gpu"))
    assert fail_random(nvl32(1), fraction=0.0) == []


def test_fail_random_never_picks_failed() -> None:
    G = nvl32(2)
    first = fail_random(G, count=40, seed=1)
    second = fail_random(G, count=24, seed=1)
    assert not set(first) & set(second)
    assert all(state(G, g) == "failed" for g in gpus(G))
    with pytest.raises(ValueError, match="only 0 candidates"):
        fail_random(G, count=1)


def test_fail_random_tray_candidates() -> None:
    G = small()  # 4 trays
    fail_trays(G, ["d0.t0", "d1.t1"])
    fail_gpus(G, ["d0.t1.g0"])
    with pytest.raises(ValueError, match=r"3 trays.*only 2 candidates"):
        fail_random(G, count=3, unit="tray")
    out = fail_random(G, count=2, unit="tray")
    assert out == ["d0.t1.g1", "d0.t1.g2", "d0.t1.g3"] + [f"d1.t0.g{k}" for k in range(4)]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "exactly one"),
        ({"fraction": 0.1, "count": 1}, "exactly one"),
        ({"fraction": 1.5}, "fraction"),
        ({"fraction": math.nan}, "fraction"),
        ({"count": -1}, "count"),
        ({"count": 1.0}, "count"),
        ({"count": 17}, "only 16 candidates"),
        ({"count": 1, "unit": "rack"}, "unit"),
    ],
)
def test_fail_random_rejects_bad_input(kwargs: dict[str, object], needle: str) -> None:
    G = small()
    with pytest.raises(ValueError, match=needle):
        fail_random(G, **kwargs)  # type: ignore[arg-type]
    assert all(state(G, g) == "healthy" for g in gpus(G))


def test_set_speed() -> None:
    G = small()
    assert set_speed(G, ["d1.t0.g0", "d0.t0.g3"], 0.5) == ["d0.t0.g3", "d1.t0.g0"]
    assert G.nodes["d1.t0.g0"]["speed"] == 0.5
    assert G.nodes["d1.t0.g1"]["speed"] == 1.0
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="speed"):
            set_speed(G, ["d0.t0.g0"], bad)


def test_add_stragglers() -> None:
    G = nvl32(2)
    fail_gpus(G, gpus(G)[:32])
    out = add_stragglers(G, count=8, speed=(0.5, 0.8), seed=4)
    assert len(out) == 8
    assert all(state(G, g) == "healthy" for g in out)
    speeds = [G.nodes[g]["speed"] for g in out]
    assert all(0.5 <= s <= 0.8 for s in speeds)
    assert len(set(speeds)) == 8
    assert sum(G.nodes[g]["speed"] != 1.0 for g in gpus(G)) == 8
    G2 = nvl32(2)
    fail_gpus(G2, gpus(G2)[:32])
    assert add_stragglers(G2, count=8, speed=(0.5, 0.8), seed=4) == out
    assert [G2.nodes[g]["speed"] for g in out] == speeds
    G3 = nvl32(2)
    out3 = add_stragglers(G3, fraction=0.25)
    assert len(out3) == 16
    assert all(G3.nodes[g]["speed"] == 0.9 for g in out3)
    with pytest.raises(ValueError, match="only 32 candidates"):
        add_stragglers(G, count=33)
    with pytest.raises(ValueError, match="lo <= hi"):
        add_stragglers(G, count=1, speed=(0.9, 0.5))
    with pytest.raises(ValueError, match="speed"):
        add_stragglers(G, count=1, speed=0.0)


def test_set_p_fail() -> None:
    G = small()
    assert set_p_fail(G, 0.01) == gpus(G)
    assert all(G.nodes[g]["p_fail"] == 0.01 for g in gpus(G))
    assert set_p_fail(G, 0.2, ["d1.t0", "d0.t0.g1"]) == ["d0.t0.g1", "d1.t0"]
    assert G.nodes["d1.t0"]["p_fail"] == 0.2
    assert G.nodes["d1.t0.g0"]["p_fail"] == 0.01  # a tray's p_fail does not touch its GPUs
    for bad in (-0.1, 1.1, math.nan):
        with pytest.raises(ValueError, match="probability"):
            set_p_fail(G, bad)
    check_topology(G)


# --------------------------------------------------------------------------------------------
# check_topology
# --------------------------------------------------------------------------------------------


def test_valid_cluster_with_failures_passes() -> None:
    G = small()
    fail_random(G, count=3)
    add_stragglers(G, count=2, speed=(0.3, 0.9))
    set_p_fail(G, 1.0, ["d0.t0"])
    G.nodes["d0.t0.g0"]["speed"] = 2  # ints and numpy floats are fine
    G.nodes["d0.t0.g1"]["p_fail"] = np.float64(0.5)
    del G.nodes["d0.t0.g2"]["tdp_w"]  # missing optional attributes take their defaults
    del G.nodes["r0"]["power_budget_w"]
    check_topology(G)


def _set(node: str, attr: str, value: object) -> Callable[[nx.Graph], None]:
    def f(G: nx.Graph) -> None:
        G.nodes[node][attr] = value

    return f


def _del_kind(G: nx.Graph) -> None:
    del G.nodes["d0.t0.g0"]["kind"]


def _site_budget(G: nx.Graph) -> None:
    G.graph["power_budget_w"] = math.nan


def _edge(u: str, v: str) -> Callable[[nx.Graph], None]:
    return lambda G: G.add_edge(u, v)


def _unedge(u: str, v: str) -> Callable[[nx.Graph], None]:
    return lambda G: G.remove_edge(u, v)


def _empty_tray(G: nx.Graph) -> None:
    G.remove_nodes_from([f"d1.t1.g{k}" for k in range(4)])
    G.nodes["d1"]["size"] = 4


def _lonely_domain(G: nx.Graph) -> None:
    G.add_node("d9", kind="domain", size=4)


def _bad_bandwidth(G: nx.Graph) -> None:
    G.edges["d0", "leaf0"]["bandwidth_gbps"] = -5.0


CORRUPTIONS: list[tuple[str, Callable[[nx.Graph], None], list[str]]] = [
    ("no kind", _del_kind, ["'d0.t0.g0'", "no 'kind'"]),
    ("unknown kind", _set("r1", "kind", "pdu"), ["'r1'", "unknown kind 'pdu'"]),
    ("gpu state", _set("d0.t1.g2", "state", "broken"), ["'d0.t1.g2'", "state 'broken'"]),
    ("speed zero", _set("d1.t0.g0", "speed", 0.0), ["'d1.t0.g0'", "speed 0.0"]),
    ("speed nan", _set("d1.t0.g0", "speed", math.nan), ["'d1.t0.g0'", "speed nan"]),
    ("speed inf", _set("d1.t0.g0", "speed", math.inf), ["'d1.t0.g0'", "speed inf"]),
    ("speed str", _set("d1.t0.g0", "speed", "fast"), ["'d1.t0.g0'", "speed 'fast'"]),
    ("p_fail > 1", _set("d0.t0.g3", "p_fail", 1.5), ["'d0.t0.g3'", "p_fail 1.5"]),
    ("p_fail < 0", _set("d0.t0.g3", "p_fail", -0.1), ["'d0.t0.g3'", "p_fail -0.1"]),
    ("tdp zero", _set("d0.t0.g3", "tdp_w", 0), ["'d0.t0.g3'", "tdp_w 0"]),
    ("tdp nan", _set("d0.t0.g3", "tdp_w", math.nan), ["'d0.t0.g3'", "tdp_w nan"]),
    ("tray p_fail", _set("d1.t1", "p_fail", 2.0), ["tray 'd1.t1'", "p_fail 2.0"]),
    ("domain size 0", _set("d1", "size", 0), ["domain 'd1'", "size 0"]),
    ("domain size float", _set("d1", "size", 8.0), ["domain 'd1'", "size 8.0"]),
    ("domain size bool", _set("d1", "size", True), ["domain 'd1'", "size True"]),
    ("domain size missing", _set("d1", "size", None), ["domain 'd1'", "size None"]),
    ("rack budget < 0", _set("r1", "power_budget_w", -1.0), ["rack 'r1'", "power_budget_w -1.0"]),
    ("rack budget inf", _set("r1", "power_budget_w", math.inf), ["rack 'r1'", "inf"]),
    ("site budget", _site_budget, ["site power_budget_w", "nan"]),
    ("switch tier", _set("spine0", "tier", "core"), ["switch 'spine0'", "tier 'core'"]),
    ("gpu-domain edge", _edge("d0.t0.g0", "d1"), ["'d0.t0.g0'-'d1'", "gpu-domain"]),
    ("gpu-gpu edge", _edge("d0.t0.g0", "d0.t0.g1"), ["'d0.t0.g0'-'d0.t0.g1'", "gpu-gpu"]),
    ("rack-domain edge", _edge("r0", "d1"), ["'d1'-'r0'", "domain-rack"]),
    ("self-loop", _edge("d0.t1", "d0.t1"), ["self-loop on tray 'd0.t1'"]),
    ("domain-spine", _edge("d1", "spine0"), ["domain 'd1'", "switch 'spine0'", "tier 'spine'"]),
    ("gpu without tray", _unedge("d0.t1.g1", "d0.t1"), ["GPU 'd0.t1.g1' is in no tray"]),
    ("gpu in 2 trays", _edge("d0.t1.g1", "d0.t0"), ["GPU 'd0.t1.g1' is in 2 trays"]),
    (
        "gpu in 2 domains",
        _edge("d0.t1.g1", "d1.t0"),
        ["GPU 'd0.t1.g1' is reachable from 2 domains: 'd0', 'd1'"],
    ),
    ("tray without gpu", _empty_tray, ["tray 'd1.t1' has no GPU"]),
    ("tray without domain", _unedge("d1.t0", "d1"), ["tray 'd1.t0' is in no domain"]),
    ("tray spans domains", _edge("d1.t0", "d0"), ["tray 'd1.t0' spans domains"]),
    ("tray without rack", _unedge("d0.t1", "r0"), ["tray 'd0.t1' is in no rack"]),
    ("tray in 2 racks", _edge("d0.t1", "r1"), ["tray 'd0.t1' is in 2 racks: 'r0', 'r1'"]),
    ("size mismatch", _set("d1", "size", 7), ["domain 'd1' has size 7 but contains 8 GPUs"]),
    ("domain without tray", _lonely_domain, ["domain 'd9' has no tray"]),
    ("bandwidth", _bad_bandwidth, ["'d0'-'leaf0'", "bandwidth_gbps -5.0"]),
]


@pytest.mark.parametrize(
    ("corrupt", "needles"), [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS]
)
def test_check_topology_detects(corrupt: Callable[[nx.Graph], None], needles: list[str]) -> None:
    G = small()
    check_topology(G)
    corrupt(G)
    with pytest.raises(TopologyError) as info:
        check_topology(G)
    err = info.value
    assert isinstance(err, ValueError)
    assert any(all(n in p for n in needles) for p in err.problems), err.problems
    for n in needles:
        assert n in str(err)


def test_corruptions_also_flag_consequences() -> None:
    G = small()
    _edge("d1.t0", "d0")(G)  # tray in two domains: d0 now holds 12 GPUs
    with pytest.raises(TopologyError) as info:
        check_topology(G)
    assert "domain 'd0' has size 8 but contains 12 GPUs" in info.value.problems


def test_check_topology_reports_every_problem_and_truncates() -> None:
    G = nvl32(1)
    for g in gpus(G):
        G.nodes[g]["speed"] = -1.0
    G.add_edge("d0.t0.g0", "d0")
    with pytest.raises(TopologyError) as info:
        check_topology(G)
    err = info.value
    assert len(err.problems) == 33
    text = str(err)
    assert text.startswith("invalid cluster topology (33 problems):")
    assert text.count("\n  - ") == 20
    assert text.endswith("... and 13 more")


def test_topology_error_pickles() -> None:
    err = TopologyError(["a", "b"])
    back = pickle.loads(pickle.dumps(err))
    assert back.problems == ["a", "b"]
    assert str(back) == str(err)


def test_helpers_on_hand_built_graph_without_builder_defaults() -> None:
    G = nx.Graph(name="hand")
    G.add_node("dom", kind="domain", size=2)
    G.add_node("host", kind="tray")
    G.add_node("rack", kind="rack")
    G.add_nodes_from([("a", {"kind": "gpu"}), ("b", {"kind": "gpu"})])
    G.add_edges_from([("a", "host"), ("b", "host"), ("host", "dom"), ("host", "rack")])
    check_topology(G)
    assert fail_random(G, count=1, seed=0) in (["a"], ["b"])
    assert len(fail_random(G, count=1, unit="tray")) == 1  # only the remaining healthy GPU
    assert [G.nodes[g]["state"] for g in ("a", "b")] == ["failed", "failed"]


def test_public_api_is_exported() -> None:
    for name in topo.__all__:
        assert hasattr(topo, name)
