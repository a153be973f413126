"""The re-planner's state: its arrays, the training options it weighs, their scores.

:class:`ReplanContext` holds the arrays of one decision; :func:`training_options`
lists the training plans the re-planner weighs (keep the running plan, repaired
in place when a GPU under it failed; every replica at each allowed TP degree;
one or two replicas fewer), which :func:`ntp_opt.workflows.multi.fill.fill`
gives serving replicas (``docs/workloads.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.model.workloads import MultiInstance
from ntp_opt.rules.goodput import relative_goodput, replica_speed, split_batch
from ntp_opt.rules.multi import usable
from ntp_opt.workflows.multi.migration import MigrationCost, ReplayOptions

#: Weight of a fleet's served share below its ``min_fraction`` (and of a missing
#: ``min_replicas`` replica) in the re-planner's greedy: minimum shares come first.
PRIORITY = 1000.0

#: A training replica in index space: ``(tp, [(domain, GPU indices)])``.
TrainingReplica = tuple[int, list[tuple[int, list[int]]]]


@dataclass
class Rep:
    """A serving replica in index space.

    Attributes
    ----------
    fleet
        Index of its fleet.
    tp
        TP degree.
    domain
        Domain index.
    gpus
        GPU indices.
    rate
        Requests/s it serves.
    new
        Started by this decision (not running before).
    """

    fleet: int
    tp: int
    domain: int
    gpus: tuple[int, ...]
    rate: float
    new: bool


@dataclass
class TrainingOption:
    """A training plan the re-planner weighs, in index space.

    Attributes
    ----------
    name
        ``keep``, ``pause``, ``tp<t>`` or ``drop<k>``.
    replicas
        ``(tp, [(domain, GPU indices)])`` per replica.
    batches
        The exact batch split.
    train_gpus
        Bool per GPU: used by training.
    relative
        Training's relative goodput.
    changed
        Differs from the running training plan.
    broken
        The running training plan lost a GPU.
    """

    name: str
    replicas: list[TrainingReplica]
    batches: tuple[int, ...]
    train_gpus: np.ndarray
    relative: float
    changed: bool
    broken: bool = False


@dataclass
class Filled:
    """A training option with its serving replicas, scored.

    Attributes
    ----------
    option
        The training option.
    reps
        The serving replicas.
    score
        ``value`` less the migration cost spread over the horizon.
    value
        Weighted goodput.
    min_ok
        Every minimum share is met.
    changed
        Differs from the running plan.
    """

    option: TrainingOption
    reps: list[Rep]
    score: float
    value: float
    min_ok: bool
    changed: bool  # differs from the running plan


class ReplanContext:
    """Arrays of one re-planning decision.

    Parameters
    ----------
    multi
        The instance (current health) and workloads (current demand).
    opts
        The re-planner's options (no migration: a zero cost).
    """

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
        # misses (their GPUs are chosen by :func:`ntp_opt.workflows.multi.fill.fill`)
        self.degrees: list[tuple[int, ...]] = [
            tuple(t for t in f.fitting_degrees if usable(f, t, top)) for f in self.fleets
        ]
        self.strict: list[frozenset[int]] = [
            frozenset(t for t in ds if not usable(f, t, slow))
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
        """Starting a replica of fleet ``i`` serving ``rate``, over the horizon."""
        d = self.demand[i]
        return self.weight[i] * min(rate, d) / d * self.cost.serving_start_s / self.cost.horizon_s

    def stop_cost(self, i: int, rate: float) -> float:
        """Stopping a replica of fleet ``i`` serving ``rate``, over the horizon."""
        d = self.demand[i]
        return self.weight[i] * min(rate, d) / d * self.cost.serving_stop_s / self.cost.horizon_s


def _training_split(
    ctx: ReplanContext, replicas: list[TrainingReplica]
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


def training_plan(ctx: ReplanContext, option: TrainingOption) -> Plan:
    """The training plan of an option.

    Parameters
    ----------
    ctx
        The decision's arrays.
    option
        The training option.

    Returns
    -------
    Plan
        With power multiplier 1 and policy ``replay``.
    """
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


@dataclass(frozen=True)
class _Running:
    """The running training plan in index space, and what it leaves to serving."""

    cur: list[TrainingReplica]
    used: np.ndarray
    serving: list[bool]


def _running(ctx: ReplanContext, running: Plan, serving_gpus: np.ndarray) -> _Running:
    """The running training plan's replicas and GPUs in index space."""
    a = ctx.a
    idx = a.gpu_index
    cur: list[TrainingReplica] = []
    for rep in running.replicas:
        sts = [(int(a.domain_index[st.domain]), [idx[x] for x in st.gpus]) for st in rep.stages]
        cur.append((rep.tp, sts))
    used = np.zeros(a.n_gpus, dtype=bool)
    for _, sts in cur:
        for _, g in sts:
            used[g] = True
    return _Running(cur, used, serving_gpus.tolist())


