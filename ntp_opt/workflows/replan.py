"""Re-planning after events: a near-optimal plan that moves few GPUs.

:func:`replan` takes the instance a plan was made for, the plan, and what
happened since (GPU or tray failures, repairs, speed changes), and returns
the new instance and a validated plan for it, with the number of GPUs that
migrate. Up to three plans are compared:

* **local**: the running plan after the deterministic recourse of
  :func:`ntp_opt.rules.recourse.adapt` (failed GPUs replaced from in-domain spares,
  degrees reduced, batches re-split), with its power boosts redone by
  :func:`reboost` when recourse reset them, speeds changed, or (``fixed``
  batch) a replica's degree dropped: every replica then carries its share
  of the batch at that replica's pace. It moves only the GPUs the events
  force to move.
* **swap**: the local plan improved by a few stage swaps around the replicas
  the events touched (:func:`ntp_opt.planners.swaps.improve`): a damaged domain joins
  an already reduced replica, a spare domain comes in, a repaired replica
  returns to a higher degree. Each swap moves about two stages.
* **global**: the :func:`ntp_opt.planners.fast.plan_fast` plan of the new instance,
  with its replicas and stages renumbered to overlap the running plan as
  much as possible (:func:`align`).

They are tried in that order, each only while the best so far is more than
``tolerance`` (default 0.1 %) below the proven bound
:func:`ntp_opt.planners.bounds.stage.stage_bound`. Among the plans tried, the one moving
the fewest GPUs within ``tolerance`` of the best goodput is kept.

Migration counts the GPUs, healthy after the events, whose assignment
(replica index, stage index, or unused) differs between the running plan and
the new one; GPUs that failed are not counted.

The new instance shares the old one's (frozen) graph structure and only
copies the attributes of the GPUs that changed, so re-planning a 32k-GPU
cluster does not copy its graph.

The local plan is made and checked in index space, on the running plan's
:class:`~ntp_opt.model.layout.Layout`
(:mod:`ntp_opt.workflows.incremental`,
:func:`ntp_opt.rules.validate.evaluate_layout`). :func:`replan` checks the
plan it is given in full; a :class:`Replanner` keeps that check, the layout
and the bound's multipliers (:class:`PlanState`) from one event to the next
and updates the bound instead of searching it (``Replanned.bound_kind``;
with a ``fixed`` batch the ``fixed`` refinement's speed bounds are kept and
re-checked too, :attr:`PlanState.fixed`). When the updated bound does not
settle the local plan, the swap plan is made before the full bound is
searched: the updated bound settles the choice when the local plan is kept
over the swap plan and the better of the two is within ``tolerance`` of it
(the full bound, at most the updated one, would keep the local plan too);
otherwise the full bound decides, as without a state.
The swap plan is made from the local plan's layout
(:func:`~ntp_opt.planners.swaps.improve_layout`, which also returns the
swap plan's own layout), re-boosted on that layout and checked once in index
space, like the local plan. The global plan is aligned in index space and
keeps its layout (reordered from ``fast``'s); it is checked once, by the full
validator.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import SLOT, Layout
from ntp_opt.model.plan import Plan, Replica
from ntp_opt.planners.bounds import (
    DomainRows,
    DualPoints,
    FixedSpeeds,
    domain_rows,
    domain_rows_after,
    stage_bound_at,
    stage_bound_point,
)
from ntp_opt.planners.fast import plan_fast
from ntp_opt.planners.swaps import improve_layout
from ntp_opt.rules.tolerances import BOUND_TOL
from ntp_opt.rules.validate import Evaluation, PlanError, check, evaluate, evaluate_layout
from ntp_opt.workflows.events import ClusterEvent, apply_events, as_events, gpus_of
from ntp_opt.workflows.incremental import exact_split, reboost_layout, recourse_layout
from ntp_opt.workflows.replan_state import PlanState, Replanned

logger = logging.getLogger(__name__)


def assignment(instance: Instance, plan: Plan) -> np.ndarray:
    """Per GPU (``instance.arrays`` order): ``replica * 65536 + stage``, or -1 if unused."""
    return Layout.from_plan(instance, plan).assignment(instance.arrays.n_gpus)


def migration(instance: Instance, old: Plan, new: Plan) -> int:
    """GPUs, healthy in ``instance``, whose replica/stage differs between the plans.

    Parameters
    ----------
    instance
        The instance after the events (healthy GPUs are counted).
    old, new
        The running plan and the new one.

    Returns
    -------
    int
    """
    before = assignment(instance, old)
    after = assignment(instance, new)
    return int(((before != after) & instance.arrays.healthy).sum())


def align(
    instance: Instance,
    old: Plan,
    new: Plan,
    *,
    before: np.ndarray | None = None,
    layout: Layout | None = None,
) -> Plan:
    """Renumber ``new``'s replicas and stages to overlap ``old`` as much as possible.

    Greedy matching on shared GPUs: replica pairs with the most GPUs in
    common first; within a matched pair, stages keep the position of the old
    stage they share most GPUs with. Goodput does not change (replica and
    stage order carry no meaning in the model). The shared GPUs are counted
    in index space, for every pair at once.

    Parameters
    ----------
    instance
        The instance both plans are read on.
    old, new
        The running plan and the plan to renumber.
    before
        ``assignment(instance, old)``, when the caller has it.
    layout
        ``new``'s :class:`~ntp_opt.model.layout.Layout`, when the caller has it.

    Returns
    -------
    Plan
        ``new`` with its replicas and stages reordered.
    """
    return _aligned(instance, old, new, before, layout)[0]


def _aligned(
    instance: Instance,
    old: Plan,
    new: Plan,
    before: np.ndarray | None,
    layout: Layout | None,
) -> tuple[Plan, Layout]:
    """:func:`align`, and the aligned plan's layout (``new``'s, reordered)."""
    before = assignment(instance, old) if before is None else before
    lay = Layout.from_plan(instance, new) if layout is None else layout
    sizes = np.diff(lay.offsets)
    olds = before[lay.gpus]
    hit = olds >= 0
    new_r = np.repeat(lay.replica, sizes)[hit]
    new_k = np.repeat(lay.stage, sizes)[hit]
    olds = olds[hit]
    old_r, old_j = olds // SLOT, olds % SLOT
    slot_of = _match_replicas(new_r, old_r, len(new.replicas), len(old.replicas))
    score = _stage_scores(slot_of, new_r, new_k, old_r, old_j, len(new.replicas))
    # a plan is a list: fill gaps (old replicas with no successor) by compacting
    reps: list[Replica] = []
    first = np.searchsorted(lay.replica, np.arange(len(new.replicas)))
    picked: list[int] = []  # the new layout's stages, in the aligned order
    placed = sorted(range(len(new.replicas)), key=slot_of.__getitem__)
    for r in placed:
        rep = new.replicas[r]
        ks = list(range(len(rep.stages)))
        if slot_of[r] < len(old.replicas):
            pos = _stage_positions(score.get(r, []), len(rep.stages))
            ks = sorted(ks, key=pos.__getitem__)
            rep = Replica(
                tp=rep.tp, local_batch=rep.local_batch, stages=tuple(rep.stages[k] for k in ks)
            )
        reps.append(rep)
        picked.extend(int(first[r]) + k for k in ks)
    counts = np.array([len(new.replicas[r].stages) for r in placed], dtype=np.int64)
    lay_out = _picked_layout(lay, new, np.array(picked, dtype=np.int64), placed, counts)
    return Plan(new.instance, tuple(reps), dict(new.metrics)), lay_out


def _match_replicas(new_r: np.ndarray, old_r: np.ndarray, n_new: int, n_old: int) -> dict[int, int]:
    """New replica -> old replica index: pairs by GPUs shared, most first (ties: lower
    new, then old index); unmatched new replicas take the free indices in order."""
    keys, counts = np.unique(new_r * SLOT + old_r, return_counts=True)
    order = np.lexsort((keys % SLOT, keys // SLOT, -counts))
    slot_of: dict[int, int] = {}
    taken: set[int] = set()
    for key in keys[order].tolist():
        r, o = divmod(key, SLOT)
        if r not in slot_of and o not in taken:
            slot_of[r] = o
            taken.add(o)
    free = iter(i for i in range(max(n_new, n_old)) if i not in taken)
    for r in range(n_new):
        if r not in slot_of:
            slot_of[r] = next(free)
    return slot_of


def _stage_scores(
    slot_of: dict[int, int],
    new_r: np.ndarray,
    new_k: np.ndarray,
    old_r: np.ndarray,
    old_j: np.ndarray,
    n_new: int,
) -> dict[int, list[tuple[int, int, int]]]:
    """Per new replica, its stage pairs with its matched old replica by GPUs shared:
    ``(-shared, new stage, old stage)``."""
    target = np.array([slot_of[r] for r in range(n_new)], dtype=np.int64)
    mine = target[new_r] == old_r if len(target) else np.zeros(0, dtype=bool)
    skeys, scounts = np.unique(
        (new_r[mine] * SLOT + new_k[mine]) * SLOT + old_j[mine], return_counts=True
    )
    score: dict[int, list[tuple[int, int, int]]] = {}
    for key, c in zip(skeys.tolist(), scounts.tolist(), strict=True):
        rk, j = divmod(key, SLOT)
        r, k = divmod(rk, SLOT)
        score.setdefault(r, []).append((-c, k, j))
    return score


def _stage_positions(score: list[tuple[int, int, int]], n_stages: int) -> dict[int, int]:
    """New stage -> position: the old stage it shares most GPUs with (greedy), the
    others the free positions in order."""
    pos: dict[int, int] = {}
    used: set[int] = set()
    for _, k, j in sorted(score):
        if k not in pos and j not in used:
            pos[k] = j
            used.add(j)
    rest = iter(j for j in range(n_stages) if j not in used)
    for k in range(n_stages):
        if k not in pos:
            pos[k] = next(rest)
    return pos


def _picked_layout(
    lay: Layout, new: Plan, sel: np.ndarray, placed: list[int], counts: np.ndarray
) -> Layout:
    """``lay``'s stages ``sel`` in that order, as the layout of replicas ``placed``
    (``counts`` stages each)."""
    sizes = np.diff(lay.offsets)
    starts = np.cumsum(counts) - counts
    offsets = np.zeros(len(sel) + 1, dtype=np.int64)
    np.cumsum(sizes[sel], out=offsets[1:])
    # each picked stage's GPUs: its old start plus 0 .. size - 1
    shift = np.repeat(lay.offsets[sel] - offsets[:-1], sizes[sel])
    return Layout(
        replica=np.repeat(np.arange(len(placed), dtype=np.int64), counts),
        stage=np.arange(len(sel), dtype=np.int64) - np.repeat(starts, counts),
        domain=lay.domain[sel],
        offsets=offsets,
        gpus=lay.gpus[np.arange(offsets[-1], dtype=np.int64) + shift],
        power=lay.power[sel],
        degree=lay.degree[placed],
        batch=lay.batch[placed],
        metrics=dict(new.metrics),
        instance=lay.instance,
    )


def reboost(instance: Instance, plan: Plan) -> Plan:
    """The same replicas and GPUs with the best power boost and batch split.

    Tries the plan's own multipliers, the boost of the replicas slower than
    nominal (:func:`ntp_opt.rules.boost.boost_stages`, as
    :func:`ntp_opt.planners.packing.boost_slowest`) and the common-speed
    boost (:func:`ntp_opt.rules.boost.boost_floor_stages`, as
    :func:`ntp_opt.planners.fast_cuts.boost_floor`), on the plan's
    :class:`~ntp_opt.rules.boost.Stages`; keeps the best. No GPU moves. Used
    after recourse, whose power rule (every boost of an over-budget rack or
    site back to 1) is blunt: a repaired GPU's idle draw alone can trigger it.

    Parameters
    ----------
    instance
        The instance the plan runs on.
    plan
        The plan to re-boost.

    Returns
    -------
    Plan
        The re-boosted plan, not validated (check it with
        :func:`ntp_opt.rules.validate.evaluate`), or ``plan`` itself when its
        own multipliers are best.
    """
    if not plan.replicas:
        return plan
    got = reboost_layout(instance, plan, Layout.from_plan(instance, plan))
    return plan if got is None else got.plan


Check = Literal["incremental", "full"]
Mode = Literal["auto", "local", "global"]


def _settings(tolerance: float, mode: str, check_mode: str) -> None:
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    if mode not in ("auto", "local", "global"):
        raise ValueError(f"mode must be auto, local or global, got {mode!r}")
    if check_mode not in ("incremental", "full"):
        raise ValueError(f"check must be incremental or full, got {check_mode!r}")


def _evaluate(
    instance: Instance,
    plan: Plan,
    layout: Layout,
    check_mode: str,
    memo: dict[Any, Any] | None = None,
) -> Evaluation:
    """The validator's figures of a plan made in index space.

    ``"incremental"``: :func:`ntp_opt.rules.validate.evaluate_layout` (every
    rule on the layout's arrays, no node id read). ``"full"``: also the full
    :func:`ntp_opt.rules.validate.evaluate`, which must agree figure for
    figure (else ``RuntimeError``: a bug, never hidden). ``memo``: the
    chain's (:class:`PlanState`), for the stages' slowest speeds.
    """
    ev = evaluate_layout(instance, plan, layout, memo)
    if check_mode == "full":
        full = evaluate(instance, plan)
        if full != ev:
            raise RuntimeError(f"the index-space check differs from the validator: {ev} != {full}")
    return ev


def _degree_dropped(before: Layout, after: Layout) -> bool:
    """Does ``after`` (recourse's layout) run fewer GPUs per stage than ``before``
    in total, i.e. did recourse reduce a degree or drop a replica?"""
    return int(after.degree.sum()) < int(before.degree.sum())


def _choose(options: Mapping[str, tuple[Plan, float, int]], tolerance: float) -> str:
    """The plan kept: the fewest moves among the plans within ``tolerance`` of the best."""
    top = max(v for _, v, _ in options.values())
    return min(
        (name for name, (_, v, _) in options.items() if v >= top * (1 - tolerance)),
        key=lambda name: (options[name][2], -options[name][1]),
    )


@dataclass
class _Step:
    """One re-plan's working state: the plans tried so far (by name: the plan with
    its figures, goodput and migration; its evaluation; its layout, where known)
    and the bound (``bound_kind``: ``"skipped"``, ``"incremental"``, ``"pending"``
    (the incremental bound, undecided) or ``"computed"``)."""

    state: PlanState
    new_inst: Instance
    tolerance: float
    mode: str
    check_mode: str
    options: dict[str, tuple[Plan, float, int]] = field(default_factory=dict)
    evals: dict[str, Evaluation] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    bound: float = math.inf
    points: DualPoints | None = None
    rows: DomainRows | None = None
    fixed: FixedSpeeds | None = None
    bound_kind: str = "skipped"
    placed: dict[str, np.ndarray] = field(default_factory=dict)

    def moved_by(self, plan: Plan, layout: Layout | None = None, name: str | None = None) -> int:
        """GPUs, healthy after the events, that ``plan`` moves from the running plan
        (``name``: the option's, whose assignment is kept for the next state)."""
        lay = Layout.from_plan(self.new_inst, plan) if layout is None else layout
        after = lay.assignment(self.state.instance.arrays.n_gpus)
        if name is not None and layout is not None:
            self.placed[name] = after
        return int(((after != self.state.assignment) & self.new_inst.arrays.healthy).sum())

    def settled(self) -> bool:
        """Is the best plan so far within ``tolerance`` of the bound (``"auto"`` only)?"""
        best = max(v for _, v, _ in self.options.values())
        return self.mode == "auto" and best >= self.bound * (1 - self.tolerance)

    def full_bound(self) -> None:
        """Search the bound (:func:`~ntp_opt.planners.bounds.stage.stage_bound_point`)."""
        rows = domain_rows(self.new_inst) if self.rows is None else self.rows
        fixed: FixedSpeeds | None = {} if self.new_inst.job.batch_policy == "fixed" else None
        self.bound, self.points = stage_bound_point(self.new_inst, rows, fixed)
        self.rows, self.fixed, self.bound_kind = rows, fixed, "computed"

    def add(self, name: str, plan: Plan, ev: Evaluation, layout: Layout | None) -> None:
        """Add a checked plan (``layout``: its layout, when known)."""
        self.evals[name] = ev
        if layout is not None:
            self.layouts[name] = layout
        self.options[name] = (
            plan.with_metrics(**ev.as_metrics()),
            ev.goodput,
            self.moved_by(plan, layout, name),
        )


def _local_plan(
    state: PlanState, evs: list[ClusterEvent], new_inst: Instance, check_mode: str
) -> tuple[Plan, Layout, Evaluation]:
    """The running plan after recourse (re-boosted where it pays), its layout and its
    check."""
    a = state.instance.arrays
    failed_now = a.healthy & ~new_inst.arrays.healthy
    local, local_lay = recourse_layout(new_inst, state.plan, state.layout, failed_now, state.memo)
    if (
        local.metrics.get("reduced_power")
        or any(e.kind == "speed" for e in evs)
        or (new_inst.job.batch_policy == "fixed" and _degree_dropped(state.layout, local_lay))
    ):
        # recourse reset boosts, speeds changed, or (fixed batch) a replica runs at a
        # lower degree, which sets the whole job's pace: redo the boosts
        keep = local.metrics["goodput"]  # the exact split at recourse's multipliers
        boosted = reboost_layout(
            new_inst, local, local_lay, keep if local.replicas else None, state.memo
        )
        if boosted is not None:
            ev = _evaluate(new_inst, boosted.plan, boosted.layout, check_mode, state.memo)
            if ev.feasible:
                return boosted.plan, boosted.layout, ev
    local_ev = _evaluate(new_inst, local, local_lay, check_mode, state.memo)
    if not local_ev.feasible:
        raise PlanError(list(local_ev.violations))
    return local, local_lay, local_ev


def _incremental_bound(step: _Step, local_goodput: float) -> None:
    """The dual at the last full bound's multipliers (valid for any multipliers),
    on the domain rows the events touched recomputed: enough whenever it settles
    the choice; ``"pending"`` when it does not settle the local plan (``"auto"``)."""
    state, new_inst = step.state, step.new_inst
    a = state.instance.arrays
    changed = (a.healthy != new_inst.arrays.healthy) | (a.speed != new_inst.arrays.speed)
    assert state.points is not None and state.rows is not None
    touched_d = sorted({int(a.gpu_domain[i]) for i in np.flatnonzero(changed)})
    step.rows = domain_rows_after(new_inst, state.rows, touched_d)
    step.fixed = {} if state.fixed is not None else None
    step.bound = stage_bound_at(new_inst, state.points, step.rows, state.fixed, step.fixed)
    step.bound_kind = "incremental"
    if step.mode == "auto" and local_goodput < step.bound * (1 - step.tolerance):
        # undecided: the swap plan is made first; the incremental bound may
        # settle the choice with it, else the full bound decides
        step.bound_kind = "pending"


def _add_swap(
    step: _Step, evs: list[ClusterEvent], local: Plan, local_lay: Layout, legacy: bool
) -> None:
    """Make the swap plan around the replicas the events touched, re-boost and check
    it; add it when it passes."""
    state, new_inst = step.state, step.new_inst
    a = state.instance.arrays
    touched = {
        int(a.gpu_domain[i])
        for e in evs
        for node in e.nodes
        for i in gpus_of(state.instance, node, state.trays)
    }
    # the replicas with a stage in a touched domain (read from the local layout)
    hit = np.isin(local_lay.domain, np.fromiter(touched, dtype=np.int64, count=len(touched)))
    focus = set(local_lay.replica[hit].tolist())
    if legacy:
        got = improve_layout(new_inst, local, focus)
    else:  # the search's splits and the re-boosts' are kept together
        split = functools.partial(exact_split, memo=state.memo)
        got = improve_layout(new_inst, local, focus, layout=local_lay, splitter=split)
    if got is None:
        return
    swap, swap_lay = got
    if legacy:  # as before issue 30 (tests compare)
        plain = reboost(new_inst, swap)
        if plain is not swap and evaluate(new_inst, plain).feasible:
            swap = plain
        ev = evaluate(new_inst, swap)
        if ev.feasible:
            step.add("swap", swap, ev, None)
        return
    # :func:`reboost` on one layout, checked once in index space (the validator's
    # figures; ``check="full"`` adds the validator): the boosted plan when it
    # passes, else the plan as improved
    boosted = reboost_layout(new_inst, swap, swap_lay, None, state.memo) if swap.replicas else None
    boost_ev = (
        None if boosted is None else _evaluate(new_inst, *boosted, step.check_mode, state.memo)
    )
    if boosted is not None and boost_ev is not None and boost_ev.feasible:
        (swap, swap_lay), ev = boosted, boost_ev
    else:
        ev = _evaluate(new_inst, swap, swap_lay, step.check_mode, state.memo)
    if ev.feasible:
        step.add("swap", swap, ev, swap_lay)


def _settle_pending(step: _Step, local_goodput: float) -> None:
    """Decide an event the incremental bound left pending, after the swap plan."""
    if step.settled() and _choose(step.options, step.tolerance) == "local":
        # the incremental bound settles it: the full bound would too (it is at
        # most the incremental one, up to its bisection's resolution), and whether
        # it settled the local plan alone or with the swap plan, the local plan is
        # kept
        step.bound_kind = "incremental"
        return
    step.full_bound()  # the full bound decides, as without a state
    if "swap" in step.options and local_goodput >= step.bound * (1 - step.tolerance):
        # the full bound settles the local plan alone: no swap plan is made
        for kept in (step.options, step.evals, step.layouts, step.placed):
            kept.pop("swap", None)


def _add_global(step: _Step) -> None:
    """The ``fast`` plan of the new cluster, aligned with the running plan; checked
    once, after alignment (which changes no figure); the bound is the step's."""
    new_inst = step.new_inst
    fresh = plan_fast(new_inst, bound=False).require_plan()
    fresh, fresh_lay = _aligned(new_inst, step.state.plan, fresh, step.state.assignment, None)
    step.add("global", fresh, check(new_inst, fresh), fresh_lay)


def _step(
    state: PlanState,
    evs: list[ClusterEvent],
    *,
    tolerance: float,
    mode: str,
    check_mode: str,
    want_bound: bool,
    start: float,
    legacy: bool = False,
) -> Replanned:
    """Re-plan ``state`` after ``evs`` (module docstring); the new state rides along.

    ``legacy``: the swap plan re-boosted and checked as before issue 30 (its
    slots read from the plan's node ids, re-boosted by :func:`reboost`,
    checked twice by the full validator, its layout rebuilt): the same
    result, slower; kept for the tests that compare the two.
    """
    new_inst = apply_events(state.base or state.instance, evs, trays=state.trays)
    local, local_lay, local_ev = _local_plan(state, evs, new_inst, check_mode)
    step = _Step(state, new_inst, tolerance, mode, check_mode, points=state.points)
    step.fixed = state.fixed
    if want_bound and state.points is not None and state.rows is not None:
        _incremental_bound(step, local_ev.goodput)
    if want_bound and step.bound_kind == "skipped":
        step.full_bound()
    step.options["local"] = (local, local_ev.goodput, step.moved_by(local, local_lay, "local"))
    step.evals["local"] = local_ev
    step.layouts["local"] = local_lay
    if mode != "local" and not step.settled():
        _add_swap(step, evs, local, local_lay, legacy)
    if step.bound_kind == "pending":
        _settle_pending(step, local_ev.goodput)
    if mode == "global" or (mode == "auto" and not step.settled()):
        _add_global(step)
    choice = "global" if mode == "global" else _choose(step.options, tolerance)
    return _outcome(step, choice, local_ev, want_bound, start)


def _outcome(
    step: _Step, choice: str, local_ev: Evaluation, want_bound: bool, start: float
) -> Replanned:
    """The :class:`Replanned` of the kept plan, with the new state."""
    chosen, value, moved = step.options[choice]
    bound, new_inst = step.bound, step.new_inst
    if value > bound * (1 + BOUND_TOL):  # a bug, never hidden
        raise RuntimeError(f"re-planned goodput {value} above the bound {bound}")
    ev = step.evals[choice]  # the chosen plan was checked above; only its metrics change
    extra: dict[str, Any] = {"bound": bound} if want_bound else {}
    chosen = chosen.with_metrics(**ev.as_metrics(), policy=f"replan-{choice}", moved=moved, **extra)
    if choice in step.layouts:
        lay = Layout(**{**step.layouts[choice].__dict__, "metrics": dict(chosen.metrics)})
    else:
        lay = Layout.from_plan(new_inst, chosen)
    logger.info(
        "replan: kept the %s plan, %d GPUs move, goodput %.9g (bound %.9g)",
        choice,
        moved,
        ev.goodput,
        bound,
    )
    options = step.options
    state = step.state
    return Replanned(
        instance=new_inst,
        plan=chosen,
        choice=choice,
        moved=moved,
        goodput=ev.goodput,
        relative_goodput=ev.relative_goodput,
        bound=bound,
        local_goodput=local_ev.goodput,
        global_goodput=options["global"][1] if "global" in options else None,
        global_moved=options["global"][2] if "global" in options else None,
        runtime_s=time.perf_counter() - start,
        details={name: {"goodput": v, "moved": m} for name, (_, v, m) in options.items()},
        bound_kind=step.bound_kind,
        state=PlanState(
            new_inst,
            chosen,
            lay,
            ev,
            step.points,
            step.rows,
            step.fixed,
            trays=state.trays,
            memo=state.memo,
            placed=step.placed.get(choice) if choice in step.layouts else None,
        ),
    )


def replan(
    instance: Instance,
    plan: Plan,
    events: Iterable[Any] = (),
    *,
    tolerance: float = 1e-3,
    mode: Mode = "auto",
    check: Check = "incremental",
    bound: bool = True,
) -> Replanned:
    """Re-plan after ``events``, moving as few GPUs as the goodput allows.

    Parameters
    ----------
    instance
        The instance ``plan`` was made for.
    plan
        The running plan (feasible for ``instance``; checked in full here:
        :class:`Replanner` keeps that check from one event to the next).
    events
        What happened since (see :func:`~ntp_opt.workflows.events.apply_events`).
    tolerance
        Relative goodput that may be given up to avoid migration (module
        docstring).
    mode
        ``"auto"`` (module docstring), ``"local"`` (recourse only) or
        ``"global"`` (always the aligned global plan).
    check
        How the local and swap plans are checked: ``"incremental"``
        (default: every rule on the layout's arrays,
        :func:`ntp_opt.rules.validate.evaluate_layout`) or ``"full"`` (also
        the full validator, which must agree figure for figure). The global
        plan always goes through the full one.
    bound
        Compute the bound (default). ``False`` skips it where no decision
        needs it (``mode="local"`` or ``"global"``): ``Replanned.bound`` is
        then ``inf``.

    Returns
    -------
    Replanned
    """
    _settings(tolerance, mode, check)
    if not bound and mode == "auto":
        raise ValueError("mode='auto' decides by the bound: it cannot be skipped")
    start = time.perf_counter()
    state = PlanState.checked(instance, plan)
    return _step(
        state,
        as_events(events),
        tolerance=tolerance,
        mode=mode,
        check_mode=check,
        want_bound=bound,
        start=start,
    )


class Replanner:
    """Re-plans a running plan event after event (a scheduler replaying a trace).

    Holds the instance, the plan and its :class:`PlanState` (layout and the
    validator's figures): the plan is checked in full once, on construction;
    each :meth:`replan` then starts from the kept state instead of
    re-validating its input, applies the events to the arrays
    (copy-on-write), runs recourse on the touched replicas only and
    re-checks the result in index space (``check="full"`` adds the full
    validator). Each call returns what :func:`replan` returns for the same
    plan and events (tests check it) and makes its plan the running one.

    Parameters
    ----------
    instance, plan
        The running plan and its instance.
    tolerance, mode, check
        As for :func:`replan`.
    bound
        ``None`` (default): compute the bound only where a decision needs it
        (``mode="auto"``); ``True``: always; ``False``: never (not with
        ``"auto"``). Skipped, ``Replanned.bound`` is ``inf``.
    """

    def __init__(
        self,
        instance: Instance,
        plan: Plan,
        *,
        tolerance: float = 1e-3,
        mode: Mode = "auto",
        check: Check = "incremental",
        bound: bool | None = None,
    ) -> None:
        _settings(tolerance, mode, check)
        if bound is False and mode == "auto":
            raise ValueError("mode='auto' decides by the bound: it cannot be skipped")
        self.tolerance = tolerance
        self.mode = mode
        self.check = check
        self.bound = (mode == "auto") if bound is None else bound
        self._legacy = False  # the swap plan checked as before issue 30 (tests compare)
        state = PlanState.checked(instance, plan)
        if self.bound:  # the multipliers and rows the events' bounds start from
            rows = domain_rows(instance)
            fixed: FixedSpeeds | None = {} if instance.job.batch_policy == "fixed" else None
            points = stage_bound_point(instance, rows, fixed)[1]
            state = dataclasses.replace(state, points=points, rows=rows, fixed=fixed)
        self.state = state

    @property
    def instance(self) -> Instance:
        """The instance after every event so far."""
        return self.state.instance

    @property
    def plan(self) -> Plan:
        """The running plan."""
        return self.state.plan

    def replan(self, events: Iterable[Any], *, commit: bool = True) -> Replanned:
        """Re-plan after ``events`` (as :func:`replan`); the new plan becomes the running one.

        Parameters
        ----------
        events
            What happened since the last call.
        commit
            ``False``: a what-if; the running plan and instance stay as they were.

        Returns
        -------
        Replanned
        """
        start = time.perf_counter()
        out = _step(
            self.state,
            as_events(events),
            tolerance=self.tolerance,
            mode=self.mode,
            check_mode=self.check,
            want_bound=self.bound,
            start=start,
            legacy=self._legacy,
        )
        if commit:
            assert out.state is not None
            self.state = out.state
        return out
