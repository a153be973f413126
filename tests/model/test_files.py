"""Instance and plan files: round trips, published schemas, clear errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ntp_opt.model.files import (
    InputError,
    instance_from_dict,
    instance_to_dict,
    json_schema,
    load_instance,
    load_plan,
    plan_from_dict,
    plan_to_dict,
    save_instance,
    save_plan,
)
from ntp_opt.planners import heuristics as baselines
from tests.helpers import make_instance, planned

SCHEMAS = Path(__file__).resolve().parents[2] / "ntp_opt" / "schemas"


@pytest.fixture(scope="module")
def inst():
    return make_instance(
        failed=2,
        stragglers=2,
        rack_power_factor=1.2,
        seed=5,
        batch_policy="elastic",
        tp_efficiency={7: 0.98},
    )


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_instance_round_trip(tmp_path, inst, suffix):
    path = tmp_path / f"x{suffix}"
    save_instance(inst, path)
    back = load_instance(path)
    assert back == inst
    assert back.job == inst.job and back.job.tp_efficiency == {7: 0.98}
    # and the file is stable: saving the loaded instance gives the same bytes
    path2 = tmp_path / f"y{suffix}"
    save_instance(back, path2)
    assert path2.read_bytes() == path.read_bytes()


def test_round_trip_detects_changes(inst):
    data = instance_to_dict(inst)
    data["cluster"]["nodes"][3]["speed"] = 0.5
    assert instance_from_dict(data) != inst


def test_plan_round_trip(tmp_path, inst):
    plan = planned(baselines.ntp_pw, inst)
    path = tmp_path / "p.json"
    save_plan(plan, path)
    back = load_plan(path)
    assert back == plan
    assert plan_from_dict(plan_to_dict(plan)) == plan


def test_save_plan_needs_metrics(inst):
    plan = planned(baselines.ntp, inst)
    from ntp_opt.model.plan import Plan

    with pytest.raises(ValueError, match="goodput"):
        plan_to_dict(Plan(plan.instance, plan.replicas))


@pytest.mark.parametrize("kind", ["instance", "plan"])
def test_published_schema_is_current(kind):
    published = json.loads((SCHEMAS / f"{kind}@1.schema.json").read_text())
    assert published == json_schema(kind), (
        f"regenerate with: ntp-opt schema {kind} > ntp_opt/schemas/{kind}@1.schema.json"
    )


def test_schema_validates_files(tmp_path, inst):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(instance_to_dict(inst), json_schema("instance"))
    jsonschema.validate(plan_to_dict(planned(baselines.ntp, inst)), json_schema("plan"))


def _errors(tmp_path, data, name="bad.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(InputError) as err:
        load_instance(path)
    msg = str(err.value)
    assert str(path) in msg
    return msg


def test_malformed_json(tmp_path):
    msg = _errors(tmp_path, '{"format": "ntp-opt/instance@1", "name": ')
    assert "malformed JSON at line 1" in msg


def test_nan_is_rejected(tmp_path, inst):
    text = json.dumps(instance_to_dict(inst)).replace('"speed": 1.0', '"speed": NaN', 1)
    assert "NaN" in _errors(tmp_path, text)


def test_wrong_format(tmp_path, inst):
    data = instance_to_dict(inst)
    data["format"] = "ntp-opt/instance@9"
    assert "format: expected 'ntp-opt/instance@1'" in _errors(tmp_path, data)
    assert "expected a JSON object" in _errors(tmp_path, [1, 2])


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["job"].update(tp=-3), "job.tp"),
        (lambda d: d["job"].update(global_batch="many"), "job.global_batch"),
        (lambda d: d["job"].update(colour="red"), "job.colour"),
        (lambda d: d["job"].pop("pp"), "job.pp"),
        (lambda d: d["job"].update(tp_allowed=[2, 8]), "job"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["cluster"]["nodes"][5].update(speed=-1), "cluster.nodes[5].speed"),
        (lambda d: d["cluster"]["nodes"][5].update(state="broken"), "cluster.nodes[5].state"),
        (lambda d: d["cluster"]["nodes"][5].update(p_fail=2), "cluster.nodes[5].p_fail"),
        (lambda d: d["cluster"]["nodes"][5].update(colour=1), "cluster.nodes[5].colour"),
        (lambda d: d["cluster"]["nodes"][0].update(kind="robot"), "cluster.nodes[0]"),
        (lambda d: d["cluster"]["edges"][0].update(source="nowhere"), "cluster.edges[0].source"),
        (lambda d: d["cluster"]["edges"][0].update(weight=2), "cluster.edges[0].weight"),
        (lambda d: d["cluster"]["nodes"].append({"id": "d0", "kind": "rack"}), "cluster.nodes["),
    ],
)
def test_field_errors_name_the_field(tmp_path, inst, mutate, field):
    data = copy.deepcopy(instance_to_dict(inst))
    mutate(data)
    assert f": {field}" in _errors(tmp_path, data)


def test_topology_errors_name_the_node(tmp_path, inst):
    data = instance_to_dict(inst)
    # a GPU linked straight to a domain
    data["cluster"]["edges"].append({"source": "d0.t0.g0", "target": "d1"})
    msg = _errors(tmp_path, data)
    assert "cluster:" in msg and "d0.t0.g0" in msg


def test_tp_larger_than_domain(tmp_path, inst):
    data = instance_to_dict(inst)
    data["job"].update(tp=16, tp_min=None, tp_allowed=None)
    msg = _errors(tmp_path, data)
    assert "job.tp=16" in msg and "domain" in msg


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="cannot read file"):
        load_instance(tmp_path / "nope.json")


def test_plan_file_errors(tmp_path, inst):
    data = plan_to_dict(planned(baselines.ntp, inst))
    data["replicas"][0]["local_batch"] = 2.5
    data["replicas"][1]["stages"][0]["colour"] = 1
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as err:
        load_plan(path)
    msg = str(err.value)
    assert "replicas[0].local_batch" in msg and "replicas[1].stages[0].colour" in msg


def test_save_is_atomic(tmp_path, inst, monkeypatch):
    path = tmp_path / "keep.json"
    save_instance(inst, path)
    before = path.read_bytes()

    def boom(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr("ntp_opt.model.safeio.os.replace", boom)
    with pytest.raises(KeyboardInterrupt):
        save_instance(make_instance(name="other"), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["keep.json"]
