"""Expected goodput: Monte Carlo agrees with exact enumeration (docs/model.md, spec section 4)."""

from __future__ import annotations

import math

import pytest

from ntp_opt.model import topology
from ntp_opt.model.failures import enumerate_scenarios
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.planners import heuristics as baselines
from ntp_opt.rules.expected import expected_goodput
from ntp_opt.rules.recourse import goodput_after
from tests.helpers import planned
from tests.planners.exact.test_milp import exact_instance


def _small(seed: int) -> Instance:
    inst = exact_instance(seed)
    g = inst.cluster.copy()
    gpus = topology.gpus(g)
    topology.set_p_fail(g, 0.04, gpus[: min(len(gpus), 8)])
    topology.set_p_fail(g, 0.05, topology.trays(g)[:2])
    return Instance(inst.name, g, inst.job)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("radius", ["gpu", "tray", "domain"])
def test_monte_carlo_agrees_with_exact(seed, radius):
    inst = _small(seed)
    plan = planned(baselines.ntp_pw, inst)
    exact = expected_goodput(inst, plan, method="exact", blast_radius=radius)
    mc = expected_goodput(inst, plan, samples=3000, seed=seed, blast_radius=radius)
    assert exact.method == "exact" and exact.ci_low == exact.mean == exact.ci_high
    assert mc.method == "mc" and mc.samples == 3000
    assert mc.ci_low <= mc.mean <= mc.ci_high
    # within 4 standard errors (the 95 % interval holds in ~95 % of runs, this almost always)
    assert abs(mc.mean - exact.mean) <= 4 * mc.std_error + 1e-9
    # expected goodput never exceeds the failure-free goodput
    assert exact.mean <= goodput_after(inst, plan, None) * (1 + 1e-12)


def test_exact_is_the_weighted_sum_over_scenarios():
    g = topology.build_cluster(3, 4, 2, 2)
    topology.set_p_fail(g, 0.1, topology.gpus(g)[:6])
    inst = Instance("w", g, Job(tp=4, tp_min=2, pp=1, dp=2, global_batch=4))
    plan = planned(baselines.ntp, inst)
    exact = expected_goodput(inst, plan, method="exact")
    manual = sum(p * goodput_after(inst, plan, m) for m, p in enumerate_scenarios(inst))
    assert exact.mean == pytest.approx(manual)
    assert math.isclose(exact.relative_mean, exact.mean * inst.job.seq_time_s / inst.job.dp)


def test_no_failure_probability_gives_the_plan_goodput():
    inst = exact_instance(3)
    plan = planned(baselines.ntp, inst)
    base = goodput_after(inst, plan, None)
    mc = expected_goodput(inst, plan, samples=50)
    exact = expected_goodput(inst, plan, method="exact")
    assert mc.mean == exact.mean == pytest.approx(base)
    assert mc.std_error == 0.0


def test_bad_arguments():
    inst = _small(0)
    plan = planned(baselines.ntp, inst)
    with pytest.raises(ValueError, match="method"):
        expected_goodput(inst, plan, method="bogus")
    with pytest.raises(ValueError, match="samples"):
        expected_goodput(inst, plan, samples=0)
