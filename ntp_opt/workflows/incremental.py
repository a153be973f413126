"""Re-planning in index space: recourse and re-boosting on a plan's :class:`Layout`.

:func:`recourse_layout` is :func:`ntp_opt.rules.recourse.adapt_indices`
(without its optional boost) computed only where the events land: a replica
none of whose GPUs failed keeps its stages as they are, so only the touched
replicas go through the degree and refill steps; the power rule and the
batch split run on the arrays of the whole layout. :func:`reboost_layout` is
:func:`ntp_opt.workflows.replan.reboost` on the layout's
:class:`~ntp_opt.rules.boost.Stages`. Both return the plan *and* its layout,
so the caller never reads node ids back; tests compare them with the
reference functions plan for plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules import goodput as gp
from ntp_opt.rules.boost import Stages, boost_floor_stages, boost_stages, trim_powers
from ntp_opt.rules.boost_bound import floor_speed_bound
from ntp_opt.rules.power import (
    can_boost,
    headroom,
    over_budget,
    rack_and_site_draw,
    redraw,
)
from ntp_opt.rules.recourse import SparePools, adapt_replica
from ntp_opt.rules.tolerances import FLOAT_NOISE
from ntp_opt.rules.validate import layout_speeds, stage_slowest

__all__ = ["Local", "exact_split", "reboost_layout", "recourse_layout", "stages_of"]


class Local(NamedTuple):
    """The running plan after recourse, in both forms.

    Attributes
    ----------
    plan
        As :func:`ntp_opt.rules.recourse.adapt_indices` returns it.
    layout
        Its layout (batches and metrics included).
    """

    plan: Plan
    layout: Layout


def stages_of(layout: Layout) -> Stages:
    """The layout's stages as the boosts take them (the same arrays, no copy)."""
    return Stages(replica=layout.replica, gpus=layout.gpus, start=layout.offsets)


def _draw(
    instance: Instance, lay: Layout, alive: np.ndarray, memo: dict[Any, Any] | None = None
) -> tuple[np.ndarray, bool]:
    """Racks over budget and the site flag with the layout's stages at their powers.

    ``memo``: where ``alive`` is the instance's healthy GPUs, the draw is
    kept in it and the next one drawn from it (:func:`~ntp_opt.rules.power.redraw`;
    the same flags without it).
    """
    power_of = np.zeros(instance.arrays.n_gpus)
    power_of[lay.gpus] = np.repeat(lay.power, np.diff(lay.offsets))
    if memo is not None and np.array_equal(alive, instance.arrays.healthy):
        drawn, _ = redraw(instance, power_of, memo.get("recourse"))
        memo["recourse"] = drawn
        return over_budget(instance, drawn.rack, drawn.site)
    return over_budget(instance, *rack_and_site_draw(instance, power_of, alive))


