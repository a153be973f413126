"""instances/tiny.json against the hand computation in instances/README.md.

The expected numbers are written as the formulas of that page (speeds from
t/T and 1.3**0.65, overhead 1.01), not taken from the code under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ntp_opt.model.files import load_instance, load_plan
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.planners import heuristics as baselines
from ntp_opt.rules.validate import evaluate
from tests.helpers import planned

ROOT = Path(__file__).resolve().parents[2]
V_BOOSTED_TP3 = 0.75 * 1.3**0.65  # 3/4 of the GPUs, power 1.3, alpha 0.65
OPTIMUM = 2 * V_BOOSTED_TP3 / 1.01  # b = (4, 4), theta = 4 / v * (1 + rho)


@pytest.fixture(scope="module")
def tiny():
    return load_instance(ROOT / "instances" / "tiny.json")


def full_d2(batch=4):
    return Replica(4, batch, (Stage("d2", ("d2.t0.g0", "d2.t0.g1", "d2.t1.g0", "d2.t1.g1")),))


def test_optimal_plan_d0(tiny):
    plan = Plan(
        "tiny",
        (full_d2(), Replica(3, 4, (Stage("d0", ("d0.t0.g1", "d0.t1.g0", "d0.t1.g1"), power=1.3),))),
    )
    ev = evaluate(tiny, plan)
    assert ev.feasible, ev.violations
    assert ev.goodput == pytest.approx(OPTIMUM, rel=1e-12)
    assert ev.goodput == pytest.approx(1.761299, abs=1e-6)  # as printed in the README
    assert ev.relative_goodput == pytest.approx(0.880649, abs=1e-6)
    assert ev.step_time == pytest.approx(4 / V_BOOSTED_TP3 * 1.01)
    assert ev.site_power_w == pytest.approx(4000 + 3900 + 400)


def test_optimal_plan_d1_without_straggler(tiny):
    plan = Plan(
        "tiny",
        (full_d2(), Replica(3, 4, (Stage("d1", ("d1.t0.g0", "d1.t0.g1", "d1.t1.g0"), power=1.3),))),
    )
    ev = evaluate(tiny, plan)
    assert ev.feasible, ev.violations  # rack d1: 3 x 1300 + 100 idle = 4000 W exactly
    assert ev.goodput == pytest.approx(OPTIMUM, rel=1e-12)


def test_hand_alternatives(tiny):
    b43 = Plan(
        "tiny",
        (full_d2(), Replica(3, 3, (Stage("d0", ("d0.t0.g1", "d0.t1.g0", "d0.t1.g1"), power=1.3),))),
    )
    assert evaluate(tiny, b43).goodput == pytest.approx(7 / 4.04)
    unboosted = Plan(
        "tiny", (full_d2(), Replica(3, 4, (Stage("d0", ("d0.t0.g1", "d0.t1.g0", "d0.t1.g1")),)))
    )
    assert evaluate(tiny, unboosted).goodput == pytest.approx(2 * 0.75 / 1.01)
    alone = Plan("tiny", (full_d2(),))
    assert evaluate(tiny, alone).relative_goodput == pytest.approx(0.5)
    # boosting beyond the rack: d1 TP3 at 1.3 plus the straggler at 1.0
    over = Plan(
        "tiny",
        (
            full_d2(),
            Replica(
                4, 2, (Stage("d1", ("d1.t0.g0", "d1.t0.g1", "d1.t1.g0", "d1.t1.g1"), power=1.05),)
            ),
        ),
    )
    assert {v.rule for v in evaluate(tiny, over).violations} == {"rack-power"}


@pytest.mark.parametrize("planner", [baselines.dp_drop, baselines.ntp, baselines.ntp_pw])
def test_baselines_hand(tiny, planner):
    ev = evaluate(tiny, planned(planner, tiny))
    assert ev.feasible
    assert ev.goodput == pytest.approx(6 / 4)  # d2 and d1 with its straggler, b = (4, 2)
    assert ev.relative_goodput == pytest.approx(0.75)


def test_bundled_optimal_plan(tiny):
    plan = load_plan(ROOT / "instances" / "plans" / "tiny-optimal.json")
    ev = evaluate(tiny, plan)
    assert ev.feasible and ev.goodput == pytest.approx(OPTIMUM, rel=1e-12)
