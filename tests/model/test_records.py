"""Instances straight into arrays: the column checks against the reference path.

:func:`ntp_opt.model.files.instance_from_dict` compiles the cluster's records
column by column and builds the graph only when ``instance.cluster`` is read;
:func:`ntp_opt.model.files.instance_from_dict_reference` validates every record
through pydantic and builds the graph first. Both must give the same instance
(arrays, fields, graph) or the same error.
"""

from __future__ import annotations

import copy
import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt.model import topology
from ntp_opt.model.files import (
    InputError,
    check_cluster,
    dumps_indented,
    instance_from_dict,
    instance_from_dict_reference,
    instance_to_dict,
    load_instance,
    parse_json,
    read_json,
    save_instance,
)
from ntp_opt.model.instance import ClusterArrays, Instance, compile_cluster
from ntp_opt.model.job import Job
from ntp_opt.model.records import compile_records
from ntp_opt.solve import solve
from tests.helpers import make_instance

INSTANCES = Path(__file__).resolve().parents[2] / "instances"
BUNDLED = sorted(p for p in INSTANCES.iterdir() if p.name.endswith((".json", ".json.gz")))
BUNDLED = [p for p in BUNDLED if p.name not in ("best_known.json",)]


def _is_lazy(instance: Instance) -> bool:
    """Whether the graph is not built yet (the column path was taken)."""
    return "cluster" not in vars(instance)


def assert_same_arrays(a: ClusterArrays, b: ClusterArrays) -> None:
    for name, x in vars(a).items():
        y = getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(x, y), name
            assert not x.flags.writeable, name
        elif name == "domain_gpus":
            assert len(x) == len(y)
            for u, v in zip(x, y, strict=True):
                assert u.dtype == v.dtype and np.array_equal(u, v)
        else:
            assert x == y and type(x) is type(y), name


def assert_same_graph(g, h) -> None:
    assert g.graph == h.graph and list(g.graph) == list(h.graph)
    gn, hn = list(g.nodes(data=True)), list(h.nodes(data=True))
    assert gn == hn
    # attribute order and value types too (saving writes them in this order)
    assert [[(k, type(v)) for k, v in d.items()] for _, d in gn] == [
        [(k, type(v)) for k, v in d.items()] for _, d in hn
    ]
    ge, he = list(g.edges(data=True)), list(h.edges(data=True))
    assert ge == he
    assert [[(k, type(v)) for k, v in d.items()] for *_, d in ge] == [
        [(k, type(v)) for k, v in d.items()] for *_, d in he
    ]


def assert_equivalent(data: dict[str, Any]) -> Instance:
    """The column path on ``data`` equals the reference path; returns the former."""
    ref = instance_from_dict_reference(copy.deepcopy(data), "x")
    fast = instance_from_dict(data, "x")
    assert _is_lazy(fast)
    assert (fast.name, fast.job, fast.meta) == (ref.name, ref.job, ref.meta)
    assert_same_arrays(fast.arrays, ref.arrays)
    assert np.array_equal(fast.max_multiplier, ref.max_multiplier)
    assert_same_graph(fast.cluster, ref.cluster)
    assert fast == ref
    assert not _is_lazy(fast)
    return fast


#: Files up to this size (bytes) are also loaded the reference way (slow at 16k+ GPUs).
REFERENCE_BYTES = 100_000


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.name)
def test_bundled_instances_load_the_same_both_ways(path):
    fast = load_instance(path)
    assert _is_lazy(fast)
    if path.stat().st_size > REFERENCE_BYTES:  # the lazy graph, checked and compiled
        topology.check_topology(fast.cluster)
        assert_same_arrays(fast.arrays, compile_cluster(fast.cluster))
        return
    ref = instance_from_dict_reference(read_json(path), str(path))
    assert (fast.name, fast.job, fast.meta) == (ref.name, ref.job, ref.meta)
    assert_same_arrays(fast.arrays, ref.arrays)
    plan = solve(fast, "fast").plan
    assert _is_lazy(fast)  # planning and validating never read the graph
    assert plan == solve(ref, "fast").plan
    assert_same_graph(fast.cluster, ref.cluster)