def _layout(
    degree: list[int], gpus: list[np.ndarray], stage_dom: list[int], powers: list[float]
) -> Layout:
    """A layout (batches 0) from per-replica degrees and per-stage arrays, replica order."""
    pp = len(gpus) // len(degree) if degree else 0
    sizes = np.array([len(g) for g in gpus], dtype=np.int64)
    offsets = np.zeros(len(gpus) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    n_rep = len(degree)
    return Layout(
        replica=np.repeat(np.arange(n_rep, dtype=np.int64), pp),
        stage=np.tile(np.arange(pp, dtype=np.int64), n_rep),
        domain=np.array(stage_dom, dtype=np.int64),
        offsets=offsets,
        gpus=np.concatenate(gpus) if gpus else np.empty(0, dtype=np.int64),
        power=np.array(powers, dtype=float),
        degree=np.array(degree, dtype=np.int64),
        batch=np.zeros(n_rep, dtype=np.int64),
    )


def recourse_layout(
    instance: Instance,
    plan: Plan,
    layout: Layout,
    mask: np.ndarray,
    memo: dict[Any, Any] | None = None,
) -> Local:
    """:func:`ntp_opt.rules.recourse.adapt_indices` (``boost=False``), touched replicas only.

    Parameters
    ----------
    instance
        The instance after the events (its healthy GPUs are alive; speeds
        are read from it).
    plan
        The running plan, every replica with ``job.pp`` stages.
    layout
        The running plan's strict layout.
    mask
        Boolean per GPU: the GPUs that fail (recourse treats them as dead).
    memo
        A dict kept by the caller from one event to the next (re-planning, the
        memo of :func:`reboost_layout`): the exact batch split is kept there
        under the replicas' speeds and degrees (the same result without it).

    Returns
    -------
    Local
        Equal to ``adapt_indices(instance, plan, mask, layout)`` and its layout.
    """
    a = instance.arrays
    job = instance.job
    alive = a.healthy & ~mask
    lay = layout
    pp = job.pp
    changed = _adapt_touched(instance, lay, alive, pp)
    new, degree, source = _assembled(lay, changed, pp)
    old_power = lay.power.copy()  # to spot the stages whose power step 4 resets
    dropped = lay.n_replicas - len(source)
    # power (step 4 of adapt)
    new, reduced_power, cut = _power_step(instance, new, degree, source, alive, memo)
    dropped += cut
    # batches (step 6)
    tps = degree
    speeds_a = layout_speeds(instance, new, memo=memo) if degree else np.zeros(0)
    split = _exact(job, speeds_a, np.array(tps, dtype=np.int64), memo)
    replicas: tuple[Replica, ...] = ()
    value = 0.0
    if split is not None and degree:
        replicas = _recourse_replicas(
            instance, plan, new.power, old_power, source, changed, tps, split.batches
        )
        value = gp.goodput(job, tps, list(split.batches), speeds_a.tolist())
        batch = np.array(split.batches, dtype=np.int64)
    else:
        batch = np.zeros(0, dtype=np.int64)
        new = _layout([], [], [], [])
    metrics = {
        "policy": "recourse",
        "paused": not replicas,
        "goodput": value,
        "relative_goodput": gp.relative_goodput(job, value),
        "dropped": dropped,
        "reduced_power": reduced_power,
    }
    out_plan = Plan(plan.instance, replicas, metrics)
    out_lay = Layout(
        replica=new.replica,
        stage=new.stage,
        domain=new.domain,
        offsets=new.offsets,
        gpus=new.gpus,
        power=new.power,
        degree=new.degree,
        batch=batch,
        metrics=metrics,
        instance=plan.instance,
    )
    return Local(out_plan, out_lay)


_Changed = dict[int, tuple[int, list[np.ndarray], list[float]] | None]
"""Recourse's touched replicas that changed: replica -> :func:`adapt_replica`'s
degree, stage GPUs and powers (``None``: the replica is dropped)."""


def _adapt_touched(instance: Instance, lay: Layout, alive: np.ndarray, pp: int) -> _Changed:
    """Steps 1-3 of recourse (refill, reduce the degree) on the replicas with a dead
    GPU whose stages lost GPUs."""
    a = instance.arrays
    offsets = lay.offsets
    dead = ~alive[lay.gpus]
    if lay.n_stages:
        hit = np.logical_or.reduceat(dead, offsets[:-1]) & (np.diff(offsets) > 0)
    else:
        hit = np.zeros(0, dtype=bool)
    touched = sorted(set(lay.replica[hit].tolist()))
    used = np.zeros(a.n_gpus, dtype=bool)
    used[lay.gpus] = True
    pools = SparePools(instance, alive, used)
    changed: _Changed = {}
    for r in touched:
        lo = r * pp
        doms = lay.domain[lo : lo + pp].tolist()
        pws = lay.power[lo : lo + pp].tolist()
        old_gpus = [lay.gpus[offsets[s] : offsets[s + 1]] for s in range(lo, lo + pp)]
        survivors = [g[alive[g]] for g in old_gpus]
        t_r = int(lay.degree[r])
        if all(len(s) == t_r for s in survivors):
            continue
        changed[r] = adapt_replica(instance, pools, t_r, doms, survivors, pws)
    return changed


def _assembled(lay: Layout, changed: _Changed, pp: int) -> tuple[Layout, list[int], list[int]]:
    """The layout after steps 1-3 (batches 0), its replicas' degrees and each one's
    index in ``lay``: runs of unchanged replicas copied as blocks."""
    offsets = lay.offsets
    n_rep = lay.n_replicas
    sizes_all = np.diff(offsets)
    deg_parts: list[np.ndarray] = []
    size_parts: list[np.ndarray] = []
    gpu_parts: list[np.ndarray] = []
    dom_parts: list[np.ndarray] = []
    pw_parts: list[np.ndarray] = []
    src_parts: list[np.ndarray] = []
    prev = 0
    for r in [*sorted(changed), n_rep]:
        if r > prev:  # replicas prev .. r - 1 as they are
            deg_parts.append(lay.degree[prev:r])
            size_parts.append(sizes_all[prev * pp : r * pp])
            gpu_parts.append(lay.gpus[offsets[prev * pp] : offsets[r * pp]])
            dom_parts.append(lay.domain[prev * pp : r * pp])
            pw_parts.append(lay.power[prev * pp : r * pp])
            src_parts.append(np.arange(prev, r, dtype=np.int64))
        prev = r + 1
        got = changed.get(r)
        if got is None:
            continue
        t, gs, pws = got
        deg_parts.append(np.array([t], dtype=np.int64))
        size_parts.append(np.full(pp, t, dtype=np.int64))
        gpu_parts.extend(gs)
        dom_parts.append(lay.domain[r * pp : r * pp + pp])
        pw_parts.append(np.array(pws, dtype=float))
        src_parts.append(np.array([r], dtype=np.int64))
    degree = np.concatenate(deg_parts).tolist() if deg_parts else []
    source = np.concatenate(src_parts).tolist() if src_parts else []
    k_rep = len(degree)
    new_offsets = np.zeros(k_rep * pp + 1, dtype=np.int64)
    if size_parts:
        np.cumsum(np.concatenate(size_parts), out=new_offsets[1:])
    new = Layout(
        replica=np.repeat(np.arange(k_rep, dtype=np.int64), pp),
        stage=np.tile(np.arange(pp, dtype=np.int64), k_rep),
        domain=np.concatenate(dom_parts) if dom_parts else np.empty(0, dtype=np.int64),
        offsets=new_offsets,
        gpus=np.concatenate(gpu_parts) if gpu_parts else np.empty(0, dtype=np.int64),
        power=np.concatenate(pw_parts) if pw_parts else np.empty(0),
        degree=np.array(degree, dtype=np.int64),
        batch=np.zeros(k_rep, dtype=np.int64),
    )
    return new, degree, source


def _power_step(
    instance: Instance,
    new: Layout,
    degree: list[int],
    source: list[int],
    alive: np.ndarray,
    memo: dict[Any, Any] | None,
) -> tuple[Layout, bool, int]:
    """Step 4 of recourse: boosts of over-budget racks, then of the site, back to 1,
    then replicas dropped from the end while a budget is exceeded. ``degree`` and
    ``source`` lose the dropped replicas in place; returns the layout, whether a
    power was reduced and how many replicas were dropped."""
    a = instance.arrays
    pp = instance.job.pp
    reduced_power = False
    dropped = 0
    racks_over, site_over = _draw(instance, new, alive, memo)
    if racks_over.any():
        reduced_power = True
        sizes = np.diff(new.offsets)
        if new.n_stages:
            in_over = np.logical_or.reduceat(racks_over[a.gpu_rack[new.gpus]], new.offsets[:-1])
            new.power[in_over & (sizes > 0)] = 1.0
        racks_over, site_over = _draw(instance, new, alive, memo)
    if site_over:
        reduced_power = True
        new.power[:] = 1.0
        racks_over, site_over = _draw(instance, new, alive, memo)
    while degree and (racks_over.any() or site_over):
        reduced_power = True
        degree.pop()
        source.pop()
        dropped += 1
        k = len(degree)
        end = int(new.offsets[k * pp])
        new = Layout(
            replica=new.replica[: k * pp],
            stage=new.stage[: k * pp],
            domain=new.domain[: k * pp],
            offsets=new.offsets[: k * pp + 1],
            gpus=new.gpus[:end],
            power=new.power[: k * pp],
            degree=new.degree[:k],
            batch=new.batch[:k],
        )
        racks_over, site_over = _draw(instance, new, alive, memo)
    return new, reduced_power, dropped


def _recourse_replicas(
    instance: Instance,
    plan: Plan,
    power: np.ndarray,
    old_power: np.ndarray,
    source: list[int],
    changed: _Changed,
    tps: list[int],
    batches: Sequence[int],
) -> tuple[Replica, ...]:
    """The replicas after recourse, in node ids: the running plan's replica objects
    where nothing but the batch (or nothing) changed."""
    a = instance.arrays
    pp = instance.job.pp
    pw_new = power.tolist()
    # per kept replica: did step 4 change one of its stages' powers?
    src_stage = (np.repeat(np.array(source, dtype=np.int64), pp) * pp) + np.tile(
        np.arange(pp, dtype=np.int64), len(source)
    )
    moved_pw = power != old_power[src_stage]
    pw_hit = np.logical_or.reduceat(moved_pw, np.arange(0, len(moved_pw), pp)).tolist()
    reps = []
    for i, (t, r, b) in enumerate(zip(tps, source, batches, strict=True)):
        old = plan.replicas[r]
        pws_i = pw_new[i * pp : i * pp + pp]
        got = changed.get(r)
        stages: tuple[Stage, ...]
        if got is not None:
            stages = tuple(
                Stage(domain=st.domain, gpus=tuple(a.gpu_ids[j] for j in g), power=pw)
                for st, g, pw in zip(old.stages, got[1], pws_i, strict=True)
            )
        elif pw_hit[i]:
            stages = tuple(
                st if pw == st.power else Stage(domain=st.domain, gpus=st.gpus, power=pw)
                for st, pw in zip(old.stages, pws_i, strict=True)
            )
        elif int(b) == old.local_batch:
            reps.append(old)
            continue
        else:
            stages = old.stages
        reps.append(Replica(tp=t, local_batch=int(b), stages=stages))
    return tuple(reps)


_BOUND_SLACK = 1e-9
"""Relative slack on the bound of the slow replicas' boost (:func:`reboost_layout`):
far above the split's own ``FLOAT_NOISE`` and the rounding of the speeds."""


def _factors(job: Job, tp: np.ndarray) -> np.ndarray:
    """``job.tp_factor`` per replica of degrees ``tp``."""
    per = {t: job.tp_factor(t) for t in set(tp.tolist())}
    return np.array([per[t] for t in tp.tolist()], dtype=float)


_SPLITS_KEPT = 32
"""Exact splits a re-planning memo keeps (:func:`_exact`), the least recently used
dropped first."""


def _exact(
    job: Job, speeds: np.ndarray, tp: np.ndarray, memo: dict[Any, Any] | None
) -> gp.BatchSplit | None:
    """:func:`ntp_opt.rules.goodput.split_batch` of ``speeds`` and ``tp``, kept in
    ``memo`` (when given) under their bytes for the same job: an event that leaves
    the replicas' speeds as they were reuses the split. At most
    :data:`_SPLITS_KEPT` splits are kept."""
    if memo is None:
        return gp.split_batch(job, speeds.tolist(), tp.tolist())
    kept = memo.get("splits")
    if kept is None or kept[0] is not job:
        kept = memo["splits"] = (job, {})
    splits: dict[Any, gp.BatchSplit | None] = kept[1]
    key = (speeds.dtype.str, speeds.tobytes(), tp.dtype.str, tp.tobytes())
    if key in splits:
        split = splits.pop(key)
    else:
        split = gp.split_batch(job, speeds.tolist(), tp.tolist())
        if len(splits) >= _SPLITS_KEPT:
            del splits[next(iter(splits))]
    splits[key] = split  # the most recently used last
    return split


def exact_split(
    job: Job, speeds: list[float], tps: list[int], memo: dict[Any, Any] | None = None
) -> gp.BatchSplit | None:
    """:func:`ntp_opt.rules.goodput.split_batch` of ``speeds`` and ``tps``, kept in
    ``memo`` with the re-boosts' splits (the same values are split once).

    Parameters
    ----------
    job
        The job.
    speeds, tps
        Per replica: its speed and degree.
    memo
        A re-planning chain's memo (:class:`~ntp_opt.workflows.replan_state.PlanState`),
        or ``None``.

    Returns
    -------
    BatchSplit or None
        What ``split_batch(job, speeds, tps)`` returns.
    """
    return _exact(job, np.array(speeds, dtype=float), np.array(tps, dtype=np.int64), memo)


def _bound(
    job: Job, speeds: np.ndarray, tp: np.ndarray, memo: dict[Any, Any] | None = None
) -> float:
    """The exact split's goodput at ``speeds`` (an upper bound on the split at lower
    speeds), with :data:`_BOUND_SLACK`; ``inf`` when the split fails."""
    split = _exact(job, speeds, tp, memo)
    return math.inf if split is None else split.goodput * (1 + _BOUND_SLACK)


def _split(
    instance: Instance,
    layout: Layout,
    powers: np.ndarray,
    slowest: np.ndarray,
    memo: dict[Any, Any] | None = None,
) -> tuple[float, tuple[int, ...], float] | None:
    """Goodput, batches and step time of the exact split of the layout's replicas at
    ``powers``."""
    speeds = layout_speeds(instance, layout, powers=powers, slowest=slowest)
    split = _exact(instance.job, speeds, np.asarray(layout.degree), memo)
    return None if split is None else (split.goodput, split.batches, split.step_time)


def _trimmed(
    instance: Instance,
    layout: Layout,
    stages: Stages,
    powers: np.ndarray,
    batches: tuple[int, ...],
    theta: float,
    slowest: np.ndarray,
) -> np.ndarray:
    """``powers`` lowered to what the split (``batches``, step time ``theta``) uses.

    :func:`ntp_opt.rules.boost.trim_powers` with each replica's need
    ``b_r (1 + rho) / theta``: a boost that raises no replica the split waits
    for is taken back (as ``fast`` trims its boosts). ``powers`` itself when
    the trimmed multipliers would lower the goodput at these batches
    (rounding) or change nothing.
    """
    job = instance.job
    if not math.isfinite(theta) or theta <= 0:
        return powers
    tps = layout.degree.tolist()
    need = np.array(batches, dtype=float) * gp.overhead_factor(job, tps) / theta
    trimmed = trim_powers(instance, stages, layout.degree, powers, need, slowest)
    if np.array_equal(trimmed, powers):
        return powers
    before = layout_speeds(instance, layout, powers=powers, slowest=slowest).tolist()
    after = layout_speeds(instance, layout, powers=trimmed, slowest=slowest).tolist()
    keep = gp.goodput(job, tps, list(batches), after) >= gp.goodput(job, tps, list(batches), before)
    return trimmed if keep else powers


def reboost_layout(
    instance: Instance,
    plan: Plan,
    layout: Layout,
    keep: float | None = None,
    memo: dict[Any, Any] | None = None,
) -> Local | None:
    """:func:`ntp_opt.workflows.replan.reboost` (unvalidated) on the layout's stages.

    Tries the plan's own multipliers, the boost of the replicas slower than
    nominal (:func:`ntp_opt.rules.boost.boost_stages`, 50 steps, from power 1)
    and the common-speed boost (:func:`ntp_opt.rules.boost.boost_floor_stages`),
    each with its exact batch split; keeps the best, its multipliers trimmed to
    what the split uses (:func:`ntp_opt.rules.boost.trim_powers` with each
    replica's need ``b_r (1 + rho) / theta``: the same goodput, no power
    spent on a replica beyond its batch). Only the slow replicas'
    stages go through the first boost; the stages' slowest speeds are read
    once for the boosts and the splits. A boost is computed only where an
    upper bound on its goodput (nominal speed for the slow replicas; for the
    common speed, the least cap's speed and what the site's room allows) can
    beat both the plan's own value and the other boost's result.

    Parameters
    ----------
    instance, plan, layout
        The instance, the plan and its layout.
    keep
        The goodput of the exact split at the plan's own multipliers, when
        the caller has it (recourse's plan carries it); computed otherwise.
    memo
        The memo of :func:`ntp_opt.rules.boost.boost_stages` and
        :func:`~ntp_opt.rules.boost.boost_floor_stages`, kept by the caller
        from one event to the next (the same result without it).

    Returns
    -------
    Local or None
        The re-boosted plan (``metrics = {"policy": "reboost"}``) and its
        layout; ``None`` when the plan's own multipliers are best (or nothing
        can boost).
    """
    if not plan.replicas or not can_boost(instance):
        return None
    b = _Boosts.of(instance, layout, keep, memo)
    best = _best_boost(b)
    if best is None:
        return None
    _, powers, batches, theta = best
    # boost a replica only as far as the split uses it
    powers = _trimmed(instance, layout, b.stages, powers, batches, theta, b.slowest)
    return _boosted(instance, plan, layout, powers, batches)


_Tried = tuple[np.ndarray, tuple[float, tuple[int, ...], float] | None]
"""A boost's multipliers and their exact split (goodput, batches, step time)."""


@dataclass(frozen=True)
class _Boosts:
    """What :func:`reboost_layout`'s two boosts share: the layout's stages, their
    slowest speeds and caps, the rooms, the slow replicas, the plan's own value and
    the bounds on what each boost can bring."""

    instance: Instance
    layout: Layout
    stages: Stages
    slowest: np.ndarray
    caps: np.ndarray
    rack_room: np.ndarray
    site_room: float
    ones: np.ndarray
    slow: list[int]
    value: float
    ub_slow: float | None
    ub_floor: float
    memo: dict[Any, Any] | None

    @classmethod
    def of(
        cls, instance: Instance, layout: Layout, keep: float | None, memo: dict[Any, Any] | None
    ) -> _Boosts:
        """Read the layout once for both boosts (see :func:`reboost_layout`)."""
        job = instance.job
        a = instance.arrays
        stages = stages_of(layout)
        tp = layout.degree
        slowest = stage_slowest(instance, layout, memo)
        own = layout_speeds(instance, layout, powers=layout.power, slowest=slowest)
        if keep is None:
            got_keep = _exact(job, own, np.asarray(layout.degree), memo)
            value = -1.0 if got_keep is None else got_keep.goodput
        else:
            value = keep
        used = np.zeros(a.n_gpus, dtype=bool)
        used[layout.gpus] = True
        rack_room, site_room = headroom(instance, used.astype(float), memo=memo)
        ones = np.ones(layout.n_stages)
        target = 1.0 / job.seq_time_s
        # at power 1 already (a swap plan): the same speeds as its own
        same = bool((layout.power == 1.0).all())
        at_one = own if same else layout_speeds(instance, layout, powers=ones, slowest=slowest)
        slow = np.flatnonzero(at_one < target * (1 - FLOAT_NOISE)).tolist()
        # Bounds on what each boost can bring: the exact split's goodput grows with
        # every speed, the slow replicas' boost lifts them to nominal speed at most,
        # and the common-speed boost lifts no stage above the best speed of the
        # slowest stage, nor above the speed the site's room allows
        # (:func:`floor_speed_bound`). A boost whose bound cannot win is not
        # computed (the choice is the same).
        best_case = at_one.copy()
        best_case[slow] = target
        base = _factors(job, tp)[stages.replica] * slowest
        caps = stages.stage_min(instance.max_multiplier)
        # the common speed is at most the slowest stage's best, and the site's room
        # caps it too (Newton from above on its draw)
        top = floor_speed_bound(instance, base, caps, stages.sizes, site_room)
        top = min(top, float((base * caps**job.power_exponent).min()))
        floor = np.maximum(at_one, top / job.seq_time_s)
        below_own = value >= 0 and bool((floor <= own).all())
        if below_own:
            # no replica above its speed at the plan's own multipliers: the split's
            # goodput there, which is the plan's own value (without another split)
            ub_floor = value * (1 + _BOUND_SLACK)
        else:
            ub_floor = _bound(job, floor, tp, memo)
        # the slow boost's bound only orders the two boosts when the floor's may win
        ub_slow = None if below_own else _bound(job, best_case, tp, memo)
        return cls(
            instance,
            layout,
            stages,
            slowest,
            caps,
            rack_room,
            site_room,
            ones,
            slow,
            value,
            ub_slow,
            ub_floor,
            memo,
        )

    def slow_boost(self) -> _Tried:
        """The slow replicas' boost (50 steps, from power 1) and its split."""
        pw, _ = boost_stages(
            self.instance,
            self.stages,
            self.layout.degree,
            self.ones,
            self.slow,
            self.rack_room,
            self.site_room,
            steps=50,
            memo=self.memo,
        )
        return pw, _split(self.instance, self.layout, pw, self.slowest, self.memo)

    def floor_boost(self) -> _Tried:
        """The common-speed boost and its split."""
        pw = boost_floor_stages(
            self.instance,
            self.stages,
            self.layout.degree,
            self.rack_room,
            self.site_room,
            slowest=self.slowest,
            caps=self.caps,
            memo=self.memo,
        )
        return pw, _split(self.instance, self.layout, pw, self.slowest, self.memo)


def _best_boost(b: _Boosts) -> tuple[float, np.ndarray, tuple[int, ...], float] | None:
    """The better boost (goodput, multipliers, batches, step time) when it beats the
    plan's own multipliers; each boost computed only where its bound can win."""
    bar = b.value * (1 + FLOAT_NOISE)
    got_slow: _Tried | None = None
    got_floor: _Tried | None = None
    if b.ub_slow is None:
        # the floor boost passes no replica's own speed: the slow boost first (were
        # its bound at most ``bar``, its split would be too: it cannot be kept),
        # then the floor boost where its bound is above what the slow one brings
        got_slow = b.slow_boost()
        g = got_slow[1]
        if b.ub_floor > bar and not (g is not None and g[0] >= b.ub_floor):
            got_floor = b.floor_boost()
    elif b.ub_floor >= b.ub_slow and b.ub_floor > bar:
        got_floor = b.floor_boost()
        g = got_floor[1]
        if b.ub_slow > bar and not (g is not None and g[0] > bar and g[0] > b.ub_slow):
            got_slow = b.slow_boost()
    elif b.ub_slow > bar:
        got_slow = b.slow_boost()
        g = got_slow[1]
        if b.ub_floor > bar and not (g is not None and g[0] >= b.ub_floor):
            got_floor = b.floor_boost()
    best: tuple[float, np.ndarray, tuple[int, ...], float] | None = None
    for powers, got in (t for t in (got_slow, got_floor) if t is not None):
        if (
            got is not None
            and got[0] > b.value * (1 + FLOAT_NOISE)
            and (best is None or got[0] > best[0])
        ):
            best = (got[0], powers, got[1], got[2])
    return best


def _boosted(
    instance: Instance, plan: Plan, layout: Layout, powers: np.ndarray, batches: tuple[int, ...]
) -> Local:
    """The plan and layout at ``powers`` and ``batches`` (a replica of no sequence
    leaves); unchanged replicas and stages are the plan's objects."""
    pp = instance.job.pp
    pw_l = powers.tolist()
    reps = []
    keep_r = []
    new_pw = np.asarray(powers, dtype=float)
    if layout.n_stages:  # per replica: does a stage's power change?
        moved = np.logical_or.reduceat(new_pw != layout.power, np.arange(0, len(new_pw), pp))
    else:
        moved = np.zeros(0, dtype=bool)
    moved_l = moved.tolist()
    for r, (rep, b) in enumerate(zip(plan.replicas, batches, strict=True)):
        if b <= 0:
            continue
        keep_r.append(r)
        if not moved_l[r]:  # equal stages: the same objects
            reps.append(rep if b == rep.local_batch else Replica(rep.tp, b, rep.stages))
            continue
        reps.append(
            Replica(
                tp=rep.tp,
                local_batch=b,
                stages=tuple(
                    st if pw == st.power else Stage(st.domain, st.gpus, pw)
                    for st, pw in zip(rep.stages, pw_l[r * pp : r * pp + pp], strict=True)
                ),
            )
        )
    metrics = {"policy": "reboost"}
    cand = Plan(plan.instance, tuple(reps), metrics)
    if len(keep_r) == layout.n_replicas:
        lay = Layout(
            **{
                **layout.__dict__,
                "power": np.asarray(powers, dtype=float),
                "batch": np.array(batches, dtype=np.int64),
                "metrics": metrics,
            }
        )
    else:  # a replica got no sequence: it leaves
        per = layout.per_replica()
        lay = _layout(
            [int(layout.degree[r]) for r in keep_r],
            [g for r in keep_r for g in per[r]],
            [int(d) for r in keep_r for d in layout.domain[r * pp : r * pp + pp]],
            [pw for r in keep_r for pw in pw_l[r * pp : r * pp + pp]],
        )
        lay = Layout(
            **{
                **lay.__dict__,
                "batch": np.array([batches[r] for r in keep_r], dtype=np.int64),
                "metrics": metrics,
                "instance": plan.instance,
            }
        )
    return Local(cand, lay)
