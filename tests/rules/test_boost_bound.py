"""The floor boost's speed bound holds (issue 30).

:func:`ntp_opt.rules.boost_bound.floor_speed_bound` bounds the common speed of
:func:`ntp_opt.rules.boost.boost_floor_stages` by the site's room alone
(Newton steps from above on the convex draw). The re-planner skips the floor
boost when that bound shows it cannot win, so the bound must hold: every
replica's speed after the floor boost is at most its speed at power 1 or the
bound. Site budgets from loose to below the draw at power 1, power
exponents from 0.3 to 1, racks with room to spare (the site binds), and TDPs
and boards' limits that differ from GPU to GPU exercise every branch (no
Newton step, several, a root below every stage's speed).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_opt import Instance
from ntp_opt.planners import packing
from ntp_opt.rules.boost import Stages, boost_floor_stages
from ntp_opt.rules.boost_bound import floor_speed_bound
from ntp_opt.rules.power import headroom
from tests.helpers import make_instance


def _stages(instance: Instance) -> tuple[Stages, np.ndarray, np.ndarray, float] | None:
    """The packed replicas' stages at power 1 and the rooms they leave."""
    groups = packing.pack_replicas(instance, packing.domain_slots(instance, True))
    if not groups:
        return None
    used = packing.used_mask(instance, groups).astype(float)
    rack_room, site_room = headroom(instance, used)
    stages = Stages.from_lists([[s.gpus[:t] for s in m] for t, m in groups])
    tp = np.array([t for t, _ in groups], dtype=np.int64)
    return stages, tp, rack_room, site_room


def _bases(instance: Instance, stages: Stages, tp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, its degree factor times its slowest speed, and its cap."""
    job = instance.job
    base = np.array([job.tp_factor(int(t)) for t in tp])[stages.replica]
    return base * stages.stage_min(instance.arrays.speed), stages.stage_min(instance.max_multiplier)


def _speeds(instance: Instance, stages: Stages, tp: np.ndarray, powers: np.ndarray) -> np.ndarray:
    """Per replica, its slowest stage's speed in the floor boost's units."""
    job = instance.job
    base = np.array([job.tp_factor(int(t)) for t in tp])[stages.replica]
    per_stage = base * stages.stage_min(instance.arrays.speed) * powers**job.power_exponent
    return np.minimum.reduceat(
        per_stage, np.searchsorted(stages.replica, np.unique(stages.replica))
    )


def _check(instance: Instance) -> bool:
    """The bound holds; returns whether the boost raised some replica above power 1."""
    got = _stages(instance)
    if got is None:
        return False
    stages, tp, rack_room, site_room = got
    powers = boost_floor_stages(instance, stages, tp, rack_room, site_room)
    bound = floor_speed_bound(instance, *_bases(instance, stages, tp), stages.sizes, site_room)
    after = _speeds(instance, stages, tp, powers)
    at_one = _speeds(instance, stages, tp, np.ones(len(powers)))
    assert np.all(after <= np.maximum(at_one, bound))
    return bool(np.any(after > at_one))


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**16),
    st.floats(0.85, 1.2),
    st.sampled_from([0.3, 0.5, 0.65, 0.8, 1.0]),
    st.booleans(),
    st.sampled_from([1.0, 2.0]),
    st.sampled_from([0, 5]),
)
def test_floor_speed_bound_holds(
    seed: int, site: float, alpha: float, mixed: bool, racks: float, stragglers: int
) -> None:
    inst = make_instance(
        domains=6,
        failed=2,
        stragglers=stragglers,
        seed=seed,
        tp_allowed=(6, 7, 8),
        tp_min=6,
        rack_power_factor=racks,
    )
    g = inst.cluster.copy()
    gpus = [n for n, d in g.nodes(data=True) if d.get("kind") == "gpu"]
    if mixed:  # TDPs and boards' limits that differ from GPU to GPU
        rng = np.random.default_rng(seed)
        for n in gpus:
            tdp = float(rng.uniform(500.0, 1200.0))
            g.nodes[n]["tdp_w"] = tdp
            g.nodes[n]["max_power_w"] = tdp * float(rng.choice([1.1, 1.5]))
    total = sum(g.nodes[n].get("tdp_w", 1000.0) for n in gpus)
    g.graph["power_budget_w"] = site * total
    job = inst.job.model_copy(update={"power_exponent": alpha})
    _check(Instance("site", g, job))


@pytest.mark.parametrize("site", [0.95, 1.0, 1.2])
def test_the_bound_is_met_by_boosts_that_happen(site: float) -> None:
    """Not vacuous: at these budgets the floor boost raises replicas, and the bound
    holds all the same."""
    inst = make_instance(domains=8, failed=3, stragglers=6, seed=1, tp_allowed=(6, 7, 8), tp_min=6)
    g = inst.cluster.copy()
    gpus = [n for n, d in g.nodes(data=True) if d.get("kind") == "gpu"]
    g.graph["power_budget_w"] = site * 1000.0 * len(gpus)
    assert _check(Instance("tight", g, inst.job))


def test_a_tight_site_bounds_below_the_caps() -> None:
    """With the site's room nearly spent the bound is far below the caps' speed (what
    lets the re-planner skip the floor boost)."""
    inst = make_instance(domains=8, failed=3, stragglers=6, seed=1, tp_allowed=(6, 7, 8), tp_min=6)
    g = inst.cluster.copy()
    gpus = [n for n, d in g.nodes(data=True) if d.get("kind") == "gpu"]
    g.graph["power_budget_w"] = 0.95 * 1000.0 * len(gpus)
    tight = Instance("tight", g, inst.job)
    got = _stages(tight)
    assert got is not None
    stages, tp, _, site_room = got
    assert site_room > 0
    base, caps = _bases(tight, stages, tp)
    loose = floor_speed_bound(tight, base, caps, stages.sizes, site_room * 1e6)
    assert floor_speed_bound(tight, base, caps, stages.sizes, site_room) < loose
