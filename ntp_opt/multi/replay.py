"""Fleets that follow demand: re-plan from the running plan, with migration cost and hysteresis.

:func:`replan_multi` is the incremental re-planner. From the running
:class:`~ntp_opt.multi.workloads.MultiPlan` and the new demand (and health) it
builds a few *training options* (keep the training plan, repaired in place
when a GPU under it failed; every replica at each allowed TP degree; one or
two replicas fewer when the batch policy allows it) and, for each, fills the
serving fleets greedily by marginal weighted goodput per GPU:

* a fleet short of its demand *wants* replicas (its most GPU-efficient degree
  among those :meth:`~ntp_opt.multi.workloads.ServingWorkload.usable` on the
  fastest GPUs: at least ``min_tp``, meeting the latency target; a smaller one
  for the last bit of demand), each worth ``w_i r / D_i`` less the start cost; a
  fleet below its minimum share wants them first;
* every running replica has a *price*: what stopping it loses (nothing for
  capacity above its fleet's demand, ``w_j r / D_j`` otherwise) plus the stop cost;
* wants, best gain per GPU first, go to the NVLink domain where opening their
  degree's GPUs is cheapest (free GPUs first, then the cheapest replicas), if the
  gain exceeds that price; when no domain opens cheaply enough, replicas of
  smaller degree of other fleets move into free fragments of other domains at
  their start and stop cost (compaction);
* a replica whose latency target some healthy GPU misses goes only where the
  fastest free GPUs meet it (:func:`_open_fast`), and compaction does not move
  it; a running replica that no longer counts (late after a speed change, or
  below ``min_tp``) is stopped, which forces a re-plan.

Each option is scored ``W - migration cost / horizon_s`` (:class:`MigrationCost`);
the best one replaces the running plan only when it beats keeping the plan by
``margin`` (:class:`ReplayOptions`), and no option is even built while every
fleet's demand stays within ``deadband`` of the demand of the last re-plan, the
plan has lost at most ``tolerance`` of its weighted goodput, and no health event
touched the plan (hysteresis). The chosen plan is validated by
:func:`~ntp_opt.multi.validate.evaluate_multi`: a broken rule other than a minimum
share (which demand above the cluster's capacity may force) is a bug and raises.

:func:`replay` runs a :class:`~ntp_opt.multi.demand.DemandTrace` with this
re-planner and with two baselines, the static partition
(:func:`~ntp_opt.multi.static.solve_static`, sized for each fleet's peak demand)
and :func:`~ntp_opt.multi.milp.solve_multi` from scratch at every step, and
reports per step what ``ntp-opt/replay@1`` holds (``docs/workloads.md``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ntp_opt.model.files import InputError, write_json
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.multi.demand import DemandTrace
from ntp_opt.multi.milp import solve_multi
from ntp_opt.multi.static import solve_static
from ntp_opt.multi.validate import MultiEvaluation, evaluate_multi
from ntp_opt.multi.workloads import MultiInstance, MultiPlan, ServingReplica, Workloads
from ntp_opt.rules.goodput import relative_goodput, replica_speed, split_batch
from ntp_opt.workflows.events import apply_events

REPLAY_FORMAT = "ntp-opt/replay@1"
#: Weight of a fleet's served share below its ``min_fraction`` (and of a missing
#: ``min_replicas`` replica) in the re-planner's greedy: minimum shares come first.
PRIORITY = 1000.0
#: Planners of :func:`replay`, in report order.
PLANNERS: tuple[str, ...] = ("replay", "static", "resolve")


@dataclass(frozen=True)
class MigrationCost:
    """What moving work costs, as lost requests or lost training time.

    A cost in weighted-goodput-seconds is spread over ``horizon_s``, the time
    the new plan is expected to run, so that it compares with the weighted
    goodput ``W`` (a rate) of the plans.

    Attributes
    ----------
    serving_start_s
        A started replica serves nothing for this long (weights loaded from
        local storage, engine and CUDA-graph warm-up: tens of seconds to
        minutes for a model of tens of GB). Default 120.
    serving_stop_s
        A stopped replica's in-flight requests are drained or retried: its
        throughput is lost for this long. Default 30.
    training_restart_s
        Any change of the training job's GPUs stops the whole job (synchronous
        data parallelism): it restarts from its last checkpoint and recomputes
        the steps since then. Default 600 (restart plus half of a 10-15 minute
        checkpoint interval).
    horizon_s
        Time over which a move pays off: about the interval between demand
        changes worth acting on. Default 3600.
    """

    serving_start_s: float = 120.0
    serving_stop_s: float = 30.0
    training_restart_s: float = 600.0
    horizon_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("serving_start_s", "serving_stop_s", "training_restart_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: {v!r} must be a finite number >= 0")
        if not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ValueError(f"horizon_s: {self.horizon_s!r} must be a positive number")


@dataclass(frozen=True)
class ReplayOptions:
    """Migration cost and hysteresis of the re-planner.

    Attributes
    ----------
    cost
        :class:`MigrationCost`.
    deadband
        No re-plan while every fleet's demand is within this relative change of
        its demand at the last re-plan, the plan's weighted goodput has not
        dropped by more than ``tolerance`` since, and no health event hit the
        plan. Default 0.05: request rates measured over minutes carry a few per
        cent of noise.
    tolerance
        Weighted goodput the running plan may lose to demand changes inside the
        deadband before a re-plan is considered. Default 0.01 (a fleet of weight 1
        served 1 % short).
    margin
        A new plan must beat keeping the running one by this much weighted
        goodput, after its migration cost. Default 0.002 (0.05 % of the 4.5 of
        the benchmark's workloads).
    migration
        ``False``: no migration cost and no hysteresis (an ablation).
    """

    cost: MigrationCost = field(default_factory=MigrationCost)
    deadband: float = 0.05
    tolerance: float = 0.01
    margin: float = 0.002
    migration: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.deadband) and self.deadband >= 0):
            raise ValueError(f"deadband: {self.deadband!r} must be a finite number >= 0")
        for name in ("margin", "tolerance"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: {v!r} must be a finite number >= 0")


@dataclass(frozen=True)
class Decision:
    """Outcome of :func:`replan_multi`.

    Attributes
    ----------
    plan
        The plan to run (validated), with the validator's figures as metrics.
    evaluation
        Its :class:`~ntp_opt.multi.validate.MultiEvaluation`.
    replanned
        Whether it differs from the running plan.
    reason
        ``"deadband"`` (demand inside the deadband: no option built), ``"margin"``
        (no option beat the running plan by the margin after its migration cost),
        ``"replanned"`` or ``"forced"`` (a health event or a broken minimum share).
    option
        The training option chosen.
    """

    plan: MultiPlan
    evaluation: MultiEvaluation
    replanned: bool
    reason: str
    option: str


# ---------------------------------------------------------------- helpers


def with_demand(multi: MultiInstance, demand: Mapping[str, float]) -> MultiInstance:
    """``multi`` with the fleets' demand replaced by ``demand`` (fleets not named keep theirs)."""
    fleets = tuple(
        s.model_copy(update={"demand": float(demand.get(s.name, s.demand))})
        for s in multi.workloads.serving
    )
    wl = multi.workloads.model_copy(update={"serving": fleets})
    return MultiInstance(multi.instance, Workloads.model_validate(wl.model_dump()))


def gpu_owners(plan: MultiPlan) -> dict[Hashable, Hashable]:
    """Owner of each used GPU: ``"training"`` or ``(fleet, replica GPUs)``."""
    out: dict[Hashable, Hashable] = {g: "training" for g in plan.training.used_gpus()}
    for rep in plan.serving:
        for g in rep.gpus:
            out[g] = (rep.workload, rep.gpus)
    return out


@dataclass(frozen=True)
class Moves:
    """What changed between two plans (GPUs that failed in between are not counted).

    Attributes
    ----------
    gpus
        GPUs whose owner changed (training, a serving replica, or idle).
    training_gpus
        Those of them that left or joined training.
    started, stopped
        Serving replicas started and stopped.
    """

    gpus: int
    training_gpus: int
    started: int
    stopped: int


def moves(before: MultiPlan | None, after: MultiPlan, instance: Instance) -> Moves:
    """:class:`Moves` from ``before`` to ``after`` (``None``: nothing ran)."""
    if before is None:
        return Moves(0, 0, 0, 0)
    a = instance.arrays
    old, new = gpu_owners(before), gpu_owners(after)
    healthy = {g for g in (*old, *new) if g in a.gpu_index and a.healthy[a.gpu_index[g]]}
    changed = [g for g in healthy if old.get(g) != new.get(g)]
    training = sum(1 for g in changed if "training" in (old.get(g), new.get(g)))
    old_reps = {(r.workload, r.gpus) for r in before.serving}
    new_reps = {(r.workload, r.gpus) for r in after.serving}
    return Moves(len(changed), training, len(new_reps - old_reps), len(old_reps - new_reps))


def migration_loss(
    multi: MultiInstance,
    before: MultiPlan | None,
    after: MultiPlan,
    relative: float,
    cost: MigrationCost,
) -> float:
    """Weighted-goodput-seconds lost moving from ``before`` to ``after`` under ``cost``
    (the same charge for every planner of :func:`replay`): each serving replica started
    or stopped (but not one a failure stopped) loses its share of its fleet's demand for
    ``serving_start_s`` or ``serving_stop_s``; a change of training's GPUs or degrees
    loses ``training_restart_s`` of the training job at its new relative goodput
    ``relative``."""
    if before is None:
        return 0.0
    a = multi.instance.arrays
    fleets = multi.workloads.by_name()

    def share(rep: ServingReplica) -> float:
        f = fleets.get(rep.workload)
        idx = [a.gpu_index[g] for g in rep.gpus if g in a.gpu_index]
        speed = float(a.speed[idx].min()) if idx else 0.0
        if f is None or not idx or not f.usable(rep.tp, speed):
            return 0.0  # a replica that cannot count serves nothing to lose
        return f.weight * min(f.rate(rep.tp, speed), f.demand) / f.demand

    old = {(r.workload, r.gpus): r for r in before.serving}
    new = {(r.workload, r.gpus): r for r in after.serving}
    lost = sum(share(r) for k, r in new.items() if k not in old) * cost.serving_start_s
    dead = {g for g in a.gpu_index if not a.healthy[a.gpu_index[g]]}
    lost += (
        sum(share(r) for k, r in old.items() if k not in new and not dead.intersection(r.gpus))
        * cost.serving_stop_s
    )
    same = set(before.training.used_gpus()) == set(after.training.used_gpus()) and _tps(
        before
    ) == _tps(after)
    if not same:
        lost += multi.workloads.training_weight * relative * cost.training_restart_s
    return lost


# ---------------------------------------------------------------- the re-planner


@dataclass
class _Rep:
    fleet: int
    tp: int
    domain: int
    gpus: tuple[int, ...]
    rate: float
    new: bool


@dataclass
class _Option:
    name: str
    replicas: list[tuple[int, list[tuple[int, list[int]]]]]  # (tp, [(domain, GPU indices)])
    batches: tuple[int, ...]
    train_gpus: np.ndarray  # bool per GPU
    relative: float
    changed: bool
    broken: bool = False  # the running training plan lost a GPU


@dataclass
class _Filled:
    option: _Option
    reps: list[_Rep]
    score: float
    value: float
    min_ok: bool
    changed: bool  # differs from the running plan


class _Ctx:
    """Arrays of one re-planning decision."""

    def __init__(self, multi: MultiInstance, opts: ReplayOptions) -> None:
        inst = multi.instance
        self.multi = multi
        self.a = inst.arrays
        self.job = inst.job
        self.fleets = multi.workloads.serving
        self.w_t = multi.workloads.training_weight
        cost = opts.cost if opts.migration else MigrationCost(0.0, 0.0, 0.0, 1.0)
        self.cost = cost
        self.demand = np.array([f.demand for f in self.fleets], dtype=float)
        self.weight = np.array([f.weight for f in self.fleets], dtype=float)
        a = self.a
        self.speed = np.asarray(a.speed, dtype=float)
        self.healthy = np.asarray(a.healthy, dtype=bool)
        self.gpu_domain = np.asarray(a.gpu_domain)
        # domain members, fastest first
        self.members = [m[np.argsort(-self.speed[m], kind="stable")] for m in a.domain_gpus]
        self.members_l: list[list[int]] = [m.tolist() for m in self.members]
        self.healthy_l: list[bool] = self.healthy.tolist()
        self.speed_l: list[float] = self.speed.tolist()
        up = self.speed[self.healthy]
        top = float(up.max()) if up.size else 1.0
        slow = float(up.min()) if up.size else 1.0
        # degrees a fleet's new replica may have: at least min_tp, meeting the latency
        # target on the fastest GPUs; ``strict``: those whose target some healthy GPU
        # misses (their GPUs are chosen by :func:`_open_fast`)
        self.degrees: list[tuple[int, ...]] = [
            tuple(t for t in f.fitting_degrees if f.usable(t, top)) for f in self.fleets
        ]
        self.strict: list[frozenset[int]] = [
            frozenset(t for t in ds if not f.usable(t, slow))
            for f, ds in zip(self.fleets, self.degrees, strict=True)
        ]

    def value_of(self, i: int, rate: float, have: float, count: int) -> float:
        """Weighted goodput (plus the minimum-share priority) ``rate`` adds to fleet ``i``
        that has throughput ``have`` and ``count`` replicas."""
        f = self.fleets[i]
        d = self.demand[i]
        gain = self.weight[i] * max(0.0, min(rate, d - have)) / d
        need = f.min_fraction * d
        gain += PRIORITY * max(0.0, min(rate, need - have)) / d
        if count < f.min_replicas:
            gain += PRIORITY
        return gain

    def start_cost(self, i: int, rate: float) -> float:
        d = self.demand[i]
        return self.weight[i] * min(rate, d) / d * self.cost.serving_start_s / self.cost.horizon_s

    def stop_cost(self, i: int, rate: float) -> float:
        d = self.demand[i]
        return self.weight[i] * min(rate, d) / d * self.cost.serving_stop_s / self.cost.horizon_s


def _training_split(
    ctx: _Ctx, replicas: list[tuple[int, list[tuple[int, list[int]]]]]
) -> tuple[tuple[int, ...], float] | None:
    """The exact batch split of ``replicas`` (``(tp, [(domain, GPU indices)])``) and its
    relative goodput; ``None`` when the batch cannot be split."""
    job = ctx.job
    if not replicas:
        return (), 0.0
    speeds = [
        replica_speed(job, t, [min(ctx.speed_l[g] for g in gs) for _, gs in sts], [1.0] * len(sts))
        for t, sts in replicas
    ]
    split = split_batch(job, speeds, [t for t, _ in replicas])
    if split is None:
        return None
    return tuple(int(b) for b in split.batches), relative_goodput(job, split.goodput)


def _training_plan(ctx: _Ctx, option: _Option) -> Plan:
    """The training :class:`~ntp_opt.model.plan.Plan` of ``option``."""
    a = ctx.a
    return Plan(
        ctx.multi.name,
        tuple(
            Replica(
                t,
                b,
                tuple(Stage(a.domain_ids[d], tuple(a.gpu_ids[x] for x in g), 1.0) for d, g in sts),
            )
            for (t, sts), b in zip(option.replicas, option.batches, strict=True)
        ),
        {"policy": "replay"},
    )


def _training_options(
    ctx: _Ctx, running: Plan, serving_gpus: np.ndarray, base_only: bool = False
) -> list[_Option]:
    """The training options (see the module doc); the first is the running plan, repaired
    (``base_only``: that one only)."""
    a, job = ctx.a, ctx.job
    idx = a.gpu_index
    cur: list[tuple[int, list[tuple[int, list[int]]]]] = []
    for rep in running.replicas:
        sts = [(int(a.domain_index[st.domain]), [idx[x] for x in st.gpus]) for st in rep.stages]
        cur.append((rep.tp, sts))
    n = a.n_gpus
    used = np.zeros(n, dtype=bool)
    for _, sts in cur:
        for _, g in sts:
            used[g] = True
    allowed = sorted(job.allowed)
    healthy = ctx.healthy_l
    speed = ctx.speed_l
    serving = serving_gpus.tolist()

    def stage_at(d: int, own: list[int], t: int, taken: list[bool]) -> list[int] | None:
        """``t`` healthy GPUs of domain ``d``: the stage's own first, then free ones, then
        serving ones; fastest first."""
        pool = [g for g in own if healthy[g]]
        if len(pool) < t:
            mine = set(pool)
            for pref in (False, True):
                for g in ctx.members_l[d]:
                    if len(pool) >= t:
                        break
                    if g in mine or not healthy[g] or taken[g] or serving[g] != pref:
                        continue
                    pool.append(g)
                    mine.add(g)
            if len(pool) < t:
                return None
        if len(pool) == t:
            return pool
        return sorted(pool, key=lambda g: -speed[g])[:t]

    def build(name: str, want: Callable[[int], int | None], drop: int = 0) -> _Option | None:
        taken = used.tolist()
        out: list[tuple[int, list[tuple[int, list[int]]]]] = []
        broken = False
        order = list(range(len(cur)))
        if drop:
            order = sorted(order, key=lambda r: _slowest(ctx, cur[r]))[drop:]
            order.sort()
        for r in order:
            t0, sts = cur[r]
            if not all(healthy[g] for _, gs in sts for g in gs):
                broken = True
            t = want(t0)
            if t is None:
                continue
            # largest allowed degree <= t that every stage can hold in its domain
            done = None
            for tt in [x for x in reversed(allowed) if x <= t]:
                got = []
                for d, g in sts:
                    st = stage_at(d, g, tt, taken)
                    if st is None:
                        break
                    got.append((d, st))
                else:
                    done = (tt, got)
                    break
            if done is None:
                continue
            for _, old in sts:
                for x in old:
                    taken[x] = False
            for _, new in done[1]:
                for x in new:
                    taken[x] = True
            out.append(done)
        made = _training_split(ctx, out)
        if made is None:
            return None
        batches, rel = made
        gpus = np.zeros(n, dtype=bool)
        for _, sts in out:
            for _, g in sts:
                gpus[g] = True
        same = bool(np.array_equal(gpus, used & ctx.healthy)) and [t for t, _ in out] == [
            t for t, _ in cur
        ]
        return _Option(name, out, batches, gpus, rel, changed=not same, broken=broken)

    options: list[_Option] = []
    base = build("keep", lambda t: t)
    if base is None:
        base = _Option("pause", [], (), np.zeros(n, bool), 0.0, True)
    options.append(base)
    if ctx.w_t > 0 and not base_only:
        for t in allowed:
            got = build(f"tp{t}", _const(t))
            if got is not None:
                options.append(got)
        for k in (1, 2):
            if len(cur) > k:
                got = build(f"drop{k}", lambda t: t, drop=k)
                if got is not None:
                    options.append(got)
    return options


def _const(t: int) -> Callable[[int], int | None]:
    """The degree ``t`` whatever a replica's degree was."""
    return lambda _old: t


def _slowest(ctx: _Ctx, rep: tuple[int, list[tuple[int, list[int]]]]) -> float:
    _, sts = rep
    return min((ctx.speed_l[g] for _, gs in sts for g in gs), default=0.0)


def _fill(ctx: _Ctx, option: _Option, kept: list[_Rep]) -> _Filled:
    """Serving replicas for ``option``: ``kept`` (minus those on its training GPUs) and the
    greedy additions of the module doc; scored ``W - cost / horizon``."""
    a = ctx.a
    nf = len(ctx.fleets)
    busy = option.train_gpus.copy() | ~ctx.healthy
    reps: list[_Rep] = []
    cost = 0.0
    hit = _conflicts(kept, busy)
    for r, bad in zip(kept, hit, strict=True):
        if bad:
            cost += ctx.stop_cost(r.fleet, r.rate)  # evicted by training
            continue
        busy[list(r.gpus)] = True
        reps.append(r)
    if option.changed:
        cost += ctx.w_t * option.relative * ctx.cost.training_restart_s / ctx.cost.horizon_s
    free_cnt = np.bincount(ctx.gpu_domain[~busy], minlength=a.n_domains)
    chain = sorted({t for f in ctx.fleets for t in f.degrees})
    col = {t: j for j, t in enumerate(chain)}
    stopped: set[int] = set()
    for _round in range(4):
        have = np.zeros(nf)
        count = np.zeros(nf, dtype=np.int64)
        for k, r in enumerate(reps):
            if k not in stopped:
                have[r.fleet] += r.rate
                count[r.fleet] += 1
        wants = _wants(ctx, have, count)
        if not wants:
            break
        # what stopping each running replica loses (its fleet's slowest replicas first)
        loss_of: dict[int, float] = {}
        by_fleet: dict[int, list[int]] = {}
        for k, r in enumerate(reps):
            if k not in stopped:
                by_fleet.setdefault(r.fleet, []).append(k)
        for i, ks in by_fleet.items():
            ks.sort(key=lambda k: reps[k].rate)
            h, c = float(have[i]), int(count[i])
            for k in ks:
                r = reps[k]
                loss = ctx.value_of(i, r.rate, h - r.rate, c - 1)
                loss += ctx.start_cost(i, r.rate) * -1.0 if r.new else ctx.stop_cost(i, r.rate)
                loss_of[k] = loss
                h -= r.rate
                c -= 1
        by_domain: dict[int, list[int]] = {}
        for k in loss_of:
            by_domain.setdefault(reps[k].domain, []).append(k)
        for ks in by_domain.values():
            ks.sort(key=lambda k: loss_of[k] / reps[k].tp)
        # price[d, j]: least loss that frees chain[j] GPUs in domain d (inf: cannot)
        price = np.full((a.n_domains, len(chain)), np.inf)

        for d in {*np.flatnonzero(free_cnt > 0).tolist(), *by_domain}:
            _reprice(d, chain, free_cnt, by_domain, loss_of, reps, price)
        placed = 0
        failed: dict[tuple[int, int], float] = {}  # (fleet, degree) -> gain compaction missed
        for i, t, gain in wants:
            j = col[t]
            if t in ctx.strict[i]:
                # a latency target some GPUs miss: a domain whose fastest free GPUs
                # (after evicting its cheapest replicas) meet it, or no replica
                if gain <= failed.get((i, t), -1.0):
                    continue
                opened = _open_fast(ctx, i, t, gain, price[:, j], busy, by_domain, loss_of, reps)
                if opened is None:
                    failed[(i, t)] = gain
                    continue
                d, victims = opened
                ks = by_domain.get(d, [])
                for _ in range(victims):
                    k = ks.pop(0)
                    stopped.add(k)
                    busy[list(reps[k].gpus)] = False
                    free_cnt[d] += reps[k].tp
                _place(ctx, reps, busy, free_cnt, i, t, d)
                placed += 1
                _reprice(d, chain, free_cnt, by_domain, loss_of, reps, price)
                continue
            d = int(np.argmin(price[:, j]))
            if not price[d, j] < gain:
                # no domain opens up cheaply enough: move small replicas of other fleets
                # from a domain into free fragments elsewhere, at start and stop cost
                if gain <= failed.get((i, t), -1.0):
                    continue  # wants come by gain: a smaller one fails as well
                moved = _compact(ctx, i, t, gain, reps, stopped, busy, free_cnt, by_domain)
                if moved is None:
                    failed[(i, t)] = gain
                    continue
                d, new = moved
                for k in new:
                    loss_of[k] = math.inf  # not evicted again this round
                    by_domain.setdefault(reps[k].domain, []).append(k)
                for dd in {d, *(reps[k].domain for k in new)}:
                    _reprice(dd, chain, free_cnt, by_domain, loss_of, reps, price)
            ks = by_domain.get(d, [])
            while free_cnt[d] < t:
                k = ks.pop(0)
                stopped.add(k)
                busy[list(reps[k].gpus)] = False
                free_cnt[d] += reps[k].tp
            _place(ctx, reps, busy, free_cnt, i, t, d)
            placed += 1
            _reprice(d, chain, free_cnt, by_domain, loss_of, reps, price)
        if not placed:
            break
    final = [r for k, r in enumerate(reps) if k not in stopped]
    for k in stopped:
        r = reps[k]
        if not r.new:
            cost += ctx.stop_cost(r.fleet, r.rate)
    have = np.zeros(nf)
    count = np.zeros(nf, dtype=np.int64)
    for r in final:
        have[r.fleet] += r.rate
        count[r.fleet] += 1
        if r.new:
            cost += ctx.start_cost(r.fleet, r.rate)
    served = np.minimum(1.0, have / ctx.demand) if nf else np.zeros(0)
    value = ctx.w_t * option.relative + float((ctx.weight * served).sum())
    min_ok = all(
        have[i] >= f.min_fraction * ctx.demand[i] * (1 - 1e-9) and count[i] >= f.min_replicas
        for i, f in enumerate(ctx.fleets)
    ) and option.relative >= ctx.multi.workloads.training_min_relative_goodput * (1 - 1e-9)
    changed = option.changed or len(final) != len(kept) or any(r.new for r in final)
    return _Filled(option, final, value - cost, value, min_ok, changed)


def _conflicts(reps: list[_Rep], busy: np.ndarray) -> list[bool]:
    """For each replica, whether one of its GPUs is ``busy``."""
    if not reps:
        return []
    flat = np.fromiter((g for r in reps for g in r.gpus), dtype=np.int64)
    owner = np.repeat(np.arange(len(reps)), [len(r.gpus) for r in reps])
    hits: list[bool] = (np.bincount(owner, weights=busy[flat], minlength=len(reps)) > 0).tolist()
    return hits


def _place(
    ctx: _Ctx, reps: list[_Rep], busy: np.ndarray, free_cnt: np.ndarray, i: int, t: int, d: int
) -> int:
    """Start a replica of fleet ``i``, degree ``t``, on the fastest free GPUs of domain ``d``."""
    m = ctx.members[d]
    gs = m[~busy[m]][:t]
    slowest = float(ctx.speed[gs].min()) if len(gs) == t else 0.0
    if len(gs) < t or not ctx.fleets[i].usable(t, slowest):
        raise RuntimeError(f"re-planner placed fleet {i} TP{t} where it cannot count (bug)")
    busy[gs] = True
    free_cnt[d] -= t
    rate = ctx.fleets[i].rate(t, slowest)
    reps.append(_Rep(i, t, d, tuple(int(x) for x in gs), rate, True))
    return len(reps) - 1


#: Domains :func:`_compact` tries per replica it must make room for.
COMPACT_TRIES = 8
#: Domains :func:`_open_fast` tries (cheapest first) per replica with a latency target.
OPEN_TRIES = 32


def _open_fast(
    ctx: _Ctx,
    i: int,
    t: int,
    gain: float,
    price: np.ndarray,
    busy: np.ndarray,
    by_domain: dict[int, list[int]],
    loss_of: dict[int, float],
    reps: list[_Rep],
) -> tuple[int, int] | None:
    """A domain where fleet ``i``'s replica of degree ``t`` meets its latency target on
    the ``t`` fastest free GPUs once the domain's cheapest replicas are evicted, for a
    loss below ``gain``: the domain and how many of its cheapest replicas to evict
    (``None``: no such domain among the :data:`OPEN_TRIES` cheapest)."""
    f = ctx.fleets[i]
    speed = ctx.speed_l
    order = np.argsort(price, kind="stable")[:OPEN_TRIES].tolist()
    for d in order:
        if not price[d] < gain:
            break
        free = [g for g in ctx.members_l[d] if not busy[g]]
        ks = by_domain.get(d, [])
        loss, p = 0.0, 0
        while loss < gain:
            if len(free) >= t:
                free.sort(key=lambda g: -speed[g])
                if f.usable(t, speed[free[t - 1]]):
                    return d, p
            if p == len(ks):
                break
            free.extend(reps[ks[p]].gpus)
            loss += loss_of[ks[p]]
            p += 1
    return None


def _compact(
    ctx: _Ctx,
    i: int,
    t: int,
    gain: float,
    reps: list[_Rep],
    stopped: set[int],
    busy: np.ndarray,
    free_cnt: np.ndarray,
    by_domain: dict[int, list[int]],
) -> tuple[int, list[int]] | None:
    """Open ``t`` free GPUs in one domain for fleet ``i`` by moving replicas of smaller
    degree (other fleets) into free GPUs of other domains, if their start and stop cost
    is below ``gain``; returns the domain and the moved replicas' new indices."""

    def mover(k: int) -> bool:
        # a replica whose latency target some GPU misses stays where it is
        r = reps[k]
        return r.tp < t and r.fleet != i and r.tp not in ctx.strict[r.fleet]

    room: dict[int, int] = {}
    for d, ks in by_domain.items():
        small = sum(reps[k].tp for k in ks if mover(k))
        if free_cnt[d] + small >= t and free_cnt[d] < t:
            room[d] = int(t - free_cnt[d])
    for d in sorted(room, key=lambda x: (room[x], x))[:COMPACT_TRIES]:
        movers = sorted(
            (k for k in by_domain[d] if mover(k)),
            key=lambda k: (-reps[k].tp, k),
        )
        need = room[d]
        plan: list[tuple[int, int]] = []
        spare = free_cnt.copy()
        spare[d] = 0
        cost = 0.0
        for k in movers:
            if need <= 0:
                break
            r = reps[k]
            cand = np.flatnonzero(spare >= r.tp)
            if len(cand) == 0:
                continue
            e = int(cand[np.argmin(spare[cand])])
            spare[e] -= r.tp
            plan.append((k, e))
            need -= r.tp
            cost += ctx.start_cost(r.fleet, r.rate) + (
                0.0 if r.new else ctx.stop_cost(r.fleet, r.rate)
            )
        if need > 0 or cost >= gain:
            continue
        new = []
        for k, e in plan:
            r = reps[k]
            stopped.add(k)
            by_domain[d].remove(k)
            busy[list(r.gpus)] = False
            free_cnt[d] += r.tp
            new.append(_place(ctx, reps, busy, free_cnt, r.fleet, r.tp, e))
        return d, new
    return None


def _reprice(
    d: int,
    chain: list[int],
    free_cnt: np.ndarray,
    by_domain: dict[int, list[int]],
    loss_of: dict[int, float],
    reps: list[_Rep],
    price: np.ndarray,
) -> None:
    """Row ``d`` of ``price``: the least loss (cheapest victims per GPU first) that frees
    each degree of ``chain`` in domain ``d``."""
    ks = by_domain.get(d, [])
    for j, t in enumerate(chain):
        got, loss, p = int(free_cnt[d]), 0.0, 0
        while got < t and p < len(ks):
            got += reps[ks[p]].tp
            loss += loss_of[ks[p]]
            p += 1
        price[d, j] = loss if got >= t else np.inf


def _wants(ctx: _Ctx, have: np.ndarray, count: np.ndarray) -> list[tuple[int, int, float]]:
    """Replicas the fleets want, ``(fleet, degree, gain)``, by gain per GPU (best first):
    each fleet's most GPU-efficient degree, a smaller one for the last of its demand."""
    out: list[tuple[float, int, int, float]] = []
    cap = ctx.a.n_gpus
    for i, f in enumerate(ctx.fleets):
        h, c = float(have[i]), int(count[i])
        limit = f.max_replicas if f.max_replicas is not None else cap
        while c < limit and len(out) < cap:
            best = None
            for t in ctx.degrees[i]:
                rt = f.rate(t)
                g = ctx.value_of(i, rt, h, c) - ctx.start_cost(i, rt)
                if g > 1e-12 and (best is None or g / t > best[0] / best[1] + 1e-15):
                    best = (g, t, rt)
            if best is None:
                break
            g, t, rt = best
            out.append((-g / t, i, t, g))
            h += rt
            c += 1
    out.sort()
    return [(i, t, g) for _, i, t, g in out]


def _to_plan(ctx: _Ctx, filled: _Filled, running: MultiPlan) -> MultiPlan:
    a = ctx.a
    option = filled.option
    training = running.training if not option.changed else _training_plan(ctx, option)
    serving = tuple(
        ServingReplica(
            ctx.fleets[r.fleet].name,
            r.tp,
            a.domain_ids[r.domain],
            tuple(a.gpu_ids[g] for g in r.gpus),
        )
        for r in filled.reps
    )
    return MultiPlan(training, serving, {"policy": "replay", "option": filled.option.name})


def _kept(ctx: _Ctx, running: MultiPlan) -> tuple[list[_Rep], bool]:
    """The running serving replicas that still run, and whether any lost a GPU."""
    a = ctx.a
    names = {f.name: i for i, f in enumerate(ctx.fleets)}
    out = []
    lost = False
    index, healthy, speed = a.gpu_index, ctx.healthy_l, ctx.speed_l
    for rep in running.serving:
        i = names.get(rep.workload)
        gs = tuple(index[g] for g in rep.gpus)
        if i is None or rep.tp not in ctx.fleets[i].throughput:
            lost = True
            continue
        if not all(healthy[g] for g in gs):
            lost = True
            continue
        slowest = min(speed[g] for g in gs)
        if not ctx.fleets[i].usable(rep.tp, slowest):
            lost = True  # below min_tp, or late since a speed change: it serves nothing
            continue
        rate = ctx.fleets[i].rate(rep.tp, slowest)
        out.append(_Rep(i, rep.tp, int(a.domain_index[rep.domain]), gs, rate, False))
    return out, lost


def replan_multi(
    multi: MultiInstance,
    running: MultiPlan,
    *,
    reference: Mapping[str, float] | None = None,
    reference_value: float | None = None,
    options: ReplayOptions | None = None,
) -> Decision:
    """Re-plan ``multi`` (its current demand and health) from the ``running`` plan.

    Parameters
    ----------
    multi
        The instance after any health events, with the fleets' current demand.
    running
        The plan that runs (made for an earlier demand, maybe on GPUs that failed since).
    reference
        Each fleet's demand when ``running`` was made (the deadband's reference);
        ``None``: no deadband.
    reference_value
        The weighted goodput of ``running`` when it was made; the deadband holds
        only while the plan has lost at most ``tolerance`` of it (``None``: not checked).
    options
        :class:`ReplayOptions` (default: the documented defaults).

    Returns
    -------
    Decision
        Its plan breaks no rule of :func:`~ntp_opt.multi.validate.evaluate_multi`
        but, when demand outgrows the cluster, a minimum share.
    """
    opts = options or ReplayOptions()
    ctx = _Ctx(multi, opts)
    kept, lost = _kept(ctx, running)
    serving_gpus = np.zeros(ctx.a.n_gpus, dtype=bool)
    for r in kept:
        serving_gpus[list(r.gpus)] = True
    base = _training_options(ctx, running.training, serving_gpus, base_only=True)[0]
    keep = _keep_only(ctx, base, kept)
    forced = lost or base.broken or not keep.min_ok
    if not forced and opts.migration and reference is not None:
        change = max(
            (
                abs(ctx.demand[i] - reference.get(f.name, ctx.demand[i])) / ctx.demand[i]
                for i, f in enumerate(ctx.fleets)
            ),
            default=0.0,
        )
        dropped = 0.0 if reference_value is None else reference_value - keep.value
        if change <= opts.deadband and dropped <= opts.tolerance:
            return _decide(ctx, keep, running, "deadband")
    best = keep
    for opt in _training_options(ctx, running.training, serving_gpus):
        got = _fill(ctx, opt, kept)
        if (got.min_ok, got.score) > (best.min_ok, best.score + 1e-12):
            best = got
    margin = opts.margin if opts.migration else 0.0
    if not forced and (best is keep or best.score <= keep.score + margin):
        return _decide(ctx, keep, running, "margin")
    return _decide(ctx, best, running, "forced" if forced else "replanned")


def _keep_only(ctx: _Ctx, option: _Option, kept: list[_Rep]) -> _Filled:
    """The running plan (training repaired if it must be), no serving change."""
    busy = option.train_gpus | ~ctx.healthy
    reps = [r for r, bad in zip(kept, _conflicts(kept, busy), strict=True) if not bad]
    nf = len(ctx.fleets)
    have = np.zeros(nf)
    count = np.zeros(nf, dtype=np.int64)
    for r in reps:
        have[r.fleet] += r.rate
        count[r.fleet] += 1
    served = np.minimum(1.0, have / ctx.demand) if nf else np.zeros(0)
    value = ctx.w_t * option.relative + float((ctx.weight * served).sum())
    cost = 0.0
    if option.changed:
        cost += ctx.w_t * option.relative * ctx.cost.training_restart_s / ctx.cost.horizon_s
    min_ok = all(
        have[i] >= f.min_fraction * ctx.demand[i] * (1 - 1e-9) and count[i] >= f.min_replicas
        for i, f in enumerate(ctx.fleets)
    ) and option.relative >= ctx.multi.workloads.training_min_relative_goodput * (1 - 1e-9)
    changed = option.changed or len(reps) != len(kept)
    return _Filled(option, reps, value - cost, value, min_ok, changed)


def _decide(ctx: _Ctx, filled: _Filled, running: MultiPlan, reason: str) -> Decision:
    plan = _to_plan(ctx, filled, running)
    ev = evaluate_multi(ctx.multi, plan)
    structural = [v for v in ev.violations if v.rule not in _SHARE_RULES]
    late = {k: f.late for k, f in ev.fleets.items() if f.late}
    if structural or late:
        raise RuntimeError(f"re-planned plan broke rules (bug): {structural[:3]} late {late}")
    plan = plan.with_metrics(**ev.as_metrics())
    return Decision(plan, ev, filled.changed, reason, filled.option.name)


#: Rules a plan may break when demand outgrows the cluster (reported, not fatal).
_SHARE_RULES = frozenset({"min-fraction", "min-replicas", "training-min"})


def _tps(plan: MultiPlan) -> list[int]:
    return [r.tp for r in plan.training.replicas]


# ---------------------------------------------------------------- the replay


@dataclass
class _Track:
    """One planner's state along the trace."""

    plan: MultiPlan | None = None
    reference: dict[str, float] = field(default_factory=dict)
    value: float | None = None


def _figures(
    ev: MultiEvaluation, mv: Moves, loss: float, cpu: float, extra: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "weighted_goodput": ev.weighted_goodput,
        "migration_loss": loss,
        "served": {k: f.served for k, f in ev.fleets.items()},
        "training_relative_goodput": ev.training.relative_goodput,
        "gpus_moved": mv.gpus,
        "training_gpus_moved": mv.training_gpus,
        "replicas_started": mv.started,
        "replicas_stopped": mv.stopped,
        "decision_cpu_s": cpu,
        "feasible": ev.feasible,
        "violations": [v.rule for v in ev.violations],
        **extra,
    }


def _peak(trace: DemandTrace, workloads: Workloads) -> dict[str, float]:
    peak: dict[str, float] = {}
    for d in trace.demands(workloads):
        for k, v in d.items():
            peak[k] = max(peak.get(k, 0.0), v)
    return peak


def replay(
    multi: MultiInstance,
    trace: DemandTrace,
    *,
    options: ReplayOptions | None = None,
    planners: Iterable[str] = PLANNERS,
    time_limit: float = 60.0,
    seed: int = 0,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    source: str = "<demand>",
) -> list[dict[str, Any]]:
    """Replay ``trace`` on ``multi`` with the re-planner and the baselines.

    Parameters
    ----------
    multi
        The instance (cluster, training job) and workloads (base demand).
    trace
        The demand trace (its fleet names must be ``multi``'s).
    options
        :class:`ReplayOptions` of the re-planner.
    planners
        Which of :data:`PLANNERS` to run: ``replay`` (first plan by
        :func:`~ntp_opt.multi.milp.solve_multi`, then :func:`replan_multi`),
        ``static`` (the static partition sized for each fleet's peak demand over
        the trace, re-made only after health events) and ``resolve``
        (:func:`~ntp_opt.multi.milp.solve_multi` at every step, no migration cost).
    time_limit, seed
        For :func:`~ntp_opt.multi.milp.solve_multi` and :func:`solve_static`.
    on_step
        Called with each step's record as soon as it is complete (to write it).
    source
        The trace's file name, for errors.

    Returns
    -------
    list of dict
        Per step: ``time_s``, ``demand``, ``events`` and, per planner, the figures of
        ``ntp-opt/replay@1`` (``docs/workloads.md``).
    """
    opts = options or ReplayOptions()
    todo = list(planners)
    unknown = [p for p in todo if p not in PLANNERS]
    if unknown:
        raise ValueError(f"planners: unknown {unknown} (known: {list(PLANNERS)})")
    trace.check_fleets(multi.workloads, source)
    instance = multi.instance
    tracks = {p: _Track() for p in todo}
    peak = _peak(trace, multi.workloads)
    static_instance: MultiInstance | None = None
    records: list[dict[str, Any]] = []
    for k, (step, demand) in enumerate(
        zip(trace.steps, trace.demands(multi.workloads), strict=True)
    ):
        if step.events:
            try:
                instance = apply_events(instance, step.events)
            except ValueError as err:
                raise InputError(source, [(f"steps[{k}].events", str(err))]) from None
        now = with_demand(MultiInstance(instance, multi.workloads), demand)
        rec: dict[str, Any] = {
            "step": k,
            "time_s": step.time_s,
            "demand": demand,
            "events": len(step.events),
        }
        for name in todo:
            tr = tracks[name]
            t0 = time.process_time()
            extra: dict[str, Any] = {}
            if name == "replay":
                if tr.plan is None:
                    res = solve_multi(now, time_limit=time_limit, seed=seed)
                    if res.plan is None or res.evaluation is None:
                        raise ValueError(f"no first plan: {res.status} ({res.reason})")
                    plan, ev = res.plan, res.evaluation
                    extra = {"replanned": True, "reason": "first plan"}
                    tr.reference = dict(demand)
                    tr.value = ev.weighted_goodput
                else:
                    dec = replan_multi(
                        now,
                        tr.plan,
                        reference=tr.reference,
                        reference_value=tr.value,
                        options=opts,
                    )
                    plan, ev = dec.plan, dec.evaluation
                    extra = {"replanned": dec.replanned, "reason": dec.reason, "option": dec.option}
                    if dec.reason not in ("deadband", "margin"):
                        tr.reference = dict(demand)
                        tr.value = ev.weighted_goodput
            elif name == "static":
                if static_instance is None or step.events:
                    static_instance = with_demand(MultiInstance(instance, multi.workloads), peak)
                    plan, _ = solve_static(static_instance, time_limit=time_limit, seed=seed)
                    plan = MultiPlan(plan.training, plan.serving, {"policy": "static"})
                else:
                    assert tr.plan is not None
                    plan = tr.plan
                ev = evaluate_multi(now, plan)
            else:
                res = solve_multi(now, time_limit=time_limit, seed=seed)
                if res.plan is None or res.evaluation is None:
                    raise ValueError(f"step {k}: no plan: {res.status} ({res.reason})")
                plan, ev = res.plan, res.evaluation
                extra = {"status": str(res.status)}
            cpu = time.process_time() - t0
            structural = [v for v in ev.violations if v.rule not in _SHARE_RULES]
            if structural:
                raise RuntimeError(f"{name} plan at step {k} broke rules (bug): {structural[:3]}")
            mv = moves(tr.plan, plan, instance)
            loss = migration_loss(now, tr.plan, plan, ev.training.relative_goodput, opts.cost)
            tr.plan = MultiPlan(plan.training, plan.serving, {})
            rec[name] = _figures(ev, mv, loss, cpu, extra)
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    return records


def summary(records: list[dict[str, Any]], planner: str, skip_first: bool = True) -> dict[str, Any]:
    """Means and totals of one planner over a replay (the first step, the initial
    placement, is left out of moves and decision times when ``skip_first``)."""
    rows = [r[planner] for r in records if planner in r]
    later = rows[1:] if skip_first and len(rows) > 1 else rows
    times = [float(r["time_s"]) for r in records if planner in r]
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    step = span / (len(times) - 1) if len(times) > 1 else 1.0
    # the mean weighted goodput over the trace (each step holds until the next; the last
    # for one mean step), less the migration losses spread over the same time
    lost = sum(x["migration_loss"] for x in later)
    fleets = list(rows[0]["served"]) if rows else []
    cpu = sorted(x["decision_cpu_s"] for x in later)
    return {
        "mean_weighted_goodput": float(np.mean([x["weighted_goodput"] for x in rows])),
        "mean_net_weighted_goodput": float(np.mean([x["weighted_goodput"] for x in rows]))
        - lost / (span + step),
        "mean_served": {f: float(np.mean([x["served"][f] for x in rows])) for f in fleets},
        "mean_training_relative_goodput": float(
            np.mean([x["training_relative_goodput"] for x in rows])
        ),
        "gpus_moved_total": int(sum(x["gpus_moved"] for x in later)),
        "gpus_moved_per_step": float(np.mean([x["gpus_moved"] for x in later])) if later else 0.0,
        "median_decision_cpu_s": float(np.median(cpu)) if cpu else 0.0,
        "max_decision_cpu_s": float(max(cpu)) if cpu else 0.0,
        "steps_infeasible": sum(1 for x in rows if not x["feasible"]),
    }


def replay_document(
    multi: MultiInstance,
    trace_meta: Mapping[str, Any],
    options: ReplayOptions,
    records: list[dict[str, Any]],
    planners: Iterable[str],
    complete: bool,
) -> dict[str, Any]:
    """The ``ntp-opt/replay@1`` document of ``records``."""
    names = list(planners)
    return {
        "format": REPLAY_FORMAT,
        "instance": multi.name,
        "complete": complete,
        "options": {
            "serving_start_s": options.cost.serving_start_s,
            "serving_stop_s": options.cost.serving_stop_s,
            "training_restart_s": options.cost.training_restart_s,
            "horizon_s": options.cost.horizon_s,
            "deadband": options.deadband,
            "tolerance": options.tolerance,
            "margin": options.margin,
            "migration": options.migration,
        },
        "trace": dict(trace_meta),
        "summary": {p: summary(records, p) for p in names} if records else {},
        "steps": records,
    }


def write_replay(
    path: str | os.PathLike[str],
    document: Mapping[str, Any],
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Write a replay document atomically (never onto one of ``inputs``)."""
    write_json(dict(document), Path(path), inputs)
