"""The bundled instances load, regenerate identically, and plan validly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ntp_opt.files import load_instance
from ntp_opt.solve import HEURISTICS, solve

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = sorted(p.name for p in (ROOT / "instances").glob("*.json*"))


def test_small_instances_regenerate_identically():
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "instances" / "generate.py"),
            "--check",
            "tiny.json",
            "default.json",
            "gb200-nvl72-9k-trays.json.gz",
        ],
        check=True,
    )


def test_all_bundled_are_listed():
    sys.path.insert(0, str(ROOT / "instances"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    assert sorted(generate.INSTANCES) == BUNDLED


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_instance_plans(name):
    inst = load_instance(ROOT / "instances" / name)
    values = {}
    for policy in HEURISTICS:
        res = solve(inst, policy)
        assert res.plan is not None and res.evaluation is not None
        assert res.evaluation.feasible
        values[policy] = res.relative_objective
    # physical limit (MODEL.md section 6): without power boost, throughput is at
    # most proportional to the healthy GPUs the job can use
    job = inst.job
    limit = min(1.0, int(inst.arrays.healthy.sum()) / (job.dp * job.pp * job.tp))
    assert values["dp-drop"] <= limit + 1e-12
    assert values["ntp"] <= limit + 1e-12
    assert values["ntp-pw"] >= values["ntp"] - 1e-12
