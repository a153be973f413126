"""MODEL.md v1.1 attributes: max_power_w, uuid, host, index; the hardware table."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from ntp_opt import hardware
from ntp_opt.files import InputError, instance_from_dict, instance_to_dict
from ntp_opt.instance import Instance
from ntp_opt.topology import TopologyError, check_topology

from .helpers import make_instance


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
        ({"max_power_w": 900.0}, "max_power_w: Value error, 900 is below tdp_w 1000"),
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
    # MODEL.md section 6b board powers; maxima as documented in ntp_opt.hardware
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