def _random_graph(rng: random.Random):
    kind = rng.choice(list(topology.BUILDERS))
    size = topology.DOMAIN_SIZE[kind]
    g = topology.build(kind, size * rng.randint(1, 6), rack_power_factor=rng.choice([1.0, 1.3]))
    gpus = topology.gpus(g)
    if rng.random() < 0.7:
        topology.fail_random(g, count=rng.randint(0, len(gpus) // 4), seed=rng.randint(0, 99))
    if rng.random() < 0.5:
        topology.add_stragglers(
            g, count=rng.randint(1, 5), speed=(0.5, 0.9), seed=rng.randint(0, 99)
        )
    for gid in rng.sample(gpus, k=min(len(gpus), rng.randint(0, 5))):
        node = g.nodes[gid]
        node["max_power_w"] = node["tdp_w"] * rng.choice([1.0, 1.25])
        node["uuid"] = f"GPU-{rng.randint(0, 10**6)}"
        node["host"] = "h1"
        node["index"] = rng.randint(0, 7)
    if rng.random() < 0.5:
        for t in topology.trays(g)[:2]:
            g.nodes[t]["p_fail"] = 0.01
            g.nodes[t]["host"] = "tray-host"
    return g, size


@pytest.mark.parametrize("seed", range(12))
def test_random_instances_load_the_same_both_ways(seed, tmp_path):
    rng = random.Random(seed)
    g, size = _random_graph(rng)
    inst = Instance(f"r{seed}", g, Job(tp=min(size, 8), pp=1, dp=1, global_batch=4))
    data = json.loads(json.dumps(instance_to_dict(inst)))
    if seed % 3 == 0:  # integers where the schema takes floats, absent defaults, int ids
        for node in data["cluster"]["nodes"]:
            if node["kind"] == "gpu":
                node["tdp_w"] = int(node["tdp_w"])
                node.pop("p_fail")
                node.pop("state") if node["state"] == "healthy" else None
            if node["kind"] == "switch" and node["tier"] == "leaf":
                node.pop("tier")
    if seed % 4 == 1:  # integer node ids
        ids = {n["id"]: i for i, n in enumerate(data["cluster"]["nodes"])}
        for node in data["cluster"]["nodes"]:
            node["id"] = ids[node["id"]]
        for e in data["cluster"]["edges"]:
            e["source"], e["target"] = ids[e["source"]], ids[e["target"]]
    fast = assert_equivalent(data)
    # and through a file: the same bytes back
    save_instance(fast, tmp_path / "a.json")
    assert_equivalent(read_json(tmp_path / "a.json"))


BAD_VALUES: list[Any] = [
    None, True, False, -1, 0, 0.5, 1, 1.5, 1e7, 1e13, "x", "", [], {}, 10**30,
    "healthy", "failed", "leaf", "spine", "gpu", "tray", 3, 1000.0, 2e-7, "d0",
]  # fmt: skip
FIELDS = [
    "id", "kind", "state", "speed", "p_fail", "tdp_w", "max_power_w", "uuid", "host",
    "index", "size", "power_budget_w", "tier", "extra",
]  # fmt: skip


def _mutate(data: dict[str, Any], rng: random.Random) -> None:
    cl = data["cluster"]
    nodes, edges = cl["nodes"], cl["edges"]
    what = rng.randrange(8)
    if what <= 2:
        node = rng.choice(nodes)
        node[rng.choice(FIELDS)] = copy.deepcopy(rng.choice(BAD_VALUES))
    elif what == 3:
        node = rng.choice(nodes)
        node.pop(rng.choice(list(node)))
    elif what == 4:
        nodes.append(copy.deepcopy(rng.choice(nodes)))
    elif what == 5:
        a, b = rng.choice(nodes)["id"], rng.choice(nodes)["id"]
        edges.append({"source": a, "target": b})
    elif what == 6 and edges:
        edges.pop(rng.randrange(len(edges)))
    else:
        e = rng.choice(edges)
        e[rng.choice(["source", "target", "bandwidth_gbps", "x"])] = copy.deepcopy(
            rng.choice(BAD_VALUES)
        )


def _outcome(build, data):
    try:
        return build(copy.deepcopy(data), "bad.json")
    except InputError as err:
        return str(err)


@pytest.mark.parametrize("seed", range(40))
def test_corrupted_records_give_the_reference_outcome(seed):
    rng = random.Random(1000 + seed)
    inst = make_instance(domains=4, size=8, tray=4, failed=2, stragglers=1, seed=seed)
    data = json.loads(json.dumps(instance_to_dict(inst)))
    for _ in range(rng.randint(1, 3)):
        _mutate(data, rng)
    fast = _outcome(instance_from_dict, data)
    ref = _outcome(instance_from_dict_reference, data)
    if isinstance(ref, str):
        assert fast == ref
    else:
        assert isinstance(fast, Instance)
        assert_same_arrays(fast.arrays, ref.arrays)
        assert_same_graph(fast.cluster, ref.cluster)


def test_column_checks_refuse_what_they_cannot_prove():
    inst = make_instance(domains=2, size=8, tray=4)
    data = json.loads(json.dumps(instance_to_dict(inst)))
    nodes, edges = data["cluster"]["nodes"], data["cluster"]["edges"]
    assert compile_records(nodes, edges, None) is not None
    assert compile_records(nodes, [*edges, dict(edges[0])], None) is None  # repeated edge
    assert compile_records(nodes, edges, None, min_domain=16) is None  # domains below tp
    flipped = [*edges, {"source": edges[0]["target"], "target": edges[0]["source"]}]
    assert compile_records(nodes, flipped, None) is None
    for extra in ({"weight": 1.0}, {"bandwidth_gbps": 1.0, "weight": 1.0}, {"bandwidth_gbps": 0}):
        changed = [{**edges[0], **extra}, *edges[1:]]
        assert compile_records(nodes, changed, None) is None, extra
    assert compile_records(nodes, [{**edges[0], "bandwidth_gbps": 5}, *edges[1:]], None)


def test_lazy_graph_variants_match_the_eager_ones():
    inst = make_instance(domains=4, size=8, tray=4, failed=3, stragglers=2, seed=3)
    data = json.loads(json.dumps(instance_to_dict(inst)))
    lazy, eager = instance_from_dict(data), instance_from_dict_reference(data)
    healthy = lazy.arrays.healthy.copy()
    healthy[:5] = ~healthy[:5]
    speed = lazy.arrays.speed.copy()
    speed[7] = 0.25
    a, b = lazy.with_health(healthy, speed), eager.with_health(healthy, speed)
    assert _is_lazy(a) and _is_lazy(lazy)
    assert_same_arrays(a.arrays, b.arrays)
    assert_same_graph(a.cluster, b.cluster)
    job = lazy.job.model_copy(update={"max_boost": 0.0})
    fresh = instance_from_dict(data)
    c, d = fresh.with_job(job), eager.with_job(job)
    assert _is_lazy(c) and c.arrays is fresh.arrays
    assert c.job == d.job and c == d
    with pytest.raises(topology.TopologyError, match="larger than 4 NVLink domain"):
        instance_from_dict(data).with_job(job.model_copy(update={"tp": 16}))


def test_repr_leaves_the_graph_unbuilt():
    inst = make_instance(domains=2, size=8, tray=4)
    lazy = instance_from_dict(json.loads(json.dumps(instance_to_dict(inst))))
    assert "graph not built yet" in repr(lazy) and _is_lazy(lazy)
    assert repr(inst).startswith("Instance(name='small', cluster=<networkx")


def test_lazy_instance_pickles_with_its_graph():
    inst = make_instance(domains=2, size=8, tray=4, failed=1)
    lazy = instance_from_dict(json.loads(json.dumps(instance_to_dict(inst))))
    back = pickle.loads(pickle.dumps(lazy))
    assert back == inst and not _is_lazy(back)
    assert_same_arrays(inst.arrays, back.arrays)


# --- the fast indented encoder ---------------------------------------------------

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5), inner, max_size=5)
    ),
    max_leaves=30,
)


