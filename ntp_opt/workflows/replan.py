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
* **global**: the :func:`ntp_opt.fast.plan_fast` plan of the new instance,
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
import logging
import math
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import SLOT, Layout
from ntp_opt.model.plan import Plan, Replica
from ntp_opt.model.topology.attrs import SPEED_MIN
from ntp_opt.planners.bounds import (
    DomainRows,
    DualPoints,
    FixedSpeeds,
    domain_rows,
    domain_rows_after,
    stage_bound_at,
    stage_bound_point,
)
from ntp_opt.planners.swaps import improve_layout
from ntp_opt.rules.tolerances import BOUND_TOL
from ntp_opt.rules.validate import Evaluation, PlanError, check, evaluate, evaluate_layout
from ntp_opt.workflows.incremental import reboost_layout, recourse_layout

logger = logging.getLogger(__name__)

EventKind = Literal["fail", "repair", "speed"]


@dataclass(frozen=True)
class ClusterEvent:
    """Something that happened to the cluster since the plan was made.

    Attributes
    ----------
    kind
        ``"fail"`` (the GPUs go down), ``"repair"`` (they come back healthy)
        or ``"speed"`` (their relative speed becomes ``speed``: a new or
        recovered straggler).
    nodes
        GPU or tray ids (a tray stands for all of its GPUs); a single id
        (``ClusterEvent("fail", "d2.t0.g0")``) stands for a one-element tuple.
    speed
        The new speed, from :data:`~ntp_opt.model.topology.attrs.SPEED_MIN` (the
        smallest an instance file holds) to 1, for ``"speed"`` events only.
    """

    kind: EventKind
    nodes: tuple[Hashable, ...]
    speed: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fail", "repair", "speed"):
            raise ValueError(f"event kind must be fail, repair or speed, got {self.kind!r}")
        nodes: Any = self.nodes
        if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Iterable):
            nodes = (nodes,)  # one id, not a sequence of characters
        object.__setattr__(self, "nodes", tuple(nodes))
        if not self.nodes:
            raise ValueError("an event needs at least one GPU or tray")
        if self.kind == "speed":
            if self.speed is None or not (SPEED_MIN <= float(self.speed) <= 1.0):
                raise ValueError(
                    f"a speed event needs speed in [{SPEED_MIN:g}, 1], got {self.speed!r}"
                )
        elif self.speed is not None:
            raise ValueError(f"only speed events carry a speed ({self.kind} event has one)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterEvent:
        """Build from ``{"kind", "nodes", "speed"?}`` (unknown keys are an error)."""
        extra = set(data) - {"kind", "nodes", "speed"}
        if extra:
            raise ValueError(f"unknown event field(s): {', '.join(sorted(extra))}")
        if "kind" not in data or "nodes" not in data:
            raise ValueError("an event needs 'kind' and 'nodes'")
        nodes = data["nodes"]
        if isinstance(nodes, str) or not isinstance(nodes, Sequence):
            raise ValueError("event 'nodes' must be a list of node ids")
        return cls(data["kind"], tuple(nodes), data.get("speed"))


def _as_events(events: Iterable[Any]) -> list[ClusterEvent]:
    out = []
    for e in events:
        if isinstance(e, ClusterEvent):
            out.append(e)
        elif isinstance(e, Mapping):
            out.append(ClusterEvent.from_dict(e))
        elif hasattr(e, "kind") and hasattr(e, "gpu_ids"):  # ntp_opt.workflows.simulate.Event
            out.append(ClusterEvent(e.kind, tuple(e.gpu_ids)))
        else:
            raise TypeError(f"not an event: {e!r}")
    return out


def _gpus_of(
    instance: Instance, node: Hashable, trays: Mapping[Hashable, int] | None = None
) -> list[int]:
    """GPU indices of a GPU or tray id; ``trays`` (tray id -> index), when given, spares
    reading the graph."""
    a = instance.arrays
    if node in a.gpu_index:
        return [a.gpu_index[node]]
    if trays is not None:
        if node in trays:
            return np.flatnonzero(a.gpu_tray == trays[node]).tolist()
        raise ValueError(f"event names {node!r}, which is not a GPU or tray of {instance.name!r}")
    g = instance.cluster
    if node in g and g.nodes[node].get("kind") == "tray":
        return [a.gpu_index[n] for n in g.adj[node] if n in a.gpu_index]
    raise ValueError(f"event names {node!r}, which is not a GPU or tray of {instance.name!r}")


def apply_events(instance: Instance, events: Iterable[Any]) -> Instance:
    """The instance after ``events``, sharing the unchanged graph structure.

    Parameters
    ----------
    instance
        The instance before.
    events
        :class:`ClusterEvent` objects, dicts of their fields, or
        :class:`ntp_opt.workflows.simulate.Event` objects, applied in order.

    Returns
    -------
    Instance
        A new instance (same name, job and meta); the input is unchanged.

    Raises
    ------
    ValueError
        An event names an unknown node, fails a failed GPU or repairs a
        healthy one.
    """
    return _apply(instance, _as_events(events))


def _apply(
    instance: Instance, events: list[ClusterEvent], trays: Mapping[Hashable, int] | None = None
) -> Instance:
    """:func:`apply_events`; ``trays`` as for :func:`_gpus_of`."""
    a = instance.arrays
    healthy = a.healthy.copy()
    speed = a.speed.copy()
    for e in events:
        for node in e.nodes:
            for i in _gpus_of(instance, node, trays):
                if e.kind == "fail":
                    if not healthy[i]:
                        raise ValueError(f"event fails GPU {a.gpu_ids[i]!r}, which is down")
                    healthy[i] = False
                elif e.kind == "repair":
                    if healthy[i]:
                        raise ValueError(f"event repairs GPU {a.gpu_ids[i]!r}, which is up")
                    healthy[i] = True
                else:
                    speed[i] = float(e.speed)  # type: ignore[arg-type]
    return instance.with_health(healthy, speed)


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
    # replica pairs by GPUs shared, most first (ties: lower new, then old index)
    keys, counts = np.unique(new_r * SLOT + old_r, return_counts=True)
    order = np.lexsort((keys % SLOT, keys // SLOT, -counts))
    slot_of: dict[int, int] = {}
    taken: set[int] = set()
    for key in keys[order].tolist():
        r, o = divmod(key, SLOT)
        if r not in slot_of and o not in taken:
            slot_of[r] = o
            taken.add(o)
    n = max(len(new.replicas), len(old.replicas))
    free = iter(i for i in range(n) if i not in taken)
    for r in range(len(new.replicas)):
        if r not in slot_of:
            slot_of[r] = next(free)
    # stage pairs of matched replicas by GPUs shared: (new replica, new stage, old stage)
    target = np.array([slot_of[r] for r in range(len(new.replicas))], dtype=np.int64)
    mine = target[new_r] == old_r if len(target) else np.zeros(0, dtype=bool)
    skeys, scounts = np.unique(
        (new_r[mine] * SLOT + new_k[mine]) * SLOT + old_j[mine], return_counts=True
    )
    score: dict[int, list[tuple[int, int, int]]] = {}
    for key, c in zip(skeys.tolist(), scounts.tolist(), strict=True):
        rk, j = divmod(key, SLOT)
        r, k = divmod(rk, SLOT)
        score.setdefault(r, []).append((-c, k, j))
    # a plan is a list: fill gaps (old replicas with no successor) by compacting
    reps: list[Replica] = []
    first = np.searchsorted(lay.replica, np.arange(len(new.replicas)))
    picked: list[int] = []  # the new layout's stages, in the aligned order
    placed = sorted(range(len(new.replicas)), key=slot_of.__getitem__)
    for r in placed:
        rep = new.replicas[r]
        ks = list(range(len(rep.stages)))
        if slot_of[r] < len(old.replicas):
            pos: dict[int, int] = {}
            used: set[int] = set()
            for _, k, j in sorted(score.get(r, ())):
                if k not in pos and j not in used:
                    pos[k] = j
                    used.add(j)
            rest = iter(j for j in range(len(rep.stages)) if j not in used)
            for k in range(len(rep.stages)):
                if k not in pos:
                    pos[k] = next(rest)
            ks = sorted(ks, key=pos.__getitem__)
            rep = Replica(
                tp=rep.tp, local_batch=rep.local_batch, stages=tuple(rep.stages[k] for k in ks)
            )
        reps.append(rep)
        picked.extend(int(first[r]) + k for k in ks)
    sel = np.array(picked, dtype=np.int64)
    counts = np.array([len(new.replicas[r].stages) for r in placed], dtype=np.int64)
    starts = np.cumsum(counts) - counts
    offsets = np.zeros(len(sel) + 1, dtype=np.int64)
    np.cumsum(sizes[sel], out=offsets[1:])
    # each picked stage's GPUs: its old start plus 0 .. size - 1
    shift = np.repeat(lay.offsets[sel] - offsets[:-1], sizes[sel])
    lay_out = Layout(
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
    return Plan(new.instance, tuple(reps), dict(new.metrics)), lay_out


def reboost(instance: Instance, plan: Plan, *, validate: bool = True) -> Plan:
    """The same replicas and GPUs with the best power boost and batch split.

    Tries the plan's own multipliers, the boost of the replicas slower than
    nominal (:func:`ntp_opt.rules.power.boost_stages`, as
    :func:`ntp_opt.planners.heuristics.boost_slowest`) and the common-speed
    boost (:func:`ntp_opt.rules.power.boost_floor_stages`, as
    :func:`ntp_opt.planners.fast.boost_floor`), on the plan's
    :class:`~ntp_opt.rules.power.Stages`; keeps the best (checked by the
    validator unless ``validate=False``, for a caller that checks it). No GPU
    moves. Used after recourse, whose power rule (every boost of an
    over-budget rack or site back to 1) is blunt: a repaired GPU's idle draw
    alone can trigger it.
    """
    if not plan.replicas:
        return plan
    got = reboost_layout(instance, plan, Layout.from_plan(instance, plan))
    if got is None:
        return plan
    if not validate:
        return got.plan  # the caller checks it
    return got.plan if evaluate(instance, got.plan).feasible else plan  # one check, of the winner


@dataclass(frozen=True, eq=False)
class PlanState:
    """A running plan and what was checked about it: what re-planning starts from.

    Attributes
    ----------
    instance
        The instance the plan runs on.
    plan
        The plan (feasible for ``instance``).
    layout
        The plan's layout (index space): recourse, re-boosting and the
        re-check of the next event work on it, never on node ids.
    evaluation
        The validator's figures of ``plan`` (feasible).
    points
        The multipliers of the last bound computed in full
        (:func:`ntp_opt.planners.bounds.stage.stage_bound_point`), from which
        the next events' bounds are updated; ``None`` before the first.
    rows
        ``domain_rows(instance)`` (:mod:`ntp_opt.planners.bounds.rows`),
        kept with ``points``: an event recomputes the rows of the domains it
        touches only.
    fixed
        For a ``fixed`` job, the speed bounds of the bound's ``fixed``
        refinement (:data:`~ntp_opt.planners.bounds.stage.FixedSpeeds`), kept
        with ``points``: the incremental bound re-checks them instead of
        searching them; ``None``: the incremental bound leaves the
        refinement out.
    base
        What the next events are applied to: ``instance`` itself, or, when
        its graph is built, a twin sharing its arrays whose graph is built
        only when read (:meth:`~ntp_opt.model.instance.Instance.from_arrays`):
        an event then copies two arrays, not the graph's node table. ``None``:
        ``instance``.
    trays
        Tray id -> index (``instance.arrays.tray_ids``), so that a tray event
        never reads the graph; ``None``: built when needed.
    memo
        What re-boosting keeps from one event to the next (the slow
        replicas' needs, :func:`ntp_opt.rules.power.boost_stages`; the
        stages' caps and groups, :func:`~ntp_opt.rules.power.boost_floor_stages`):
        shared by the states of one chain, never changing a result.
    """

    instance: Instance
    plan: Plan
    layout: Layout
    evaluation: Evaluation
    points: DualPoints | None = None
    rows: DomainRows | None = None
    fixed: FixedSpeeds | None = None
    base: Instance | None = None
    trays: Mapping[Hashable, int] | None = None
    memo: dict[Any, Any] | None = None

    @cached_property
    def assignment(self) -> np.ndarray:
        """Per GPU, the plan's ``replica * 65536 + stage`` or -1 (:func:`assignment`),
        computed once: every event re-planned from this state counts moves against it."""
        return self.layout.assignment(self.instance.arrays.n_gpus)

    @classmethod
    def checked(cls, instance: Instance, plan: Plan) -> PlanState:
        """The state of a plan from outside: checked in full by the validator.

        Raises
        ------
        PlanError
            The plan breaks a rule of ``instance``.
        """
        ev = check(instance, plan)
        trays = {t: i for i, t in enumerate(instance.arrays.tray_ids)}
        layout = Layout.from_plan(instance, plan)
        return cls(instance, plan, layout, ev, base=_unbuilt(instance), trays=trays, memo={})


def _unbuilt(instance: Instance) -> Instance:
    """``instance``, or its twin with the graph left unbuilt (``PlanState.base``)."""
    if "cluster" not in vars(instance):
        return instance
    twin = Instance.from_arrays(
        instance.name, instance.arrays, instance.job, instance.meta, lambda: instance.cluster
    )
    vars(twin)["max_multiplier"] = instance.max_multiplier  # the same boards and job
    return twin


@dataclass(frozen=True)
class Replanned:
    """Outcome of :func:`replan`.

    Attributes
    ----------
    instance
        The instance after the events.
    plan
        The new plan (validated against ``instance``).
    choice
        ``"local"``, ``"swap"`` or ``"global"``: which plan was kept.
    moved
        GPUs that migrate (see :func:`migration`).
    goodput, relative_goodput
        Of ``plan``, recomputed by the validator.
    bound
        Proven upper bound on the goodput of any plan for ``instance``:
        :func:`ntp_opt.planners.bounds.stage.stage_bound` (``bound_kind``
        is ``"computed"``), or, re-planning from a :class:`PlanState` that
        carries the multipliers of an earlier full bound, the dual at them
        (:func:`~ntp_opt.planners.bounds.stage.stage_bound_at`:
        ``"incremental"``; valid, used only when it settles the choice,
        which makes it at most ``1 / (1 - tolerance)`` times the full bound,
        and the choice the full bound's up to the bisection's resolution);
        ``inf`` (the
        trivial bound, ``"skipped"``) when it was not computed
        (``bound=False``, or a :class:`Replanner` in ``"local"`` mode).
    local_goodput, global_goodput
        The two candidates (``global_goodput`` is ``None`` when it was not
        needed).
    global_moved
        Migration of the global plan, when computed.
    runtime_s
        Wall-clock seconds, events applied included.
    details
        Goodput and migration of every plan tried, by name.
    bound_kind
        ``"computed"``, ``"incremental"`` or ``"skipped"`` (see ``bound``).
    state
        The new plan's :class:`PlanState` (to re-plan the next event
        without re-checking it: :class:`Replanner`).
    """

    instance: Instance
    plan: Plan
    choice: str
    moved: int
    goodput: float
    relative_goodput: float
    bound: float
    local_goodput: float
    global_goodput: float | None
    global_moved: int | None
    runtime_s: float
    details: dict[str, Any] = field(default_factory=dict)
    bound_kind: str = "computed"
    state: PlanState | None = field(default=None, compare=False, repr=False)

    @property
    def gap(self) -> float:
        """``(bound - goodput) / bound`` (0 when the bound is 0 or was not computed)."""
        if self.bound <= 0 or not math.isfinite(self.bound):
            return 0.0
        return max(0.0, (self.bound - self.goodput) / self.bound)


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
    instance, plan = state.instance, state.plan
    new_inst = _apply(state.base or instance, evs, state.trays)
    a = instance.arrays
    failed_now = a.healthy & ~new_inst.arrays.healthy
    changed = (a.healthy != new_inst.arrays.healthy) | (a.speed != new_inst.arrays.speed)
    local, local_lay = recourse_layout(new_inst, plan, state.layout, failed_now, state.memo)
    local_ev = None
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
                (local, local_lay), local_ev = boosted, ev
    if local_ev is None:
        local_ev = _evaluate(new_inst, local, local_lay, check_mode, state.memo)
        if not local_ev.feasible:
            raise PlanError(list(local_ev.violations))
    bound, points, rows, bound_kind = math.inf, state.points, None, "skipped"
    fixed: FixedSpeeds | None = state.fixed
    if want_bound and points is not None and state.rows is not None:
        # the incremental bound: the dual at the last full bound's multipliers
        # (valid for any multipliers); enough whenever it settles the choice
        touched_d = sorted({int(a.gpu_domain[i]) for i in np.flatnonzero(changed)})
        rows = domain_rows_after(new_inst, state.rows, touched_d)
        fixed = {} if state.fixed is not None else None
        bound = stage_bound_at(new_inst, points, rows, state.fixed, fixed)
        bound_kind = "incremental"
        if mode == "auto" and local_ev.goodput < bound * (1 - tolerance):
            # undecided: the swap plan is made first; the incremental bound may
            # settle the choice with it, else the full bound decides (below)
            bound_kind = "pending"

    def full_bound() -> None:
        nonlocal rows, fixed, bound, points, bound_kind
        rows = domain_rows(new_inst) if rows is None else rows
        fixed = {} if new_inst.job.batch_policy == "fixed" else None
        (bound, points), bound_kind = stage_bound_point(new_inst, rows, fixed), "computed"

    if want_bound and bound_kind == "skipped":
        full_bound()
    before = state.assignment
    healthy = new_inst.arrays.healthy

    def moved_by(p: Plan, lay: Layout | None = None) -> int:
        lay = Layout.from_plan(new_inst, p) if lay is None else lay
        return int(((lay.assignment(a.n_gpus) != before) & healthy).sum())

    options: dict[str, tuple[Plan, float, int]] = {
        "local": (local, local_ev.goodput, moved_by(local, local_lay))
    }
    evals = {"local": local_ev}
    layouts: dict[str, Layout] = {}  # of the other options, where known

    def settled() -> bool:
        best = max(v for _, v, _ in options.values())
        return mode == "auto" and best >= bound * (1 - tolerance)

    if mode != "local" and not settled():
        touched = {
            int(a.gpu_domain[i])
            for e in evs
            for node in e.nodes
            for i in _gpus_of(instance, node, state.trays)
        }
        # the replicas with a stage in a touched domain (read from the local layout)
        hit = np.isin(local_lay.domain, np.fromiter(touched, dtype=np.int64, count=len(touched)))
        focus = set(local_lay.replica[hit].tolist())
        got = improve_layout(new_inst, local, focus, layout=None if legacy else local_lay)
        better, better_lay = (None, None) if got is None else got
        if better is not None and legacy:  # as before issue 30 (tests compare)
            better = reboost(new_inst, better)
            ev = evaluate(new_inst, better)
            if ev.feasible:
                evals["swap"] = ev
                options["swap"] = (
                    better.with_metrics(**ev.as_metrics()),
                    ev.goodput,
                    moved_by(better),
                )
        elif better is not None:
            # :func:`reboost` on one layout, checked once in index space (the
            # validator's figures; ``check="full"`` adds the validator): the
            # boosted plan when it passes, else the plan as improved
            assert better_lay is not None
            swap, swap_lay = better, better_lay
            got = (
                reboost_layout(new_inst, swap, swap_lay, None, state.memo)
                if swap.replicas
                else None
            )
            boost_ev = None if got is None else _evaluate(new_inst, *got, check_mode, state.memo)
            if got is not None and boost_ev is not None and boost_ev.feasible:
                (swap, swap_lay), ev = got, boost_ev
            else:
                ev = _evaluate(new_inst, swap, swap_lay, check_mode, state.memo)
            if ev.feasible:
                evals["swap"] = ev
                layouts["swap"] = swap_lay
                options["swap"] = (
                    swap.with_metrics(**ev.as_metrics()),
                    ev.goodput,
                    moved_by(swap, swap_lay),
                )
    if bound_kind == "pending":
        if settled() and _choose(options, tolerance) == "local":
            # the incremental bound settles it: the full bound would too (it is
            # at most the incremental one, up to its bisection's resolution),
            # and whether it settled the local plan alone or with the swap
            # plan, the local plan is kept
            bound_kind = "incremental"
        else:  # the full bound decides, as without a state
            full_bound()
            if "swap" in options and local_ev.goodput >= bound * (1 - tolerance):
                # the full bound settles the local plan alone: no swap plan is made
                for kept in (options, evals, layouts):
                    kept.pop("swap", None)
    if mode == "global" or (mode == "auto" and not settled()):
        from ntp_opt.planners.fast import plan_fast

        # checked once, after alignment (which changes no figure); the bound
        # is the one above
        fresh, _ = plan_fast(new_inst, validate=False, bound=False)
        fresh, fresh_lay = _aligned(new_inst, plan, fresh, before, None)
        fresh_ev = check(new_inst, fresh)
        evals["global"] = fresh_ev
        layouts["global"] = fresh_lay
        options["global"] = (
            fresh.with_metrics(**fresh_ev.as_metrics()),
            fresh_ev.goodput,
            moved_by(fresh, fresh_lay),
        )
    if mode == "global":
        choice = "global"
    else:
        choice = _choose(options, tolerance)
    chosen, value, moved = options[choice]
    if value > bound * (1 + BOUND_TOL):  # a bug, never hidden
        raise RuntimeError(f"re-planned goodput {value} above the bound {bound}")
    ev = evals[choice]  # the chosen plan was checked above; only its metrics change
    extra: dict[str, Any] = {"bound": bound} if want_bound else {}
    chosen = chosen.with_metrics(**ev.as_metrics(), policy=f"replan-{choice}", moved=moved, **extra)
    if choice == "local":
        lay = Layout(**{**local_lay.__dict__, "metrics": dict(chosen.metrics)})
    elif choice in layouts:
        lay = Layout(**{**layouts[choice].__dict__, "metrics": dict(chosen.metrics)})
    else:
        lay = Layout.from_plan(new_inst, chosen)
    logger.info(
        "replan: kept the %s plan, %d GPUs move, goodput %.9g (bound %.9g)",
        choice,
        moved,
        ev.goodput,
        bound,
    )
    global_value = options["global"][1] if "global" in options else None
    global_moved = options["global"][2] if "global" in options else None
    details: dict[str, Any] = {
        name: {"goodput": v, "moved": m} for name, (_, v, m) in options.items()
    }
    return Replanned(
        instance=new_inst,
        plan=chosen,
        choice=choice,
        moved=moved,
        goodput=ev.goodput,
        relative_goodput=ev.relative_goodput,
        bound=bound,
        local_goodput=local_ev.goodput,
        global_goodput=global_value,
        global_moved=global_moved,
        runtime_s=time.perf_counter() - start,
        details=details,
        bound_kind=bound_kind,
        state=PlanState(
            new_inst, chosen, lay, ev, points, rows, fixed, trays=state.trays, memo=state.memo
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
        What happened since (see :func:`apply_events`).
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
        _as_events(events),
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
            _as_events(events),
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
