"""Shortcuts on the re-planning path give the reference computation's numbers (issue 30).

Each shortcut below is compared with the plain computation it replaces,
written out here: the floor boost's bisection stopping once no step can
change its result, a swap search's stage-order flags read at once, and the
index-space check's degree test and factors, the floor boost's (stage,
rack) groups spliced from the last call's, and the swap search's exact splits
kept with the re-boosts' (:func:`ntp_opt.workflows.incremental.exact_split`),
and a replica's needs from its slices read once
(:func:`ntp_opt.rules.boost_needs.needs_at`).
"""

from __future__ import annotations

from functools import partial

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt import Instance, Job
from ntp_opt.model.layout import Layout
from ntp_opt.planners.swaps import _sorted_stages, improve_layout
from ntp_opt.rules.boost import Stages, _FloorGroups, _spliced_groups, _stage_rack_groups
from ntp_opt.rules.boost_needs import ReplicaPart, needs_at
from ntp_opt.rules.goodput import split_batch
from ntp_opt.rules.validate import _allowed, _degree_factors
from ntp_opt.workflows.incremental import exact_split
from tests.strategies import instances, preset_instances, valid_plans


def _bisection(groups: _FloorGroups, lo: float, top: float, steps: int) -> float:
    """Every one of ``steps`` bisection steps (the reference)."""
    for _ in range(steps):
        mid = 0.5 * (lo + top)
        if groups.fits(mid):
            lo = mid
        else:
            top = mid
    return lo


@given(
    st.integers(1, 12),
    st.integers(1, 5),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0.5, 1.0, 1.5, 2.0]),
    st.integers(1, 80),
    st.booleans(),
)
def test_floor_bisection_stops_early_with_the_same_speed(
    n_groups: int, n_racks: int, seed: int, alpha: float, steps: int, tight: bool
) -> None:
    rng = np.random.default_rng(seed)
    tdp = rng.uniform(100.0, 1000.0, n_groups)
    base = rng.choice([0.8, 0.9, 1.0], n_groups) * rng.choice([1.0, 1.0 - 1e-3], n_groups)
    caps = rng.choice([1.1, 1.2, 1.3], n_groups)
    rack = rng.integers(0, n_racks, n_groups)
    room = rng.uniform(0.0, 300.0 if tight else 3000.0, n_racks)
    site = float(rng.uniform(0.0, 3000.0))
    groups = _FloorGroups(tdp, base, caps, rack, n_racks, room, site, 0.98, alpha)
    lo = float(base.min())
    top = float((base * caps**alpha).min())
    if not groups.fits(lo):
        return
    assert groups.highest(lo, top, steps) == _bisection(groups, lo, top, steps)


def _same_reference(
    layout: Layout, own_speed: np.ndarray, extra_owner: np.ndarray, extra_speed: np.ndarray
) -> list[bool]:
    """Per stage, one stage at a time (the reference)."""
    out = []
    for k in range(layout.n_stages):
        lo, hi = int(layout.offsets[k]), int(layout.offsets[k + 1])
        own = own_speed[lo:hi]
        ok = not (own[1:] > own[:-1]).any()
        for v in extra_speed[extra_owner == k].tolist():
            if hi > lo and v > own.min():
                ok = False
        out.append(ok)
    return out


