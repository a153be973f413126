"""The plan in index space (ntp_opt.model.layout): round trip and index views."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ntp_opt.model.files import load_instance
from ntp_opt.model.layout import Layout
from ntp_opt.planners.heuristics import dp_drop, ntp, ntp_pw
from ntp_opt.rules.recourse import plan_indices
from tests.helpers import planned

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("planner", [dp_drop, ntp, ntp_pw])
@pytest.mark.parametrize("name", ["tiny.json", "nvl32-64-1gpu-elastic.json.gz"])
def test_round_trip_keeps_plan_and_metrics(planner, name):
    inst = load_instance(ROOT / "instances" / name)
    plan = planned(planner, inst)
    assert plan.replicas
    layout = Layout.from_plan(inst, plan)
    back = layout.to_plan(inst)
    assert back == plan
    assert dict(back.metrics) == dict(plan.metrics)
    assert layout.n_replicas == len(plan.replicas)
    assert layout.n_stages == sum(len(rep.stages) for rep in plan.replicas)


def test_index_views_match_the_plan():
    inst = load_instance(ROOT / "instances" / "tiny.json")
    plan = planned(ntp_pw, inst)
    layout = Layout.from_plan(inst, plan)
    per = layout.per_replica()
    expected = plan_indices(inst, plan)
    assert [[g.tolist() for g in rep] for rep in per] == [
        [g.tolist() for g in rep] for rep in expected
    ]
    owner = layout.owner(inst.arrays.n_gpus)
    for s, (r, k, g, pw) in enumerate(layout.stages()):
        assert np.all(owner[g] == s)
        assert plan.replicas[r].stages[k].power == pw
        assert layout.degree[r] == plan.replicas[r].tp
        assert layout.batch[r] == plan.replicas[r].local_batch
    assert int((owner >= 0).sum()) == len(layout.gpus)


def test_unknown_gpu_raises():
    inst = load_instance(ROOT / "instances" / "tiny.json")
    plan = planned(ntp, inst)
    rep = plan.replicas[0]
    st = rep.stages[0]
    bad = type(plan)(
        plan.instance,
        (type(rep)(rep.tp, rep.local_batch, (type(st)(st.domain, ("no-such-gpu",), 1.0),)),),
    )
    with pytest.raises(KeyError):
        Layout.from_plan(inst, bad)


def test_lenient_layout_marks_what_the_validator_reports():
    inst = load_instance(ROOT / "instances" / "tiny.json")
    plan = planned(ntp, inst)
    rep = plan.replicas[0]
    st = rep.stages[0]
    stage = type(st)("no-such-domain", ("no-such-gpu", *st.gpus[1:]), "high")  # type: ignore[arg-type]
    bad = type(plan)(plan.instance, (type(rep)(2.5, rep.local_batch, (stage,)),))  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        Layout.from_plan(inst, bad)
    lay = Layout.from_plan(inst, bad, strict=False)
    assert lay.domain.tolist() == [-1]
    assert lay.gpus[0] == -1
    assert lay.gpus[1:].tolist() == [inst.arrays.gpu_index[g] for g in st.gpus[1:]]
    assert np.isnan(lay.power[0])
    assert lay.degree.tolist() == [-1]
    # a plan without such problems reads the same either way
    good = Layout.from_plan(inst, plan, strict=False)
    strict = Layout.from_plan(inst, plan)
    for name in ("replica", "stage", "domain", "offsets", "gpus", "power", "degree", "batch"):
        assert np.array_equal(getattr(good, name), getattr(strict, name))


def test_from_indices_round_trips():
    inst = load_instance(ROOT / "instances" / "tiny.json")
    plan = planned(ntp_pw, inst)
    lay = Layout.from_plan(inst, plan)
    reps = [(int(lay.degree[r]), int(lay.batch[r]), []) for r in range(lay.n_replicas)]
    for s, (r, _, g, pw) in enumerate(lay.stages()):
        reps[r][2].append((int(lay.domain[s]), g.tolist(), pw))
    back = Layout.from_indices(plan.instance, reps, plan.metrics).to_plan(inst)
    assert back == plan


def test_exact_outcome_carries_its_plan_layout():
    pytest.importorskip("ortools")
    from ntp_opt.planners.base import RunOptions
    from ntp_opt.planners.exact.search import solve_exact

    inst = load_instance(ROOT / "instances" / "nvl32-64-1gpu-elastic.json.gz")
    out = solve_exact(inst, RunOptions(initial_plan=None))
    assert out.plan is not None and out.layout is not None
    back = out.layout.to_plan(inst)
    assert back == out.plan
    assert dict(back.metrics) == dict(out.plan.metrics)
