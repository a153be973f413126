"""The bundled instances load, regenerate identically, and plan validly; the library's coverage."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ntp_opt.model.files import load_instance
from ntp_opt.solve import HEURISTICS, solve

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = sorted(
    p.name
    for p in (ROOT / "instances").glob("*.json*")
    if p.name != "best_known.json" and not p.name.startswith(".")
)

sys.path.insert(0, str(ROOT / "instances"))
try:
    import generate
finally:
    sys.path.pop(0)

SMALL = 2_500
"""Library files up to this many GPUs are regenerated in the tests (the rest: ``--check``)."""
PLANNED = 5_000
"""Library files up to this many GPUs are planned by every heuristic in the tests."""


def test_small_instances_regenerate_identically():
    small = [s.file for s in generate.LIBRARY if s.gpus <= SMALL]
    assert len(small) >= 10
    # in-process: the same main() the script runs, without a second interpreter's imports
    checked = ["tiny.json", "default.json", "gb200-nvl72-9k-trays.json.gz", *small]
    assert generate.main(["--check", *checked]) == 0


def test_all_bundled_are_listed():
    assert sorted(generate.INSTANCES) == BUNDLED
    assert not set(generate.LARGE) & set(BUNDLED)
    assert all(name.startswith("large/") for name in generate.LARGE)


def test_library_covers_the_issue():
    """Issue #5: at least 30 instances, 64 to 131,072 GPUs, every kind and variant."""
    lib = generate.LIBRARY
    assert len(lib) >= 30 and len({s.name for s in lib}) == len(lib)
    assert min(s.gpus for s in lib) == 64 and max(s.gpus for s in lib) == 131_072
    assert {s.kind for s in lib} == {"dgx-h100", "nvl32", "nvl72", "nvl36x2"}
    assert {0.0, 0.001, 0.004} <= {s.fail_fraction for s in lib}
    assert {"nominal", "tight", "generous"} == {s.power for s in lib}
    assert {"fixed", "elastic"} == {s.job["batch_policy"] for s in lib}
    assert any(s.failed_trays for s in lib) and any(s.stragglers for s in lib)
    assert any(s.p_fail for s in lib)
    assert len({(s.job["tp"], s.job["pp"]) for s in lib}) >= 8
    assert sum(s.gpus >= generate.LARGE_GPUS for s in lib) >= 5


@pytest.mark.parametrize(
    "spec", [s for s in generate.LIBRARY if s.gpus <= 300], ids=lambda s: s.name
)
def test_power_variants(spec):
    """Tight: site budget below the TDP sum; generous: racks above their TDP."""
    a = generate.Spec.build(spec).arrays
    tdp = float(a.tdp.sum())
    if spec.power == "tight":
        assert (
            a.site_budget == pytest.approx(generate.TIGHT_SITE_FACTOR * tdp) and a.site_budget < tdp
        )
    else:
        assert a.site_budget == pytest.approx(tdp)
    factor = generate.GENEROUS_RACK_FACTOR if spec.power == "generous" else 1.0
    assert float(a.rack_budget.sum()) == pytest.approx(factor * tdp)


PLAN_THESE = sorted([*generate.BUNDLED, *(s.file for s in generate.LIBRARY if s.gpus <= PLANNED)])


@pytest.mark.parametrize("name", PLAN_THESE)
def test_bundled_instance_plans(name):
    inst = load_instance(ROOT / "instances" / name)
    assert inst.meta  # says how it was made
    values = {}
    for policy in HEURISTICS:
        res = solve(inst, policy)
        assert res.plan is not None and res.evaluation is not None
        assert res.evaluation.feasible
        values[policy] = res.relative_objective
    # physical limit (docs/model.md, spec section 6): without power boost, throughput is at
    # most proportional to the healthy GPUs the job can use
    job = inst.job
    limit = min(1.0, int(inst.arrays.healthy.sum()) / (job.dp * job.pp * job.tp))
    assert values["dp-drop"] <= limit + 1e-12
    assert values["ntp"] <= limit + 1e-12
    assert values["ntp-pw"] >= values["ntp"] - 1e-12