@given(_json_values, st.integers(0, 3))
def test_dumps_indented_is_json_dumps(value, indent):
    assert dumps_indented(value, indent) == json.dumps(value, indent=indent, allow_nan=False)


@pytest.mark.parametrize(
    "value", [float("nan"), [1.0, float("inf")], {1: 2}, {"a": np.float32(1)}, [np.int64(3)]]
)
def test_dumps_indented_leaves_the_rest_to_json(value):
    try:
        expected = json.dumps(value, indent=1, allow_nan=False)
    except (TypeError, ValueError) as err:
        with pytest.raises(type(err), match="JSON"):
            dumps_indented(value)
    else:
        assert dumps_indented(value) == expected


def test_check_cluster_takes_the_columns_then_the_schema():
    g = topology.build("nvl32", 64)
    check_cluster(g)  # valid: proven by the column checks
    g.nodes["d0.t0.g0"]["speed"] = 0.0  # out of range: the schema names it
    with pytest.raises(InputError, match=r"gen: cluster\.nodes\[2\]\.speed: Input should be"):
        check_cluster(g, "gen")
    g.nodes["d0.t0.g0"]["speed"] = 0.5
    g.remove_edge("d0.t0", "r0")  # a topology problem is not the schema's: accepted
    check_cluster(g)


