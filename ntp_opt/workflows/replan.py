"""Re-planning after events: a near-optimal plan that moves few GPUs.

:func:`replan` takes the instance a plan was made for, the plan, and what
happened since (GPU or tray failures, repairs, speed changes), and returns
the new instance and a validated plan for it, with the number of GPUs that
migrate. Up to three plans are compared:

* **local**: the running plan after the deterministic recourse of
  :func:`ntp_opt.recourse.adapt` (failed GPUs replaced from in-domain spares,
  degrees reduced, batches re-split), with its power boosts redone by
  :func:`reboost` when recourse reset them or speeds changed. It moves only
  the GPUs the events force to move.
* **swap**: the local plan improved by a few stage swaps around the replicas
  the events touched (:func:`ntp_opt.swaps.improve`): a damaged domain joins
  an already reduced replica, a spare domain comes in, a repaired replica
  returns to a higher degree. Each swap moves about two stages.
* **global**: the :func:`ntp_opt.fast.plan_fast` plan of the new instance,
  with its replicas and stages renumbered to overlap the running plan as
  much as possible (:func:`align`).

They are tried in that order, each only while the best so far is more than
``tolerance`` (default 0.1 %) below the proven bound
:func:`ntp_opt.milp.bounds.stage_bound`. Among the plans tried, the one moving
the fewest GPUs within ``tolerance`` of the best goodput is kept.

Migration counts the GPUs, healthy after the events, whose assignment
(replica index, stage index, or unused) differs between the running plan and
the new one; GPUs that failed are not counted.

The new instance shares the old one's (frozen) graph structure and only
copies the attributes of the GPUs that changed, so re-planning a 32k-GPU
cluster does not copy its graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import SLOT, Layout
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.planners.exact.bounds import stage_bound
from ntp_opt.planners.swaps import improve
from ntp_opt.rules.recourse import adapt_indices
from ntp_opt.rules.tolerances import BOUND_TOL, FLOAT_NOISE
from ntp_opt.rules.validate import check, evaluate

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
        The new speed, in (0, 1], for ``"speed"`` events only.
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
            if self.speed is None or not (0.0 < float(self.speed) <= 1.0):
                raise ValueError(f"a speed event needs speed in (0, 1], got {self.speed!r}")
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
        elif hasattr(e, "kind") and hasattr(e, "gpu_ids"):  # ntp_opt.simulate.Event
            out.append(ClusterEvent(e.kind, tuple(e.gpu_ids)))
        else:
            raise TypeError(f"not an event: {e!r}")
    return out


def _gpus_of(instance: Instance, node: Hashable) -> list[int]:
    a = instance.arrays
    if node in a.gpu_index:
        return [a.gpu_index[node]]
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
        :class:`ntp_opt.simulate.Event` objects, applied in order.

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
    a = instance.arrays
    healthy = a.healthy.copy()
    speed = a.speed.copy()
    for e in _as_events(events):
        for node in e.nodes:
            for i in _gpus_of(instance, node):
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


def align(instance: Instance, old: Plan, new: Plan) -> Plan:
    """Renumber ``new``'s replicas and stages to overlap ``old`` as much as possible.

    Greedy matching on shared GPUs: replica pairs with the most GPUs in
    common first; within a matched pair, stages keep the position of the old
    stage they share most GPUs with. Goodput does not change (replica and
    stage order carry no meaning in the model).
    """
    a = instance.arrays
    before = assignment(instance, old)
    index = a.gpu_index
    pairs: list[tuple[int, int, int]] = []  # (-shared, new r, old r)
    for r, rep in enumerate(new.replicas):
        idx = np.array([index[g] for g in rep.gpus()], dtype=np.int64)
        olds = before[idx]
        olds = olds[olds >= 0] // SLOT
        if len(olds):
            ids, counts = np.unique(olds, return_counts=True)
            pairs.extend((-int(c), r, int(o)) for o, c in zip(ids, counts, strict=True))
    pairs.sort()
    slot_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, r, o in pairs:
        if r not in slot_of and o not in taken:
            slot_of[r] = o
            taken.add(o)
    n = max(len(new.replicas), len(old.replicas))
    free = iter(i for i in range(n) if i not in taken)
    for r in range(len(new.replicas)):
        if r not in slot_of:
            slot_of[r] = next(free)
    # a plan is a list: fill gaps (old replicas with no successor) by compacting
    order = sorted(range(len(new.replicas)), key=lambda r: slot_of[r])
    reps: list[Replica] = []
    for r in order:
        rep = new.replicas[r]
        target = slot_of[r]
        if target < len(old.replicas):
            old_stages = old.replicas[target].stages
            score: list[tuple[int, int, int]] = []
            for k, st in enumerate(rep.stages):
                mine = set(st.gpus)
                for j, ost in enumerate(old_stages):
                    shared = len(mine.intersection(ost.gpus))
                    if shared:
                        score.append((-shared, k, j))
            score.sort()
            pos: dict[int, int] = {}
            used: set[int] = set()
            for _, k, j in score:
                if k not in pos and j not in used:
                    pos[k] = j
                    used.add(j)
            rest = iter(j for j in range(len(rep.stages)) if j not in used)
            for k in range(len(rep.stages)):
                if k not in pos:
                    pos[k] = next(rest)
            stages = [rep.stages[k] for k in sorted(range(len(rep.stages)), key=pos.__getitem__)]
            rep = Replica(tp=rep.tp, local_batch=rep.local_batch, stages=tuple(stages))
        reps.append(rep)
    return Plan(new.instance, tuple(reps), dict(new.metrics))


def reboost(instance: Instance, plan: Plan, *, validate: bool = True) -> Plan:
    """The same replicas and GPUs with the best power boost and batch split.

    Tries the plan's own multipliers, :func:`ntp_opt.baselines.boost_slowest` and
    :func:`ntp_opt.fast.boost_floor`; keeps the best (checked by the validator
    unless ``validate=False``, for a caller that checks it). No GPU moves.
    Used after recourse, whose power rule (every boost of an over-budget rack
    or site back to 1) is blunt: a repaired GPU's idle draw alone can trigger
    it.
    """
    from ntp_opt.planners.fast import boost_floor
    from ntp_opt.planners.heuristics import Slot, boost_slowest, split_groups
    from ntp_opt.rules.power import can_boost

    a = instance.arrays
    if not plan.replicas or not can_boost(instance):
        return plan
    index = a.gpu_index
    groups = [
        (
            rep.tp,
            [
                Slot(a.domain_index[st.domain], np.array([index[g] for g in st.gpus]), rep.tp)
                for st in rep.stages
            ],
        )
        for rep in plan.replicas
    ]

    def split_for(powers: list[list[float]]) -> tuple[float, tuple[int, ...]] | None:
        split = split_groups(instance, groups, powers)
        return None if split is None else (split.goodput, split.batches)

    keep = split_for([[st.power for st in rep.stages] for rep in plan.replicas])
    value = -1.0 if keep is None else keep[0]
    best: tuple[float, list[list[float]], tuple[int, ...]] | None = None
    for powers in (boost_slowest(instance, groups), boost_floor(instance, groups)):
        got = split_for(powers)
        if (
            got is not None
            and got[0] > value * (1 + FLOAT_NOISE)
            and (best is None or got[0] > best[0])
        ):
            best = (got[0], powers, got[1])
    if best is None:
        return plan
    _, powers, batches = best
    reps = tuple(
        Replica(
            tp=rep.tp,
            local_batch=b,
            stages=tuple(
                Stage(st.domain, st.gpus, float(pw)) for st, pw in zip(rep.stages, p, strict=True)
            ),
        )
        for rep, p, b in zip(plan.replicas, powers, batches, strict=True)
        if b > 0
    )
    cand = Plan(plan.instance, reps, {"policy": "reboost"})
    if not validate:
        return cand  # the caller checks it
    return cand if evaluate(instance, cand).feasible else plan  # one check, of the winner


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
        Proven upper bound on the goodput of any plan for ``instance``.
    local_goodput, global_goodput
        The two candidates (``global_goodput`` is ``None`` when it was not
        needed).
    global_moved
        Migration of the global plan, when computed.
    runtime_s
        Wall-clock seconds, events applied included.
    details
        Goodput and migration of every plan tried, by name.
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

    @property
    def gap(self) -> float:
        """``(bound - goodput) / bound`` (0 when the bound is 0)."""
        return 0.0 if self.bound <= 0 else max(0.0, (self.bound - self.goodput) / self.bound)


def replan(
    instance: Instance,
    plan: Plan,
    events: Iterable[Any] = (),
    *,
    tolerance: float = 1e-3,
    mode: Literal["auto", "local", "global"] = "auto",
) -> Replanned:
    """Re-plan after ``events``, moving as few GPUs as the goodput allows.

    Parameters
    ----------
    instance
        The instance ``plan`` was made for.
    plan
        The running plan (feasible for ``instance``).
    events
        What happened since (see :func:`apply_events`).
    tolerance
        Relative goodput that may be given up to avoid migration (module
        docstring).
    mode
        ``"auto"`` (module docstring), ``"local"`` (recourse only) or
        ``"global"`` (always the aligned global plan).

    Returns
    -------
    Replanned
    """
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    if mode not in ("auto", "local", "global"):
        raise ValueError(f"mode must be auto, local or global, got {mode!r}")
    start = time.perf_counter()
    check(instance, plan)
    evs = _as_events(events)
    new_inst = apply_events(instance, evs)
    a = instance.arrays
    failed_now = a.healthy & ~new_inst.arrays.healthy
    layout = Layout.from_plan(instance, plan)
    local = adapt_indices(new_inst, plan, failed_now, layout)
    local_ev = None
    if local.metrics.get("reduced_power") or any(e.kind == "speed" for e in evs):
        # recourse reset boosts, or speeds changed: redo the boosts
        boosted = reboost(new_inst, local, validate=False)
        if boosted is not local:
            ev = evaluate(new_inst, boosted)
            if ev.feasible:
                local, local_ev = boosted, ev
    if local_ev is None:
        local_ev = check(new_inst, local)
    bound = stage_bound(new_inst)
    before = layout.assignment(a.n_gpus)
    healthy = new_inst.arrays.healthy

    def moved_by(p: Plan) -> int:
        return int(((assignment(new_inst, p) != before) & healthy).sum())

    options: dict[str, tuple[Plan, float, int]] = {
        "local": (local, local_ev.goodput, moved_by(local))
    }
    evals = {"local": local_ev}

    def settled() -> bool:
        best = max(v for _, v, _ in options.values())
        return mode == "auto" and best >= bound * (1 - tolerance)

    if mode != "local" and not settled():
        touched = {
            int(a.gpu_domain[i]) for e in evs for node in e.nodes for i in _gpus_of(instance, node)
        }
        focus = {
            r
            for r, rep in enumerate(local.replicas)
            if any(a.domain_index[st.domain] in touched for st in rep.stages)
        }
        better = improve(new_inst, local, focus)
        if better is not None:
            better = reboost(new_inst, better)
            ev = evaluate(new_inst, better)
            if ev.feasible:
                evals["swap"] = ev
                options["swap"] = (
                    better.with_metrics(**ev.as_metrics()),
                    ev.goodput,
                    moved_by(better),
                )
    if mode == "global" or (mode == "auto" and not settled()):
        from ntp_opt.planners.fast import plan_fast

        fresh, _ = plan_fast(new_inst)
        fresh = align(new_inst, plan, fresh)
        fresh_ev = check(new_inst, fresh)
        evals["global"] = fresh_ev
        options["global"] = (
            fresh.with_metrics(**fresh_ev.as_metrics()),
            fresh_ev.goodput,
            moved_by(fresh),
        )
    if mode == "global":
        choice = "global"
    else:  # fewest moves among the plans within tolerance of the best
        top = max(v for _, v, _ in options.values())
        choice = min(
            (name for name, (_, v, _) in options.items() if v >= top * (1 - tolerance)),
            key=lambda name: (options[name][2], -options[name][1]),
        )
    chosen, value, moved = options[choice]
    if value > bound * (1 + BOUND_TOL):  # a bug, never hidden
        raise RuntimeError(f"re-planned goodput {value} above the bound {bound}")
    ev = evals[choice]  # the chosen plan was checked above; only its metrics change
    chosen = chosen.with_metrics(
        **ev.as_metrics(), policy=f"replan-{choice}", moved=moved, bound=bound
    )
    logger.info(
        "replan: kept the %s plan, %d GPUs move, goodput %.9g (bound %.9g)",
        choice,
        moved,
        ev.goodput,
        bound,
    )
    global_value = options["global"][1] if "global" in options else None
    global_moved = options["global"][2] if "global" in options else None
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
        details={name: {"goodput": v, "moved": m} for name, (_, v, m) in options.items()},
    )
