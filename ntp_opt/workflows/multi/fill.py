"""The re-planner's greedy: serving replicas for a training option, by marginal
weighted goodput per GPU, with migration cost (``docs/workloads.md``).

:func:`fill` starts from the running replicas the option leaves room for and
adds the fleets' wants: each at the NVLink domain where opening its degree's
GPUs is cheapest (free GPUs first, then the cheapest replicas), if the gain
exceeds that price; when no domain opens cheaply enough, replicas of smaller
degree of other fleets move into free fragments of other domains
(compaction). A replica whose latency target some healthy GPU misses goes
only where the fastest free GPUs meet it (:func:`_open_fast`), and
compaction does not move it. :func:`keep_only` scores the running plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.rules.multi import usable
from ntp_opt.workflows.multi.context import Filled, Rep, ReplanContext, TrainingOption


@dataclass
class _Greedy:
    """The state of :func:`fill`'s greedy: the replicas, the busy GPUs and, per round,
    what stopping each running replica loses and what opening a degree costs."""

    ctx: ReplanContext
    reps: list[Rep]
    busy: np.ndarray
    free_cnt: np.ndarray
    chain: list[int]
    stopped: set[int] = field(default_factory=set)
    loss_of: dict[int, float] = field(default_factory=dict)
    by_domain: dict[int, list[int]] = field(default_factory=dict)
    #: price[d, j]: least loss that frees chain[j] GPUs in domain d (inf: cannot)
    price: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))

    def tally(self) -> tuple[np.ndarray, np.ndarray]:
        """Throughput and replicas per fleet of the replicas not stopped."""
        nf = len(self.ctx.fleets)
        have = np.zeros(nf)
        count = np.zeros(nf, dtype=np.int64)
        for k, r in enumerate(self.reps):
            if k not in self.stopped:
                have[r.fleet] += r.rate
                count[r.fleet] += 1
        return have, count

    def losses(self, have: np.ndarray, count: np.ndarray) -> None:
        """What stopping each running replica loses (its fleet's slowest replicas first),
        the replicas by domain (cheapest per GPU first) and the prices."""
        ctx, reps = self.ctx, self.reps
        self.loss_of = {}
        by_fleet: dict[int, list[int]] = {}
        for k, r in enumerate(reps):
            if k not in self.stopped:
                by_fleet.setdefault(r.fleet, []).append(k)
        for i, ks in by_fleet.items():
            ks.sort(key=lambda k: reps[k].rate)
            h, c = float(have[i]), int(count[i])
            for k in ks:
                r = reps[k]
                loss = ctx.value_of(i, r.rate, h - r.rate, c - 1)
                loss += ctx.start_cost(i, r.rate) * -1.0 if r.new else ctx.stop_cost(i, r.rate)
                self.loss_of[k] = loss
                h -= r.rate
                c -= 1
        self.by_domain = {}
        for k in self.loss_of:
            self.by_domain.setdefault(reps[k].domain, []).append(k)
        for ks in self.by_domain.values():
            ks.sort(key=lambda k: self.loss_of[k] / reps[k].tp)
        self.price = np.full((ctx.a.n_domains, len(self.chain)), np.inf)
        for d in {*np.flatnonzero(self.free_cnt > 0).tolist(), *self.by_domain}:
            self.reprice(d)

    def reprice(self, d: int) -> None:
        """Row ``d`` of the prices."""
        _reprice(d, self.chain, self.free_cnt, self.by_domain, self.loss_of, self.reps, self.price)

    def evict(self, d: int, victims: int | None, t: int = 0) -> None:
        """Stop domain ``d``'s cheapest replicas: ``victims`` of them, or (``None``) until
        ``t`` GPUs are free."""
        ks = self.by_domain.get(d, [])
        while (self.free_cnt[d] < t) if victims is None else victims > 0:
            k = ks.pop(0)
            self.stopped.add(k)
            self.busy[list(self.reps[k].gpus)] = False
            self.free_cnt[d] += self.reps[k].tp
            if victims is not None:
                victims -= 1

    def place(self, i: int, t: int, d: int) -> None:
        """Start fleet ``i``'s replica of degree ``t`` in domain ``d``; reprice ``d``."""
        _place(self.ctx, self.reps, self.busy, self.free_cnt, i, t, d)
        self.reprice(d)

    def strict_want(self, i: int, t: int, gain: float, failed: dict[tuple[int, int], float]) -> int:
        """A replica whose latency target some GPUs miss: a domain whose fastest free GPUs
        (after evicting its cheapest replicas) meet it, or no replica; replicas placed."""
        if gain <= failed.get((i, t), -1.0):
            return 0
        j = self.chain.index(t)
        opened = _open_fast(
            self.ctx,
            i,
            t,
            gain,
            self.price[:, j],
            self.busy,
            self.by_domain,
            self.loss_of,
            self.reps,
        )
        if opened is None:
            failed[(i, t)] = gain
            return 0
        d, victims = opened
        self.evict(d, victims)
        self.place(i, t, d)
        return 1

    def want(self, i: int, t: int, gain: float, failed: dict[tuple[int, int], float]) -> int:
        """A replica at the domain where opening its GPUs is cheapest, if below ``gain``
        (else after compaction); replicas placed."""
        j = self.chain.index(t)
        d = int(np.argmin(self.price[:, j]))
        if not self.price[d, j] < gain:
            # no domain opens up cheaply enough: move small replicas of other fleets
            # from a domain into free fragments elsewhere, at start and stop cost
            if gain <= failed.get((i, t), -1.0):
                return 0  # wants come by gain: a smaller one fails as well
            moved = _compact(
                self.ctx,
                i,
                t,
                gain,
                self.reps,
                self.stopped,
                self.busy,
                self.free_cnt,
                self.by_domain,
            )
            if moved is None:
                failed[(i, t)] = gain
                return 0
            d, new = moved
            for k in new:
                self.loss_of[k] = math.inf  # not evicted again this round
                self.by_domain.setdefault(self.reps[k].domain, []).append(k)
            for dd in {d, *(self.reps[k].domain for k in new)}:
                self.reprice(dd)
        self.evict(d, None, t)
        self.place(i, t, d)
        return 1

    def round(self) -> int:
        """One round of wants, best gain per GPU first; replicas placed."""
        have, count = self.tally()
        wants = _wants(self.ctx, have, count)
        if not wants:
            return 0
        self.losses(have, count)
        placed = 0
        failed: dict[tuple[int, int], float] = {}  # (fleet, degree) -> gain compaction missed
        for i, t, gain in wants:
            if t in self.ctx.strict[i]:
                placed += self.strict_want(i, t, gain, failed)
            else:
                placed += self.want(i, t, gain, failed)
        return placed


def _min_ok(
    ctx: ReplanContext, option: TrainingOption, have: np.ndarray, count: np.ndarray
) -> bool:
    """Every minimum share (fleets' and training's) is met."""
    return all(
        have[i] >= f.min_fraction * ctx.demand[i] * (1 - 1e-9) and count[i] >= f.min_replicas
        for i, f in enumerate(ctx.fleets)
    ) and option.relative >= ctx.multi.workloads.training_min_relative_goodput * (1 - 1e-9)


def _scored(
    ctx: ReplanContext, option: TrainingOption, final: list[Rep], cost: float, changed: bool
) -> Filled:
    """``option`` with serving replicas ``final``, scored ``W - cost`` (new replicas'
    start cost added here)."""
    nf = len(ctx.fleets)
    have = np.zeros(nf)
    count = np.zeros(nf, dtype=np.int64)
    for r in final:
        have[r.fleet] += r.rate
        count[r.fleet] += 1
        if r.new:
            cost += ctx.start_cost(r.fleet, r.rate)
    served = np.minimum(1.0, have / ctx.demand) if nf else np.zeros(0)
    value = ctx.w_t * option.relative + float((ctx.weight * served).sum())
    return Filled(option, final, value - cost, value, _min_ok(ctx, option, have, count), changed)


def fill(ctx: ReplanContext, option: TrainingOption, kept: list[Rep]) -> Filled:
    """Serving replicas for a training option, by the greedy of ``docs/workloads.md``.

    ``kept`` (minus those on the option's training GPUs) and the greedy additions:
    fleets' wants, best gain per GPU first, at the domain where opening their
    degree is cheapest, or after compaction.

    Parameters
    ----------
    ctx
        The decision's arrays.
    option
        The training option.
    kept
        The running serving replicas that still run.

    Returns
    -------
    Filled
        Scored ``W - cost / horizon``.
    """
    busy = option.train_gpus.copy() | ~ctx.healthy
    reps: list[Rep] = []
    cost = 0.0
    for r, bad in zip(kept, conflicts(kept, busy), strict=True):
        if bad:
            cost += ctx.stop_cost(r.fleet, r.rate)  # evicted by training
            continue
        busy[list(r.gpus)] = True
        reps.append(r)
    if option.changed:
        cost += ctx.w_t * option.relative * ctx.cost.training_restart_s / ctx.cost.horizon_s
    free_cnt = np.bincount(ctx.gpu_domain[~busy], minlength=ctx.a.n_domains)
    chain = sorted({t for f in ctx.fleets for t in f.degrees})
    greedy = _Greedy(ctx, reps, busy, free_cnt, chain)
    for _round in range(4):
        if not greedy.round():
            break
    final = [r for k, r in enumerate(reps) if k not in greedy.stopped]
    for k in greedy.stopped:
        r = reps[k]
        if not r.new:
            cost += ctx.stop_cost(r.fleet, r.rate)
    changed = option.changed or len(final) != len(kept) or any(r.new for r in final)
    return _scored(ctx, option, final, cost, changed)


def conflicts(reps: list[Rep], busy: np.ndarray) -> list[bool]:
    """For each replica, whether one of its GPUs is busy.

    Parameters
    ----------
    reps
        Serving replicas.
    busy
        Bool per GPU.

    Returns
    -------
    list of bool
        One per replica.
    """
    if not reps:
        return []
    flat = np.fromiter((g for r in reps for g in r.gpus), dtype=np.int64)
    owner = np.repeat(np.arange(len(reps)), [len(r.gpus) for r in reps])
    hits: list[bool] = (np.bincount(owner, weights=busy[flat], minlength=len(reps)) > 0).tolist()
    return hits


def _place(
    ctx: ReplanContext,
    reps: list[Rep],
    busy: np.ndarray,
    free_cnt: np.ndarray,
    i: int,
    t: int,
    d: int,
) -> int:
    """Start a replica of fleet ``i``, degree ``t``, on the fastest free GPUs of domain ``d``."""
    m = ctx.members[d]
    gs = m[~busy[m]][:t]
    slowest = float(ctx.speed[gs].min()) if len(gs) == t else 0.0
    if len(gs) < t or not usable(ctx.fleets[i], t, slowest):
        raise RuntimeError(f"re-planner placed fleet {i} TP{t} where it cannot count (bug)")
    busy[gs] = True
    free_cnt[d] -= t
    rate = ctx.fleets[i].rate(t, slowest)
    reps.append(Rep(i, t, d, tuple(int(x) for x in gs), rate, True))
    return len(reps) - 1


#: Domains :func:`_compact` tries per replica it must make room for.
COMPACT_TRIES = 8
#: Domains :func:`_open_fast` tries (cheapest first) per replica with a latency target.
OPEN_TRIES = 32


def _open_fast(
    ctx: ReplanContext,
    i: int,
    t: int,
    gain: float,
    price: np.ndarray,
    busy: np.ndarray,
    by_domain: dict[int, list[int]],
    loss_of: dict[int, float],
    reps: list[Rep],
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
                if usable(f, t, speed[free[t - 1]]):
                    return d, p
            if p == len(ks):
                break
            free.extend(reps[ks[p]].gpus)
            loss += loss_of[ks[p]]
            p += 1
    return None


def _mover(ctx: ReplanContext, r: Rep, i: int, t: int) -> bool:
    """Whether compaction for fleet ``i``'s replica of degree ``t`` may move ``r``: smaller,
    of another fleet (a replica whose latency target some GPU misses stays where it is)."""
    return r.tp < t and r.fleet != i and r.tp not in ctx.strict[r.fleet]


def _compact(
    ctx: ReplanContext,
    i: int,
    t: int,
    gain: float,
    reps: list[Rep],
    stopped: set[int],
    busy: np.ndarray,
    free_cnt: np.ndarray,
    by_domain: dict[int, list[int]],
) -> tuple[int, list[int]] | None:
    """Open ``t`` free GPUs in one domain for fleet ``i`` by moving replicas of smaller
    degree (other fleets) into free GPUs of other domains, if their start and stop cost
    is below ``gain``; returns the domain and the moved replicas' new indices."""

    room: dict[int, int] = {}
    for d, ks in by_domain.items():
        small = sum(reps[k].tp for k in ks if _mover(ctx, reps[k], i, t))
        if free_cnt[d] + small >= t and free_cnt[d] < t:
            room[d] = int(t - free_cnt[d])
    for d in sorted(room, key=lambda x: (room[x], x))[:COMPACT_TRIES]:
        movers = sorted(
            (k for k in by_domain[d] if _mover(ctx, reps[k], i, t)),
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
    reps: list[Rep],
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


def _wants(ctx: ReplanContext, have: np.ndarray, count: np.ndarray) -> list[tuple[int, int, float]]:
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


def keep_only(ctx: ReplanContext, option: TrainingOption, kept: list[Rep]) -> Filled:
    """The running plan (training repaired if it must be), no serving change.

    Parameters
    ----------
    ctx
        The decision's arrays.
    option
        The first training option (the running plan, repaired).
    kept
        The running serving replicas that still run.

    Returns
    -------
    Filled
        Scored like :func:`fill`'s options.
    """
    busy = option.train_gpus | ~ctx.healthy
    reps = [r for r, bad in zip(kept, conflicts(kept, busy), strict=True) if not bad]
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
    min_ok = _min_ok(ctx, option, have, count)
    changed = option.changed or len(reps) != len(kept)
    return Filled(option, reps, value - cost, value, min_ok, changed)