def test_lazy_health_variants_keep_no_chain():
    """Many with_health steps on a lazy instance: the graph the eager steps build, no chain."""
    inst = make_instance(domains=4, size=8, tray=4, failed=2, stragglers=1, seed=4)
    data = json.loads(json.dumps(instance_to_dict(inst)))
    lazy, eager = instance_from_dict(data), instance_from_dict_reference(data)
    rng = np.random.default_rng(0)
    for step in range(1500):  # deeper than the recursion limit, were variants chained
        healthy = lazy.arrays.healthy.copy()
        speed = lazy.arrays.speed.copy()
        i = int(rng.integers(healthy.size))
        if step % 2:
            healthy[i] = not healthy[i]
        else:
            speed[i] = float(rng.choice([0.5, 0.8, 1.0]))
        lazy = lazy.with_health(healthy, speed)
        if step % 100 == 0 or step > 1490:
            eager = eager.with_health(healthy, speed)
    assert _is_lazy(lazy)
    assert_same_arrays(lazy.arrays, eager.arrays)
    assert_same_graph(lazy.cluster, eager.cluster)
    assert lazy == eager


@pytest.mark.parametrize(
    "text",
    [
        b'{"a": 1, "a": 2}',
        b'{"a": "\\u003a", "a": 1}',
        b'{"a": "x:y", "b": {"c": 1, "c": 1}}',
        b'{"a": [1e999]}',
        b'{"a": NaN}',
        b'[{"k": 1}, {"k": -Infinity}]',
    ],
)
def test_fast_parse_defers_to_the_checked_one(text):
    with pytest.raises(InputError) as err:
        parse_json(text, "x.json")
    assert "x.json" in str(err.value)


def test_fast_parse_keeps_colons_in_strings():
    text = b'{"url": "https://a:b", "n": [1, 2.5, "c:"], "o": {"k": null}}'
    assert parse_json(text, "x.json") == json.loads(text)


@pytest.mark.parametrize("where", ["nodes", "edges"])
@pytest.mark.parametrize("record", [["kind", "gpu"], "kind", 7, None, 1.5, True])
def test_records_that_are_not_objects_give_the_reference_error(where, record):
    inst = make_instance(domains=2, size=8, tray=4)
    data = json.loads(json.dumps(instance_to_dict(inst)))
    nodes, edges = data["cluster"]["nodes"], data["cluster"]["edges"]
    assert compile_records(nodes, edges, None) is not None
    data["cluster"][where].insert(3, record)
    assert compile_records(data["cluster"]["nodes"], data["cluster"]["edges"], None) is None
    fast = _outcome(instance_from_dict, data)
    assert isinstance(fast, str) and fast == _outcome(instance_from_dict_reference, data)