@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=8),
    st.integers(0, 6),
    st.integers(0, 2**32 - 1),
)
def test_stage_order_flags_match_one_stage_at_a_time(
    sizes: list[int], n_extra: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    n = len(sizes)
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    total = int(offsets[-1])
    layout = Layout(
        replica=np.zeros(n, dtype=np.int64),
        stage=np.arange(n, dtype=np.int64),
        domain=np.arange(n, dtype=np.int64),
        offsets=offsets,
        gpus=np.arange(total, dtype=np.int64),
        power=np.ones(n),
        degree=np.array([max(sizes)], dtype=np.int64),
        batch=np.ones(1, dtype=np.int64),
    )
    own = rng.choice([0.7, 0.9, 1.0], total)
    owner = rng.integers(0, n + 2, n_extra)  # some owners past the stages: spare slots
    extra = rng.choice([0.7, 0.9, 1.0], n_extra)
    got = _sorted_stages(layout, own, owner, extra)
    assert got.tolist() == _same_reference(layout, own, owner, extra)


@given(st.lists(st.integers(-2, 40), max_size=12), st.integers(0, 2**32 - 1))
def test_degree_test_and_factors_match_the_plain_ones(degrees: list[int], seed: int) -> None:
    job = Job(tp=32, tp_allowed=(28, 30, 32), pp=4, dp=4, global_batch=64)
    deg = np.array(degrees, dtype=np.int64)
    assert _allowed(job, deg) == bool(np.isin(deg, job.allowed).all())
    ok = np.random.default_rng(seed).choice(job.allowed, len(degrees))
    plain = np.array([job.tp_factor(int(t)) for t in ok.tolist()], dtype=float)
    assert np.array_equal(_degree_factors(job, ok), plain)
    same = np.full(len(degrees), 30, dtype=np.int64)
    assert _degree_factors(job, same).tolist() == [job.tp_factor(30)] * len(degrees)


def _random_stages(data: st.DataObject, n_gpus: int, n: int) -> list[list[int]]:
    gpu = st.integers(0, n_gpus - 1)
    return [data.draw(st.lists(gpu, min_size=1, max_size=6)) for _ in range(n)]


def _as_stages(groups: list[list[int]]) -> Stages:
    return Stages.from_lists([[np.array(g, dtype=np.int64) for g in groups]])


def _caps(inst: Instance, stages: list[list[int]]) -> np.ndarray:
    """A cap per stage read from its GPUs (as the callers' caps are)."""
    top = inst.max_multiplier
    return np.array([float(top[g].min()) for g in stages])


@given(preset_instances(), st.data())
def test_floor_groups_spliced_from_the_last_ones_equal_the_full_ones(
    inst: Instance, data: st.DataObject
) -> None:
    n = data.draw(st.integers(8, 24))
    first = _random_stages(data, inst.arrays.n_gpus, n)
    second = [list(g) for g in first]
    for _ in range(data.draw(st.integers(0, 3))):  # a few stages change
        k = data.draw(st.integers(0, n - 1))
        how = data.draw(st.sampled_from(["moved", "new", "reversed"]))
        if how == "moved":  # as many GPUs, elsewhere (likely another rack)
            shift = data.draw(st.integers(1, inst.arrays.n_gpus - 1))
            second[k] = [(g + shift) % inst.arrays.n_gpus for g in second[k]]
        elif how == "new":
            second[k] = _random_stages(data, inst.arrays.n_gpus, 1)[0]
        else:
            second[k] = second[k][::-1]
    if data.draw(st.booleans()):  # or one more or fewer stage
        second = second[:-1] if data.draw(st.booleans()) else [*second, [0]]
    old, new = _as_stages(first), _as_stages(second)
    ref = _stage_rack_groups(inst, new, _caps(inst, second), None)
    memo: dict[str, object] = {}
    _stage_rack_groups(inst, old, _caps(inst, first), memo)
    kept = memo["floor"]
    got = _stage_rack_groups(inst, new, _caps(inst, second), memo)
    for x, y in zip(got, ref, strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()  # bit for bit
    spliced = _spliced_groups(inst, new, kept)
    if spliced is not None:
        for x, y in zip(spliced, ref[1:], strict=True):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    if len(second) == n and sum(a != b for a, b in zip(first, second, strict=True)) * 8 <= n:
        assert spliced is not None  # few stages changed: the kept groups are used


@given(
    st.lists(st.tuples(st.sampled_from([0.5, 0.7, 0.9, 1.0]), st.integers(1, 3)), max_size=6),
    st.lists(st.integers(0, 5), min_size=1, max_size=8),
)
def test_kept_splits_equal_split_batch(replicas: list[tuple[float, int]], edits: list[int]) -> None:
    """Splits kept in one memo, asked in turn for speed lists that differ in one replica,
    each equal ``split_batch`` of its own speeds (a key that missed a speed would not)."""
    job = Job(tp=4, tp_min=2, pp=2, dp=4, global_batch=64, batch_policy="elastic")
    speeds = [v for v, _ in replicas]
    tps = [1 + t for _, t in replicas]
    memo: dict = {}
    for k in edits:
        if replicas:
            speeds[k % len(speeds)] *= 0.75
        for _ in range(2):  # computed, then read back
            got = exact_split(job, list(speeds), list(tps), memo)
            assert got == split_batch(job, list(speeds), list(tps))


@given(instances(), st.data())
def test_the_swap_search_on_kept_splits_makes_the_same_plan(inst: Instance, data) -> None:
    """:func:`~ntp_opt.planners.swaps.improve_layout` with its exact splits kept in a
    memo (a second search reading them all back) makes the plan and layout it makes
    with ``split_batch``."""
    plan = data.draw(valid_plans(inst))
    if not plan.replicas:
        return
    lay = Layout.from_plan(inst, plan)
    n = len(plan.replicas)
    focus = set(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3)))
    plain = improve_layout(inst, plan, focus, layout=lay)
    memo: dict = {}
    for _ in range(2):
        kept = improve_layout(
            inst, plan, focus, layout=lay, splitter=partial(exact_split, memo=memo)
        )
        assert (plain is None) == (kept is None)
        if plain is not None and kept is not None:
            assert plain[0].replicas == kept[0].replicas
            for name in ("replica", "stage", "domain", "offsets", "gpus", "power", "batch"):
                assert np.array_equal(getattr(plain[1], name), getattr(kept[1], name))


