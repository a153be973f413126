"""The fast bounds equal the reference computation bit for bit (issue 15).

``tests/bounds_reference.py`` keeps the bounds as first written (one numpy
call per Lagrangian step, ``np.unique(axis=0)`` for the domain classes);
:mod:`ntp_opt.planners.bounds` batches the same steps. Both must give
the same float on random instances and on bundled ones, and
:func:`ntp_opt.planners.exact.tighten.tighten` must give what the per-stage
``np.add.at`` loop gave.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from ntp_opt import Instance, Job
from ntp_opt.model import topology
from ntp_opt.model.files import load_instance
from ntp_opt.planners.bounds import capacity, case, stage
from ntp_opt.planners.bounds import rows as bound_rows
from ntp_opt.planners.exact.model import StagePick, prepare
from ntp_opt.planners.exact.tighten import tighten
from ntp_opt.rules import bisection
from ntp_opt.rules.tolerances import BISECT_TOL, BUDGET_SLACK, TIGHTEN_TOL
from tests import bounds_reference as ref
from tests.helpers import seeds
from tests.planners.exact.test_milp import exact_instance
from tests.strategies import instances

ROOT = Path(__file__).resolve().parents[2]


def _assert_same(inst: Instance) -> None:
    assert stage.stage_bound(inst) == ref.stage_bound(inst)
    assert capacity.gpu_bound(inst) == ref.gpu_bound(inst)
    assert capacity.capacity_bound(inst) == ref.capacity_bound(inst)


def mixed_instance(seed: int) -> Instance:
    """A random instance with many domain classes: failures, stragglers, mixed
    TDPs and board limits, both batch policies; up to a few hundred GPUs."""
    rng = np.random.default_rng(seed)
    size = int(rng.choice([4, 8, 16]))
    nd = int(rng.integers(2, 24))
    tray = min(4, size)
    g = topology.build_cluster(
        nd, size, tray, max(1, size // tray), rack_power_factor=float(rng.choice([1.0, 1.2]))
    )
    gpus = topology.gpus(g)
    picks = rng.permutation(len(gpus))
    n_fail = int(rng.integers(0, max(2, len(gpus) // 6)))
    n_slow = int(rng.integers(0, max(2, len(gpus) // 8)))
    topology.fail_gpus(g, [gpus[i] for i in picks[:n_fail]])
    for i in picks[n_fail : n_fail + n_slow]:
        topology.set_speed(g, [gpus[i]], float(rng.choice([0.5, 0.7, 0.8, 0.9, 0.95])))
    for i in rng.choice(len(gpus), size=int(rng.integers(0, 4)), replace=False):
        g.nodes[gpus[i]]["tdp_w"] = float(rng.choice([600.0, 700.0, 1200.0]))
    g.graph["power_budget_w"] = float(rng.choice([0.6, 0.9, 1.0, 1.3])) * 1000 * len(gpus)
    tp = int(rng.choice([size, size // 2])) if size > 4 else size
    dp = int(rng.integers(1, max(2, len(gpus) // (2 * tp))))
    pp = int(rng.choice([1, 1, 2]))
    batch = int(rng.integers(dp, 3 * dp + 1))
    job = Job(
        tp=tp,
        tp_min=int(rng.choice([max(1, tp // 2), max(1, tp - 1), tp])),
        pp=pp,
        dp=dp,
        dp_max=dp + int(rng.integers(0, 3)),
        global_batch=batch,
        max_local_batch=-(-batch // dp) + int(rng.integers(0, 2)),
        batch_policy=str(rng.choice(["fixed", "elastic"])),
        seq_time_s=float(rng.choice([1.0, 0.7])),
        power_exponent=float(rng.choice([0.65, 0.65, 0.3, 1.0, 0.0])),
        max_boost=float(rng.choice([0.3, 0.3, 0.0, 1.0])),
        idle_power_fraction=float(rng.choice([0.1, 0.0, 0.5])),
        reshard_overhead=float(rng.choice([0.01, 0.0, 0.2])),
    )
    return Instance(f"mixed-{seed}", g, job)


# ci: every 2nd exact and every 4th mixed seed (the reference is slow by design:
# one numpy call per Lagrangian step); thorough: all of them (tests/helpers.py)
@pytest.mark.parametrize("seed", seeds(40, 2))
def test_bounds_equal_the_reference_on_exact_instances(seed):
    _assert_same(exact_instance(seed))


@pytest.mark.parametrize("seed", seeds(60, 4))
def test_bounds_equal_the_reference_on_mixed_instances(seed):
    _assert_same(mixed_instance(seed))


@pytest.mark.parametrize("seed", seeds(60, 6))
def test_sparse_powers_equal_the_reference(seed, monkeypatch):
    # the dual's powers taken only between the clips (large batches) on every
    # batch, and the plain ones on none: both give the reference's floats
    inst = mixed_instance(seed)
    monkeypatch.setattr(case, "_SPARSE_POWERS", 0)
    monkeypatch.setattr(bisection, "_PY_MIDPOINTS", 0)  # and every midpoint from numpy
    _assert_same(inst)
    monkeypatch.setattr(case, "_SPARSE_POWERS", 10**12)
    monkeypatch.setattr(bisection, "_PY_MIDPOINTS", 10**12)  # and from Python
    _assert_same(inst)


@given(instances())
@settings(deadline=None)  # examples from the profile (ci: 12, thorough: 150)
def test_bounds_equal_the_reference_property(inst):
    _assert_same(inst)


@pytest.mark.parametrize(
    "name",
    [
        "dgx-1k-0.4pct-fixed",  # fixed policy: the k-th replica bound
        "dgx-2k-tp4-0.1pct-elastic",  # multi-stage domains (per-GPU relaxation)
        "nvl72-4k-tp36-0.4pct-elastic",
        "nvl36x2-4k-trays-fixed",
    ],
)
def test_bounds_equal_the_reference_on_bundled_instances(name):
    _assert_same(load_instance(ROOT / "instances" / f"{name}.json.gz"))


@pytest.mark.parametrize("seed", range(20))
def test_domain_classes_are_np_unique_rows(seed):
    # rows with many repeats, a -0.0 among them: the same rows, order and counts
    rng = np.random.default_rng(seed)
    base = rng.choice([0.0, -0.0, 0.5, 1.0, 2.0], size=(int(rng.integers(1, 6)), 5))
    key = base[rng.integers(0, len(base), size=int(rng.integers(1, 300)))]
    rows, counts = bound_rows._unique_rows(key)
    want_rows, want_counts = np.unique(key, axis=0, return_counts=True)
    assert rows.tolist() == want_rows.tolist()
    assert counts.tolist() == want_counts.tolist()
    got = bound_rows.DomainRows(key, 5)  # and each row's class
    assert got.classes()[0].tolist() == want_rows.tolist()
    assert (got.classes()[0][got.domain_class()] == key).all()


def _tighten_reference(prep, stages, theta):
    """tighten.tighten as first written: one np.add.at per stage."""
    inst = prep.instance
    job = inst.job
    a = inst.arrays
    if not stages:
        return theta, []
    need = np.array(
        [
            st.batch
            * job.seq_time_s
            / (job.tp_factor(st.degree) * float(a.speed[list(st.gpus)].min()))
            for st in stages
        ]
    )
    if job.max_boost <= 0 or job.power_exponent <= 0:
        return float(need.max()), [1.0] * len(stages)
    alpha = job.power_exponent
    hi_pi = np.array([float(inst.max_multiplier[list(st.gpus)].min()) for st in stages])
    idle = job.idle_power_fraction
    tdp = [a.tdp[list(st.gpus)] for st in stages]
    racks = [a.gpu_rack[list(st.gpus)] for st in stages]
    stage_tdp = np.array([x.sum() for x in tdp])
    base_rack = np.bincount(
        a.gpu_rack, weights=np.where(a.healthy, a.tdp * idle, 0.0), minlength=len(a.rack_ids)
    )

    def powers(th):
        return np.maximum(1.0, (need / th) ** (1.0 / alpha))

    def fits(th):
        pi = powers(th)
        if np.any(pi > hi_pi * (1 + BUDGET_SLACK)):
            return False
        rack = base_rack.copy()
        for p, w, r in zip(pi, tdp, racks, strict=True):
            np.add.at(rack, r, w * (p - idle))
        if np.any(rack > a.rack_budget * (1 + TIGHTEN_TOL)):
            return False
        site = float(base_rack.sum() + ((pi - idle) * stage_tdp).sum())
        return site <= a.site_budget * (1 + TIGHTEN_TOL)

    lo = float((need / hi_pi**alpha).max())
    hi = theta
    if not fits(hi):
        return theta, [float(p) for p in powers(theta)]
    if fits(lo):
        hi = lo
    else:
        while hi / lo - 1 > BISECT_TOL:
            mid = math.sqrt(lo * hi)
            if fits(mid):
                hi = mid
            else:
                lo = mid
    return hi, [min(float(p), float(c)) for p, c in zip(powers(hi), hi_pi, strict=True)]


@pytest.mark.parametrize("seed", range(30))
def test_tighten_equals_the_add_at_loop(seed):
    inst = mixed_instance(seed)
    prep = prepare(inst)
    rng = np.random.default_rng(seed)
    t = inst.job.tp
    stages = []
    for dom in prep.domains:
        for start in range(0, len(dom.gpus) - t + 1, t):
            if rng.random() < 0.7:
                gpus = tuple(sorted(int(x) for x in dom.gpus[start : start + t]))
                stages.append(StagePick(t, int(rng.integers(1, 4)), dom.index, gpus, 1.0))
    for theta in (0.5, 2.0, 8.0, 50.0):
        assert tighten(prep, stages, theta) == _tighten_reference(prep, stages, theta)


@given(
    hst.integers(0, 40),
    hst.integers(1, 5),
    hst.integers(0, 2**32 - 1),
    hst.sampled_from([0.0, 0.3, 1.0]),
)
def test_distinct_rows_are_numpy_unique(n: int, m: int, seed: int, nan_share: float) -> None:
    """:func:`~ntp_opt.planners.bounds.rows.distinct_rows` gives ``numpy.unique``'s
    first indices and inverse (ties, ``-0.0`` against ``0.0``, NaN, wide values)."""
    rng = np.random.default_rng(seed)
    pool = np.array([0.0, -0.0, 1.0, 1.0 + 2**-52, -3.5, 1e300, 7.0])
    x = rng.choice(pool, (n, m))
    if nan_share and n and rng.random() < nan_share:
        x[rng.integers(n), rng.integers(m)] = np.nan
    _, first, inverse = np.unique(x, axis=0, return_index=True, return_inverse=True)
    got_first, got_inverse = bound_rows.distinct_rows(x)
    assert got_first.tolist() == first.tolist()
    assert got_inverse.tolist() == inverse.reshape(-1).tolist()