def test_records_with_as_many_keys_but_other_keys_compile():
    """Equal key counts are only a shortcut: GPUs with a ``uuid`` and GPUs with a
    ``host`` instead (as many keys) still take the column path, equal to the reference."""
    inst = make_instance(domains=2, size=8, tray=4)
    data = json.loads(json.dumps(instance_to_dict(inst)))
    gpus = [n for n in data["cluster"]["nodes"] if n["kind"] == "gpu"]
    for i, node in enumerate(gpus):
        node["uuid" if i % 2 else "host"] = f"x{i}"
    assert len({len(n) for n in gpus}) == 1 and len({tuple(sorted(n)) for n in gpus}) == 2
    compiled = compile_records(data["cluster"]["nodes"], data["cluster"]["edges"], None)
    assert compiled is not None
    assert compiled.n_keys == sum(map(len, data["cluster"]["nodes"])) + sum(
        map(len, data["cluster"]["edges"])
    )
    assert_equivalent(data)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=3)
)


@st.composite
def _record_lists(draw, depth: int = 2):
    """Lists of objects with the same keys (the encoder's column path): scalar fields,
    lists of scalars, lists of such records, anything else now and then."""
    keys = draw(st.lists(st.sampled_from(["a", "b{", "}c", 'd"', "é"]), unique=True))
    kinds = {k: draw(st.sampled_from(["scalar", "list", "records", "any"])) for k in keys}
    inner = _record_lists(depth - 1) if depth else st.just([])

    def value(kind: str):
        if kind == "scalar":
            return draw(_scalars)
        if kind == "list":
            return draw(st.lists(_scalars, max_size=3) | st.tuples(_scalars))
        if kind == "records":
            return draw(inner)
        return draw(_json_values)

    return [{k: value(kinds[k]) for k in keys} for _ in range(draw(st.integers(1, 4)))]


@given(_record_lists(), st.integers(0, 2))
def test_dumps_indented_of_records_is_json_dumps(records, indent):
    for value in (records, {"replicas": records}, [records, records]):
        assert dumps_indented(value, indent) == json.dumps(value, indent=indent, allow_nan=False)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: [d], "bad.json: expected a JSON object, got list"),
        (lambda d: {**d, "format": "ntp-opt/plan@1"}, "bad.json: format: expected"),
        (lambda d: {k: v for k, v in d.items() if k != "format"}, "got None"),
        (lambda d: {**d, "cluster": []}, "bad.json: cluster: Input should be"),
        (lambda d: {**d, "name": ""}, "bad.json: name: String should have at least 1"),
        (lambda d: d, None),
    ],
    ids=["not-object", "other-format", "no-format", "cluster-list", "bad-name", "valid"],
)
def test_format_and_head_errors_are_the_reference_ones(mutate, expected, tmp_path, monkeypatch):
    """``instance_from_dict`` leaves every file it cannot compile to the reference path:
    the same error (or instance) from both, and from ``load_instance`` of the file."""
    inst = make_instance(domains=2, size=8, tray=4)
    data = mutate(json.loads(json.dumps(instance_to_dict(inst))))
    fast = _outcome(instance_from_dict, data)
    reference = _outcome(instance_from_dict_reference, data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    loaded = _outcome(lambda d, source: load_instance("bad.json"), data)
    if expected is None:
        assert isinstance(fast, Instance) and fast == reference == loaded == inst
    else:
        assert isinstance(fast, str) and expected in fast
        assert fast == reference == loaded


def test_node_cap_gives_the_reference_error(monkeypatch):
    """A cluster over ``caps.MAX_NODES`` is refused by both paths, with the same message."""
    from ntp_opt.model.files import caps

    inst = make_instance(domains=2, size=8, tray=4)
    data = json.loads(json.dumps(instance_to_dict(inst)))
    monkeypatch.setattr(caps, "MAX_NODES", len(data["cluster"]["nodes"]) - 1)
    fast = _outcome(instance_from_dict, data)
    reference = _outcome(instance_from_dict_reference, data)
    assert isinstance(fast, str) and "cluster.nodes: declares more than" in fast
    assert fast == reference