def _needs_reference(
    stages: Stages,
    tdp: np.ndarray,
    fs: np.ndarray,
    pw: np.ndarray,
    top: np.ndarray,
    local: np.ndarray,
    width: int,
    goals: list[float],
    inv_alpha: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A replica's needs with every slice read again (the computation before the
    slices were kept)."""
    n_s, n_g = len(fs), len(goals)
    sizes = stages.sizes
    mult = np.minimum(np.maximum((np.array(goals)[:, None] / fs) ** inv_alpha, pw), top)
    step = mult - pw
    if sizes[0] * n_s == len(tdp) and (sizes == sizes[0]).all():
        watts = tdp.reshape(n_s, -1)[None] * step[:, :, None]
        sums = watts.sum(axis=2)
    else:
        watts = tdp[None] * np.repeat(step, sizes, axis=1)
        sums = np.array([stages.stage_sums(w) for w in watts]).reshape(n_g, n_s)
    extra = np.cumsum(sums, axis=1)[:, -1]
    slot = (np.arange(n_g)[:, None] * width + local[None, :]).ravel()
    per_rack = np.bincount(slot, weights=watts.ravel(), minlength=n_g * width)
    return mult, per_rack.reshape(n_g, width), extra


@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=5),
    st.booleans(),
    st.integers(0, 2**32 - 1),
    st.lists(st.integers(1, 15), min_size=1, max_size=4),
)
def test_needs_from_slices_read_once_equal_the_plain_ones(
    sizes: list[int], one_size: bool, seed: int, asks: list[int]
) -> None:
    """:func:`needs_at` on a :class:`ReplicaPart` (slices and groups kept from one call
    to the next) gives bit for bit the needs computed from the arrays at each call."""
    rng = np.random.default_rng(seed)
    if one_size:
        sizes = [sizes[0]] * len(sizes)
    n_s, n = len(sizes), sum(sizes)
    start = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    stages = Stages(np.zeros(n_s, dtype=np.int64), np.arange(n, dtype=np.int64), start)
    tdp = rng.uniform(300.0, 1000.0, n)
    fs = rng.uniform(0.5, 1.0, n_s)
    pw = rng.choice([1.0, 1.05, 1.1], n_s)
    top = pw + rng.uniform(0.0, 0.3, n_s)
    width = int(rng.integers(1, 4))
    local = np.sort(rng.integers(0, width, n))
    local[-1] = width - 1
    matrix = tdp.reshape(n_s, -1)[None] if len(set(sizes)) == 1 else None
    part = ReplicaPart(fs, pw, top, tdp, np.array(sizes), matrix, stages, local, width, {})
    for k in asks + asks:  # each number of speeds twice: its groups are kept
        goals = np.sort(rng.uniform(0.5, 1.3, k)).tolist()
        got = needs_at(part, goals, 1 / 0.65)
        want = _needs_reference(stages, tdp, fs, pw, top, local, width, goals, 1 / 0.65)
        for x, y in zip(got, want, strict=True):
            assert x.tobytes() == y.tobytes()
