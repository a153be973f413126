"""Fuzzing the instance and plan loaders: every bad file gets an InputError that
names the file and the field, fast and with bounded memory, never a traceback
from deeper inside the package; the CLI turns it into exit status 2."""

from __future__ import annotations

import copy
import gzip
import json
import math
import time
import tracemalloc
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt import solve
from ntp_opt.app.cli import main
from ntp_opt.model.files import (
    InputError,
    caps,
    instance_to_dict,
    load_instance,
    load_plan,
    plan_to_dict,
)
from ntp_opt.model.files.safe_json import field_path
from ntp_opt.planners import heuristics as baselines
from tests.helpers import make_instance, planned

INST = make_instance(domains=2, size=8, tray=4, failed=1, stragglers=1, name="fuzz")
INST_DICT = instance_to_dict(INST)
PLAN_DICT = plan_to_dict(planned(baselines.ntp_pw, INST))

#: Values that are wrong almost anywhere: wrong types, NaN/inf, negative and huge numbers.
bad_values = st.sampled_from(
    [
        None,
        True,
        "x",
        "",
        [],
        {},
        [1, "a"],
        {"a": 1},
        -1,
        0,
        -1e300,
        1e300,
        10**30,
        -(10**30),
        10_000_000,
        math.nan,
        math.inf,
        -math.inf,
        2.5,
    ]
)


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indices) into ``data``, sampling long lists."""
    out = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i in sorted({0, 1, len(data) // 2, len(data) - 1} & set(range(len(data)))):
            out += _paths(data[i], (*prefix, i))
    return out


INST_PATHS = _paths(INST_DICT)[1:]
PLAN_PATHS = _paths(PLAN_DICT)[1:]


@st.composite
def mutated(draw: st.DrawFn, base: dict, paths: list[tuple]) -> tuple[dict, tuple, str]:
    """A deep copy of ``base`` with one field replaced, deleted or an unknown one added."""
    data = copy.deepcopy(base)
    path = draw(st.sampled_from(paths))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    how = draw(st.sampled_from(["replace", "delete", "unknown"]))
    if how == "replace":
        parent[path[-1]] = draw(bad_values)
    elif how == "delete":
        del parent[path[-1]]
    else:
        target = parent[path[-1]] if isinstance(parent[path[-1]], dict) else parent
        if isinstance(target, dict):
            target["colour"] = draw(bad_values)
        else:
            how = "replace"
            parent[path[-1]] = draw(bad_values)
    return data, path, how


def _field(path: tuple) -> str:
    return field_path(path)


def _load(loader, text: str, suffix: str = ".json"):
    with TemporaryDirectory() as tmp:
        p = Path(tmp) / f"in{suffix}"
        if suffix == ".json.gz":
            p.write_bytes(gzip.compress(text.encode()))
        else:
            p.write_text(text)
        start = time.perf_counter()
        try:
            return loader(p), None, p
        except InputError as err:
            assert time.perf_counter() - start < 2
            return None, err, p


def _check_error(err: InputError, path: Path) -> None:
    msg = str(err)
    assert err.source == str(path)
    assert err.problems
    for line in msg.splitlines():
        assert line.startswith(f"{path}: "), line
    assert "Traceback" not in msg


@given(mutated(INST_DICT, INST_PATHS), st.sampled_from([".json", ".json.gz"]))
def test_instance_loader_fuzz(case, suffix):
    data, path, how = case
    text = json.dumps(data)  # NaN/Infinity are written as such, and must be refused
    inst, err, p = _load(load_instance, text, suffix)
    if err is None:
        # an accepted change must still be a valid instance (e.g. a dropped optional field)
        # (or one with no feasible plan at all, e.g. a site budget below the idle draw)
        assert inst is not None
        res = solve(inst, "ntp")
        assert res.status == "infeasible" or (res.plan is not None and res.evaluation.feasible)
        return
    _check_error(err, p)
    # the error names the field (or, for a node/edge/job, the object holding it)
    fields = [f for f, _ in err.problems]
    top = _field(path[:1])
    # (an unknown key added beside a scalar lands in its parent: it is named itself)
    assert any(
        f.startswith(top) or f == "" or top == "format" or (how == "unknown" and "colour" in f)
        for f in fields
    ), (path, fields)
    if how == "unknown" and path[0] == "job":
        assert any("colour" in f for f in fields), fields


@given(mutated(PLAN_DICT, PLAN_PATHS))
def test_plan_loader_fuzz(case):
    data, path, how = case
    plan, err, p = _load(load_plan, json.dumps(data))
    if err is None:
        assert plan is not None
        return
    _check_error(err, p)
    top = _field(path[:1])
    assert any(
        f.startswith(top) or top == "format" or (how == "unknown" and "colour" in f)
        for f, _ in err.problems
    ), (path, err)


@given(st.binary(max_size=200), st.sampled_from([".json", ".json.gz"]))
def test_random_bytes_are_input_errors(blob, suffix):
    for loader in (load_instance, load_plan):
        with TemporaryDirectory() as tmp:
            p = Path(tmp) / f"x{suffix}"
            p.write_bytes(blob)  # for .gz: not a gzip stream at all, or a corrupt one
            with pytest.raises(InputError) as err:
                loader(p)
            _check_error(err.value, p)


@given(st.integers(1, len(json.dumps(INST_DICT)) - 1))
def test_truncated_instance_is_malformed_json(cut):
    text = json.dumps(INST_DICT)[:cut]
    _, err, p = _load(load_instance, text)
    assert err is not None
    _check_error(err, p)


def test_deeply_nested_json(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputError) as err:
        load_instance(p)
    _check_error(err.value, p)


def _bounded(path: Path, field: str) -> InputError:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(InputError) as err:
            load_instance(path)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _check_error(err.value, path)
    assert any(f.startswith(field) for f, _ in err.value.problems), err.value.problems
    assert elapsed < 2, elapsed
    assert peak < 400 * 2**20, peak
    return err.value


def test_ten_million_gpu_domain_is_refused_fast(tmp_path):
    data = copy.deepcopy(INST_DICT)
    for node in data["cluster"]["nodes"]:
        if node["kind"] == "domain":
            node["size"] = 10_000_000
            break
    p = tmp_path / "huge-domain.json"
    p.write_text(json.dumps(data))
    _bounded(p, "cluster.nodes[")


def test_ten_million_gpus_gzip_is_refused_fast(tmp_path):
    """A small .json.gz whose node list holds 10 million GPUs (350 MB of JSON)."""
    per = 100_000
    block = b"".join(b'{"id": "g", "kind": "gpu"}, ' for _ in range(per))
    member = gzip.compress(block, compresslevel=9)
    p = tmp_path / "bomb.json.gz"
    with p.open("wb") as fh:  # concatenated gzip members decompress to one stream
        fh.write(
            gzip.compress(b'{"format": "ntp-opt/instance@1", "name": "x", "cluster": {"nodes": [')
        )
        for _ in range(10_000_000 // per):
            fh.write(member)
        fh.write(gzip.compress(b'{"id": "last", "kind": "gpu"}]}, "job": {}}'))
    assert p.stat().st_size < 5 * 2**20
    err = _bounded(p, "cluster.nodes")
    assert "more than" in str(err)


def test_node_cap_in_plain_file(tmp_path, monkeypatch):
    monkeypatch.setattr(caps, "MAX_NODES", 20)
    p = tmp_path / "many.json"
    p.write_text(json.dumps(INST_DICT))
    err = _bounded(p, "cluster.nodes")
    assert "more than 20 nodes" in str(err)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["job"].update(tp=math.nan), "job.tp"),
        (lambda d: d["job"].update(global_batch=10**30), "job.global_batch"),
        (lambda d: d["cluster"]["nodes"][5].update(tdp_w=math.inf), "cluster.nodes[5].tdp_w"),
        (lambda d: d["cluster"].pop("nodes"), "cluster.nodes"),
        (lambda d: d.pop("job"), "job"),
    ],
)
def test_cli_reports_file_and_field(tmp_path, capsys, mutate, field):
    data = copy.deepcopy(INST_DICT)
    mutate(data)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    assert main(["info", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ntp-opt: error: {p}: {field}"), err
    assert "Traceback" not in err