def _stage_at(
    ctx: ReplanContext, run: _Running, d: int, own: list[int], t: int, taken: list[bool]
) -> list[int] | None:
    """``t`` healthy GPUs of domain ``d``: the stage's own first, then free ones, then
    serving ones; fastest first."""
    healthy, speed, serving = ctx.healthy_l, ctx.speed_l, run.serving
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


def _resized(
    ctx: ReplanContext, run: _Running, sts: list[tuple[int, list[int]]], t: int, taken: list[bool]
) -> TrainingReplica | None:
    """The replica at the largest allowed degree ``<= t`` that every stage can hold in
    its domain (``None``: none)."""
    for tt in [x for x in reversed(sorted(ctx.job.allowed)) if x <= t]:
        got = []
        for d, g in sts:
            st = _stage_at(ctx, run, d, g, tt, taken)
            if st is None:
                break
            got.append((d, st))
        else:
            return (tt, got)
    return None


def _build_option(
    ctx: ReplanContext,
    run: _Running,
    name: str,
    want: Callable[[int], int | None],
    drop: int = 0,
) -> TrainingOption | None:
    """The running replicas (less the ``drop`` slowest) at the degree ``want`` gives each."""
    healthy = ctx.healthy_l
    cur = run.cur
    taken = run.used.tolist()
    out: list[TrainingReplica] = []
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
        done = _resized(ctx, run, sts, t, taken)
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
    gpus = np.zeros(ctx.a.n_gpus, dtype=bool)
    for _, sts in out:
        for _, g in sts:
            gpus[g] = True
    same = bool(np.array_equal(gpus, run.used & ctx.healthy)) and [t for t, _ in out] == [
        t for t, _ in cur
    ]
    return TrainingOption(name, out, batches, gpus, rel, changed=not same, broken=broken)


def training_options(
    ctx: ReplanContext, running: Plan, serving_gpus: np.ndarray, base_only: bool = False
) -> list[TrainingOption]:
    """The training options the re-planner weighs.

    Keep the running plan (repaired in place when a GPU under it failed; if it
    cannot be, pause), every replica at each allowed TP degree, and one or two
    replicas fewer.

    Parameters
    ----------
    ctx
        The decision's arrays.
    running
        The running training plan.
    serving_gpus
        Bool per GPU: used by a running serving replica (taken last).
    base_only
        Only the first option.

    Returns
    -------
    list of TrainingOption
        The first is the running plan, repaired.
    """
    run = _running(ctx, running, serving_gpus)
    options: list[TrainingOption] = []
    base = _build_option(ctx, run, "keep", lambda t: t)
    if base is None:
        base = TrainingOption("pause", [], (), np.zeros(ctx.a.n_gpus, bool), 0.0, True)
    options.append(base)
    if ctx.w_t > 0 and not base_only:
        for t in sorted(ctx.job.allowed):
            got = _build_option(ctx, run, f"tp{t}", _const(t))
            if got is not None:
                options.append(got)
        for k in (1, 2):
            if len(run.cur) > k:
                got = _build_option(ctx, run, f"drop{k}", lambda t: t, drop=k)
                if got is not None:
                    options.append(got)
    return options


def _const(t: int) -> Callable[[int], int | None]:
    """The degree ``t`` whatever a replica's degree was."""
    return lambda _old: t


def _slowest(ctx: ReplanContext, rep: TrainingReplica) -> float:
    """The speed of the replica's slowest GPU."""
    _, sts = rep
    return min((ctx.speed_l[g] for _, gs in sts for g in gs), default=0.0)
