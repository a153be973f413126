"""Independent brute-force reference planner for small instances (tests only).

This module re-implements the planning model of docs/model.md sections 1-3 from the
cluster graph and the job fields alone, and finds the optimal goodput by
exhaustive enumeration. It shares no code with the package's planners, batch
split or goodput formula (it imports only :class:`ntp_opt.model.plan.Plan` and friends
to hand its answer back), so the exact planners can be checked against it.

Model recap (notation used below)
---------------------------------
A plan is a multiset of at most ``dp_max`` replicas. Replica ``r`` has a degree
``t_r`` in ``tp_allowed``, an integer batch ``b_r`` in ``[1, max_local_batch]``
and ``pp`` stages; stage ``k`` is a set of exactly ``t_r`` healthy GPUs of one
domain (no GPU in two stages) with a power multiplier ``pi_k`` in ``[1, P_k]``:
``P_k = min(1 + max_boost, min_g max_power_w_g / tdp_g)`` over the stage's GPUs
(a GPU without ``max_power_w`` limits nothing: docs/model.md, spec v1.1, the board must
accept the power limit ``pi_k tdp_g``). With ``f(t) = t eta(t) / (T eta(T))``, ``s_k`` the
slowest GPU of stage ``k`` and ``m = 1 + rho`` if some ``t_r < T`` (else 1)::

    v_r = f(t_r) min_k (pi_k^alpha s_k) / c,   theta = m max_r b_r / v_r,
    goodput = sum_r b_r / theta                (0 for the empty plan).

Power, per rack and for the site: used GPUs draw ``tdp pi``, unused healthy
GPUs ``tdp idle``, failed GPUs 0; the sum must not exceed the budget.

Structure and exact power allocation
------------------------------------
A *structure* fixes everything but the power multipliers: the replicas, their
degrees and batches, and the GPU set of every stage. Its goodput is
``sum_r b_r / theta`` with ``sum_r b_r`` fixed, so the best powers minimise
``theta``. A step time ``theta`` is reachable iff every stage ``k`` of replica
``r`` gets ``pi_k^alpha s_k f(t_r) / c >= m b_r / theta``, i.e.
``pi_k >= (a_k / theta)^(1/alpha)`` with ``a_k = m b_r c / (f(t_r) s_k)``
(the step time stage ``k`` would impose at ``pi = 1``). Every power draw
increases with every ``pi_k``, so the smallest multipliers
``pi_k(theta) = max(1, (a_k / theta)^(1/alpha))`` are best, and they decrease
as ``theta`` grows: the set of reachable ``theta`` is an interval
``[theta*, inf)`` and ``theta* = max`` of the thresholds of the individual
constraints (each monotone in ``theta``):

* ``pi_k <= P_k``: ``theta >= a_k / P_k^alpha``;
* budget ``C`` of a rack or of the site, with ``w_k`` the TDP of stage ``k``'s
  GPUs inside it, ``U = sum_k w_k``, ``H`` the TDP of its healthy GPUs and
  ``slack = C - idle H - (1 - idle) U`` (the headroom at ``pi = 1``; negative
  means the structure is infeasible at any ``theta``):
  ``g(theta) = sum_k w_k max(1, (a_k/theta)^(1/alpha)) <= U + slack``. As
  ``max(1, x)`` summed over ``k`` equals the largest of the sums over the
  choices "1 or x" per term, ``g(theta) = max_A h_A(theta)`` over stage sets
  ``A`` with ``h_A(theta) = sum_{k in A} w_k (a_k/theta)^(1/alpha) +
  sum_{k not in A} w_k``; hence ``g(theta) <= U + slack`` iff
  ``theta >= theta_A = (sum_A w_k a_k^(1/alpha) / (slack + sum_A w_k))^alpha``
  for every ``A``. At the threshold the maximising ``A`` is
  ``{k : a_k > theta}``, a set of the largest ``a_k``, so the threshold is the
  largest ``theta_A`` over the prefixes of the stages sorted by decreasing
  ``a_k``: a closed form, no bisection (``_Scorer.best``).

With ``alpha = 0`` power does not change speed and ``pi = 1`` is optimal.

Enumeration and reductions (each one proved here)
-------------------------------------------------
Every structure is enumerated: every number of replicas up to ``dp_max``,
every degree, every choice of stage GPU sets and every batch vector the policy
allows (``fixed``: ``sum b = B``; ``elastic``: ``sum b <= B``), each scored
exactly as above. The empty plan (goodput 0) is the starting incumbent. The
following reductions only skip structures that are equivalent to, or no better
than, one that is enumerated:

(R1) *Replicas are unordered, and so are the stages of a replica and the GPUs of
     a stage.* ``theta``, ``sum b`` and every power sum are symmetric under
     permuting replicas (with their batches), stages of a replica (``v_r``
     takes a min over stages) and GPUs of a stage (a stage is used only
     through its set: slowest speed and TDP per rack). So replicas are chosen
     as a multiset of candidates in non-decreasing candidate order, and a
     replica's stages as a multiset of stage candidates likewise.

(R2) *Interchangeable GPUs* (``reduce=True``). Two healthy GPUs of the same
     domain, rack, TDP, board limit and speed are exchanged by an automorphism of
     everything the model reads (domain rule, speed, the rack and site sums),
     so a plan and its image under swapping them have equal goodput and
     feasibility. Hence only the number of GPUs a stage takes from each such
     class matters: stages are enumerated as count vectors over the classes
     of their domain (GPUs are handed out in graph order when the plan is
     written). Two replicas with the same candidate index differ only by such
     a relabelling, so their batches can be taken non-increasing.

(R3) *Fastest GPUs first* (``reduce=True``). Let ``x`` be an unused healthy GPU
     and ``y`` a used GPU of the same domain, rack, TDP and board limit with
     ``speed_x > speed_y``. Putting ``x`` in ``y``'s stage (same power
     multiplier) keeps the stage in its domain, does not lower its slowest
     speed nor its cap ``P_k`` (so no ``v_r`` drops and ``theta`` does not
     grow, and the multiplier stays allowed), and leaves every
     rack and site sum unchanged (``x`` now draws ``tdp pi``, ``y`` draws
     ``tdp idle``, exactly as before with the roles swapped, in the same rack).
     Each such exchange strictly raises the total speed of the used GPUs, so
     repeating it ends, at a plan at least as good, in which within every
     (domain, rack, TDP, limit) group the used GPUs are a fastest-first prefix: a
     class is used at all only if every strictly faster class of its group
     is used completely. Only structures with this property are scored (the
     test is applied per stage when a domain has too few healthy GPUs for two
     stages, else on the whole structure). The proof does not cover GPUs of
     different TDP, rack or board limit, and those are never exchanged.

``reduce=False`` makes every GPU its own class and drops (R3): every GPU
subset is enumerated.

Bound (``prune=True``). Let ``v_r^max = f(t_r) min_k (P_k^alpha s_k) / c`` be
replica ``r``'s speed with every stage at ``pi_k = P_k``, which
no power allocation exceeds. Then ``theta >= m b_r / v_r^max`` for every
``r``, so (i) ``b_r / theta <= v_r^max / m`` and goodput
``<= sum_r v_r^max / m``; (ii) ``theta >= m / min_r v_r^max`` (``b_r >= 1``)
and ``sum_r b_r <= min(B, R max_local_batch)``, so goodput
``<= min(B, R max_local_batch) min_r v_r^max / m``. A structure whose bound
(the smaller of the two, ``_Scorer.upper_bound``) is not above the incumbent
cannot beat it and is not scored (its extensions still are). Ties keep the
incumbent, so the optimal value is unchanged.

Two scorers compute ``theta*`` (``method``): ``"exact"``, the closed form
above, and ``"bisect"``, a bisection on the power rules themselves. The tests
check that every combination of ``reduce``, ``prune`` and ``method`` gives the
same optimum on random small instances, and the returned plan against both
the package's validator and :func:`plan_figures`, this module's own
evaluation of a plan from the graph attributes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Literal

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage

__all__ = ["brute_force", "plan_figures"]

#: Default GPU TDP of docs/model.md, spec section 1, used when a GPU has no ``tdp_w``.
DEFAULT_TDP_W = 1000.0
#: Relative (and absolute, in watts) tolerance on a budget at ``pi = 1``; far
#: below the validator's 1e-9, far above float rounding of a sum of TDPs.
BASE_TOL = 1e-11
#: Relative tolerance of the checks in :func:`plan_figures` (as the validator's).
CHECK_TOL = 1e-9


# --------------------------------------------------------------------------------------------
# reading the instance (graph attributes and job fields only)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Gpu:
    id: Hashable
    domain: Hashable
    rack: Hashable
    healthy: bool
    speed: float
    tdp: float
    max_w: float  # largest power limit the board accepts (inf: not given)


@dataclass(frozen=True)
class _Cluster:
    gpus: dict[Hashable, _Gpu]  # in graph order
    domains: tuple[Hashable, ...]  # in graph order
    racks: tuple[Hashable, ...]  # in graph order
    rack_budget: dict[Hashable, float]
    site_budget: float


def _read_cluster(instance: Instance) -> _Cluster:
    """Read GPUs, domains, racks and budgets straight from the cluster graph."""
    g = instance.cluster
    kind = {n: d.get("kind") for n, d in g.nodes(data=True)}

    def neighbour(n: Hashable, k: str) -> Hashable:
        (found,) = [v for v in g.adj[n] if kind[v] == k]
        return found

    gpus: dict[Hashable, _Gpu] = {}
    for n, d in g.nodes(data=True):
        if d.get("kind") != "gpu":
            continue
        tray = neighbour(n, "tray")
        gpus[n] = _Gpu(
            id=n,
            domain=neighbour(tray, "domain"),
            rack=neighbour(tray, "rack"),
            healthy=d.get("state", "healthy") == "healthy",
            speed=float(d.get("speed", 1.0)),
            tdp=float(d.get("tdp_w", DEFAULT_TDP_W)),
            max_w=float(d["max_power_w"]) if d.get("max_power_w") is not None else math.inf,
        )
    racks = tuple(n for n in g.nodes if kind[n] == "rack")
    budget: dict[Hashable, float] = {}
    for r in racks:
        b = g.nodes[r].get("power_budget_w")
        budget[r] = float(sum(x.tdp for x in gpus.values() if x.rack == r) if b is None else b)
    site = g.graph.get("power_budget_w")
    return _Cluster(
        gpus=gpus,
        domains=tuple(n for n in g.nodes if kind[n] == "domain"),
        racks=racks,
        rack_budget=budget,
        site_budget=float(sum(x.tdp for x in gpus.values()) if site is None else site),
    )


@dataclass(frozen=True)
class _Params:
    """The job fields the model reads, with the spec's defaults resolved."""

    T: int
    pp: int
    allowed: tuple[int, ...]
    dp_max: int
    mlb: int
    B: int
    fixed: bool
    c: float
    eta: dict[int, float]
    alpha: float
    pmax: float
    idle: float
    rho: float
    mbs: int

    def f(self, t: int) -> float:
        """Speed of degree ``t`` relative to ``T``: ``t eta(t) / (T eta(T))``."""
        return t * self.eta.get(t, 1.0) / (self.T * self.eta.get(self.T, 1.0))


def _read_job(instance: Instance) -> _Params:
    j = instance.job
    return _Params(
        T=int(j.tp),
        pp=int(j.pp),
        allowed=tuple(sorted(int(t) for t in j.tp_allowed)),
        dp_max=int(j.dp_max),
        mlb=int(j.max_local_batch),
        B=int(j.global_batch),
        fixed=j.batch_policy == "fixed",
        c=float(j.seq_time_s),
        eta={int(k): float(v) for k, v in j.tp_efficiency.items()},
        alpha=float(j.power_exponent),
        pmax=1.0 + float(j.max_boost),
        idle=float(j.idle_power_fraction),
        rho=float(j.reshard_overhead),
        mbs=int(j.micro_batch),
    )


# --------------------------------------------------------------------------------------------
# candidates: GPU classes, stages, replicas
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Class:
    """Healthy GPUs of one domain that the enumeration treats as interchangeable (R2)."""

    domain: int
    group: tuple[Hashable, float, float]  # (rack, tdp, limit): scope of the exchange (R3)
    speed: float
    tdp: float
    limit: float  # max_power_w / tdp (inf: no board limit)
    rack: int  # index into the power constraints
    gpus: tuple[Hashable, ...]


@dataclass(frozen=True)
class _StageCand:
    domain: int
    tp: int
    shape: tuple[tuple[int, int], ...]  # (class index, count > 0)
    speed: float  # slowest GPU
    watts: tuple[tuple[int, float], ...]  # (constraint index, TDP of its GPUs there)
    cap: float  # largest multiplier: min(P, the limits of its GPUs)


@dataclass(frozen=True)
class _ReplicaCand:
    tp: int
    stages: tuple[_StageCand, ...]
    usage: tuple[tuple[int, int], ...]  # (class index, GPUs taken), summed over stages


def _classes(cl: _Cluster, reduce: bool) -> list[_Class]:
    """Healthy GPUs grouped into classes; singletons unless ``reduce``.

    Within a domain, classes are ordered by (rack, TDP) group, then by
    decreasing speed, so that a fastest-first prefix of a group is a prefix
    of this order restricted to the group.
    """
    rack_index = {r: i for i, r in enumerate(cl.racks)}
    out: list[_Class] = []
    for di, d in enumerate(cl.domains):
        members = [x for x in cl.gpus.values() if x.domain == d and x.healthy]
        if reduce:
            keyed: dict[tuple[Hashable, float, float, float], list[Hashable]] = {}
            for x in members:
                keyed.setdefault((x.rack, x.tdp, x.max_w / x.tdp, x.speed), []).append(x.id)
            for (rack, tdp, lim, speed), ids in sorted(
                keyed.items(),
                key=lambda kv: (rack_index[kv[0][0]], kv[0][1], kv[0][2], -kv[0][3]),
            ):
                out.append(
                    _Class(di, (rack, tdp, lim), speed, tdp, lim, rack_index[rack], tuple(ids))
                )
        else:
            for x in members:
                lim = x.max_w / x.tdp
                out.append(
                    _Class(di, (x.id, x.tdp, lim), x.speed, x.tdp, lim, rack_index[x.rack], (x.id,))
                )
    return out


def _is_prefix(classes: Sequence[_Class], idx: Sequence[int], used: dict[int, int]) -> bool:
    """(R3): within each (rack, TDP) group of ``idx`` (ordered fastest first),
    a class may be used only if every faster class of the group is full."""
    open_groups: set[tuple[Hashable, float, float]] = set()  # groups with a non-full class
    for i in idx:
        k = classes[i]
        u = used.get(i, 0)
        if u and k.group in open_groups:
            return False
        if u < len(k.gpus):
            open_groups.add(k.group)
    return True


def _shapes(counts: Sequence[int], t: int) -> Iterator[tuple[int, ...]]:
    """Every vector ``x`` with ``0 <= x_i <= counts_i`` and ``sum x = t``."""
    if not counts:
        if t == 0:
            yield ()
        return
    rest = sum(counts[1:])
    for x0 in range(max(0, t - rest), min(counts[0], t) + 1):
        for tail in _shapes(counts[1:], t - x0):
            yield (x0, *tail)


def _stage_cands(
    classes: list[_Class], n_domains: int, p: _Params, reduce: bool, site: int
) -> dict[int, list[_StageCand]]:
    """Every stage (as a class count vector) of every allowed degree, per degree."""
    by_domain: list[list[int]] = [[] for _ in range(n_domains)]
    for i, k in enumerate(classes):
        by_domain[k.domain].append(i)
    out: dict[int, list[_StageCand]] = {t: [] for t in p.allowed}
    for d, idx in enumerate(by_domain):
        healthy = sum(len(classes[i].gpus) for i in idx)
        single_stage = healthy < 2 * p.allowed[0]  # the domain can host one stage at most
        for t in p.allowed:
            for x in _shapes([len(classes[i].gpus) for i in idx], t):
                shape = tuple((i, n) for i, n in zip(idx, x, strict=True) if n)
                if reduce and single_stage and not _is_prefix(classes, idx, dict(shape)):
                    continue  # (R3): this stage is the domain's whole usage
                watts: dict[int, float] = {}
                for i, n in shape:
                    watts[classes[i].rack] = watts.get(classes[i].rack, 0.0) + n * classes[i].tdp
                    watts[site] = watts.get(site, 0.0) + n * classes[i].tdp
                out[t].append(
                    _StageCand(
                        domain=d,
                        tp=t,
                        shape=shape,
                        speed=min(classes[i].speed for i, _ in shape),
                        watts=tuple(sorted(watts.items())),
                        cap=min([p.pmax, *(classes[i].limit for i, _ in shape)]),
                    )
                )
    return out


def _replica_cands(
    stage_cands: dict[int, list[_StageCand]], capacity: Sequence[int], pp: int
) -> list[_ReplicaCand]:
    """Every multiset of ``pp`` stage candidates of one degree that fits (R1)."""
    out: list[_ReplicaCand] = []
    used = [0] * len(capacity)

    def rec(t: int, cands: list[_StageCand], start: int, chosen: list[_StageCand]) -> None:
        if len(chosen) == pp:
            usage: dict[int, int] = {}
            for s in chosen:
                for i, n in s.shape:
                    usage[i] = usage.get(i, 0) + n
            out.append(_ReplicaCand(t, tuple(chosen), tuple(sorted(usage.items()))))
            return
        for j in range(start, len(cands)):
            s = cands[j]
            if all(used[i] + n <= capacity[i] for i, n in s.shape):
                for i, n in s.shape:
                    used[i] += n
                chosen.append(s)
                rec(t, cands, j, chosen)
                chosen.pop()
                for i, n in s.shape:
                    used[i] -= n

    for t in sorted(stage_cands):
        rec(t, stage_cands[t], 0, [])
    return out


# --------------------------------------------------------------------------------------------
# scoring one structure exactly
# --------------------------------------------------------------------------------------------


@cache
def _batch_vectors(n: int, mlb: int, total: int, fixed: bool) -> np.ndarray:
    """All ``b`` in ``[1, mlb]^n`` with ``sum b = total`` (fixed) or ``<= total``."""
    rows = [
        b
        for b in itertools.product(range(1, mlb + 1), repeat=n)
        if (sum(b) == total if fixed else sum(b) <= total)
    ]
    arr = np.array(rows, dtype=np.int64).reshape(len(rows), n)
    arr.setflags(write=False)
    return arr


@cache
def _batch_vectors_sym(
    n: int, mlb: int, total: int, fixed: bool, same: tuple[bool, ...]
) -> np.ndarray:
    """As :func:`_batch_vectors`, non-increasing across identical replicas (R2)."""
    arr = _batch_vectors(n, mlb, total, fixed)
    keep = np.ones(len(arr), dtype=bool)
    for j, s in enumerate(same):
        if s:  # replica j + 1 is the same candidate as replica j
            keep &= arr[:, j] >= arr[:, j + 1]
    out = arr[keep]
    out.setflags(write=False)
    return out


@dataclass(frozen=True)
class _Score:
    goodput: float
    total: int
    batches: tuple[int, ...]
    theta: float


class _Scorer:
    """Exact best goodput of a structure over its batch vectors (see the module doc)."""

    def __init__(
        self, p: _Params, budgets: np.ndarray, healthy_tdp: np.ndarray, launchable: bool = False
    ) -> None:
        self.p = p
        self.budgets = budgets
        self.healthy_tdp = healthy_tdp
        self.n_cons = len(budgets)
        self.launchable = launchable

    def vectors(self, n: int, same: tuple[bool, ...]) -> np.ndarray:
        """The batch vectors of ``n`` replicas the policy (and ``launchable``) allows."""
        p = self.p
        bm = _batch_vectors_sym(n, p.mlb, p.B, p.fixed, same)
        if self.launchable:  # one local batch, a multiple of the micro-batch
            bm = bm[(bm == bm[:, :1]).all(axis=1) & (bm[:, 0] % p.mbs == 0)]
        return bm

    def base(self, reps: Sequence[_ReplicaCand]) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-stage watts per constraint and the headroom at ``pi = 1`` (None: infeasible)."""
        stages = [s for r in reps for s in r.stages]
        w = np.zeros((self.n_cons, len(stages)))
        for k, s in enumerate(stages):
            for ci, watts in s.watts:
                w[ci, k] = watts
        used = w.sum(axis=1)
        slack = self.budgets - self.p.idle * self.healthy_tdp - (1.0 - self.p.idle) * used
        if np.any(slack < -BASE_TOL * (np.abs(self.budgets) + 1.0)):
            return None
        return w, np.maximum(slack, 0.0)

    def upper_bound(self, reps: Sequence[_ReplicaCand]) -> float:
        """Goodput no batch vector of this structure can exceed (see ``prune``).

        ``b_r / theta <= v_r^max / m`` for each replica, where ``v_r^max`` is
        its speed with every stage at ``pi = P``; and
        ``sum b / theta <= min(B, R mlb) / theta_min`` where ``theta_min`` is
        the step time of the slowest replica carrying one sequence at ``P``.
        """
        p = self.p
        m = 1.0 + p.rho if any(r.tp < p.T for r in reps) else 1.0
        vmax = [p.f(r.tp) * min(s.cap**p.alpha * s.speed for s in r.stages) / p.c for r in reps]
        by_speed = sum(vmax) / m
        theta_min = m * max(1.0 / v for v in vmax)
        by_batch = min(p.B, len(reps) * p.mlb) / theta_min
        return min(by_speed, by_batch)

    def best(self, reps: Sequence[_ReplicaCand], same: tuple[bool, ...]) -> _Score | None:
        """Best goodput of the structure ``reps`` over all its batch vectors."""
        p = self.p
        bm = self.vectors(len(reps), same)
        if not len(bm):
            return None
        base = self.base(reps)
        if base is None:
            return None
        w, slack = base
        m = 1.0 + p.rho if any(r.tp < p.T for r in reps) else 1.0
        stage_rep = np.array([j for j, r in enumerate(reps) for _ in r.stages])
        k = np.array([m * p.c / (p.f(r.tp) * s.speed) for r in reps for s in r.stages])
        a = bm[:, stage_rep] * k  # (vectors, stages): step time each stage imposes at pi = 1
        theta = a.max(axis=1)
        caps = np.array([s.cap for r in reps for s in r.stages])
        if p.alpha > 0.0 and caps.max() > 1.0:
            theta = (a / caps**p.alpha).max(axis=1)  # pi_k <= P_k
            inv = 1.0 / p.alpha
            used = w.sum(axis=1)
            for ci in range(self.n_cons):
                if used[ci] == 0.0 or slack[ci] >= float(w[ci] @ (caps - 1.0)):
                    continue  # boosting every stage to its cap fits: this budget never binds
                cols = np.flatnonzero(w[ci] > 0.0)
                ac = a[:, cols]
                order = np.argsort(-ac, axis=1, kind="stable")
                a_sorted = np.take_along_axis(ac, order, axis=1)
                w_sorted = w[ci, cols][order]
                top = a_sorted[:, :1]
                num = np.cumsum(w_sorted * (a_sorted / top) ** inv, axis=1)
                den = slack[ci] + np.cumsum(w_sorted, axis=1)
                theta = np.maximum(theta, top[:, 0] * (num / den).max(axis=1) ** p.alpha)
        return self._pick(bm, theta)

    def best_bisect(self, reps: Sequence[_ReplicaCand], same: tuple[bool, ...]) -> _Score | None:
        """As :meth:`best`, but ``theta*`` by bisection on the power rules themselves.

        A cross-check of the closed form: for a trial ``theta`` every stage
        gets ``pi_k = max(1, (a_k / theta)^(1/alpha))`` and the trial passes
        when every ``pi_k <= P`` and every rack and site draw is within budget.
        """
        p = self.p
        bm = self.vectors(len(reps), same)
        stages = [s for r in reps for s in r.stages]
        w = np.zeros((self.n_cons, len(stages)))
        for k, s in enumerate(stages):
            for ci, watts in s.watts:
                w[ci, k] = watts
        used = w.sum(axis=1)
        idle = p.idle * (self.healthy_tdp - used)
        limit = self.budgets * (1.0 + BASE_TOL) + BASE_TOL
        if not len(bm) or np.any(used + idle > limit):
            return None
        m = 1.0 + p.rho if any(r.tp < p.T for r in reps) else 1.0
        stage_rep = np.array([j for j, r in enumerate(reps) for _ in r.stages])
        k = np.array([m * p.c / (p.f(r.tp) * s.speed) for r in reps for s in r.stages])
        a = bm[:, stage_rep] * k
        hi = a.max(axis=1)  # pi = 1 everywhere: feasible (checked above)
        caps = np.array([s.cap for s in stages])
        if p.alpha == 0.0 or caps.max() == 1.0:
            return self._pick(bm, hi)
        lo = (a / caps**p.alpha).max(axis=1) * (1.0 - 1e-12)  # below this some pi_k > P_k

        def ok(theta: np.ndarray) -> np.ndarray:
            pi = np.maximum(1.0, (a / theta[:, None]) ** (1.0 / p.alpha))
            draw = pi @ w.T + idle
            return (pi <= caps).all(axis=1) & (draw <= self.budgets).all(axis=1)

        for _ in range(200):
            mid = 0.5 * (lo + hi)
            good = ok(mid)
            hi = np.where(good, mid, hi)
            lo = np.where(good, lo, mid)
            if np.all(hi - lo <= 1e-15 * hi):
                break
        return self._pick(bm, hi)

    @staticmethod
    def _pick(bm: np.ndarray, theta: np.ndarray) -> _Score:
        """The batch vector of best goodput (ties: the larger global batch)."""
        total = bm.sum(axis=1)
        good = total / theta
        g = good.max()
        near = np.flatnonzero(good >= g * (1.0 - 1e-13))
        i = int(near[np.argmax(total[near])])  # among ties, the larger global batch
        return _Score(float(good[i]), int(total[i]), tuple(int(x) for x in bm[i]), float(theta[i]))


# --------------------------------------------------------------------------------------------
# the planner
# --------------------------------------------------------------------------------------------


def brute_force(
    instance: Instance,
    *,
    reduce: bool = True,
    prune: bool = True,
    method: Literal["exact", "bisect"] = "exact",
    launchable: bool = False,
) -> tuple[float, Plan]:
    """Optimal goodput and one optimal plan, by exhaustive enumeration.

    Parameters
    ----------
    instance
        The instance (a few dozen GPUs at most: the enumeration is exponential).
    reduce
        Apply the symmetry and dominance reductions (R2) and (R3) of the module
        docstring; ``False`` enumerates every GPU subset (only (R1) remains).
    prune
        Skip structures whose upper bound does not beat the incumbent.
    method
        ``"exact"``: the closed-form optimal step time of each structure;
        ``"bisect"``: bisection on the power rules (slower; a cross-check).
    launchable
        Only plans Megatron-LM's NTP runtime can launch: the replicas below
        ``T`` share one degree, and every replica takes the same local batch,
        a multiple of ``job.micro_batch`` (the order of the replicas does not
        change goodput). The reductions keep degrees and batches, and the
        bound holds for every batch vector, so they stay valid.

    Returns
    -------
    tuple of float and Plan
        The optimal goodput (sequences per second; 0 when only the empty plan
        is feasible) and a plan reaching it, with metrics ``goodput``,
        ``relative_goodput`` and ``policy="bruteforce"``. Power multipliers
        are the smallest that reach the optimal step time.
    """
    p = _read_job(instance)
    cl = _read_cluster(instance)
    classes = _classes(cl, reduce)
    capacity = [len(k.gpus) for k in classes]
    site = len(cl.racks)
    stage_cands = _stage_cands(classes, len(cl.domains), p, reduce, site)
    cands = _replica_cands(stage_cands, capacity, p.pp)

    budgets = np.array([cl.rack_budget[r] for r in cl.racks] + [cl.site_budget])
    healthy_tdp = np.zeros(site + 1)
    rack_index = {r: i for i, r in enumerate(cl.racks)}
    for x in cl.gpus.values():
        if x.healthy:
            healthy_tdp[rack_index[x.rack]] += x.tdp
            healthy_tdp[site] += x.tdp
    scorer = _Scorer(p, budgets, healthy_tdp, launchable)
    domain_classes: list[list[int]] = [[] for _ in cl.domains]
    for i, k in enumerate(classes):
        domain_classes[k.domain].append(i)

    best_g = 0.0
    best: tuple[tuple[int, ...], _Score] | None = None
    used = [0] * len(classes)
    chosen: list[int] = []
    max_replicas = min(p.dp_max, p.B)  # every replica carries at least one sequence

    def visit() -> None:
        nonlocal best_g, best
        reps = [cands[i] for i in chosen]
        if launchable and len({r.tp for r in reps if r.tp < p.T}) > 1:
            return  # two reduced degrees: the runtime has one tp_spares
        if reduce:
            touched = {classes[i].domain for r in reps for i, _ in r.usage}
            usage = {i: used[i] for d in touched for i in domain_classes[d] if used[i]}
            if not all(_is_prefix(classes, domain_classes[d], usage) for d in touched):
                return  # (R3)
        if prune and scorer.upper_bound(reps) <= best_g:
            return
        same = tuple(chosen[j] == chosen[j + 1] for j in range(len(chosen) - 1))
        score = scorer.best(reps, same) if method == "exact" else scorer.best_bisect(reps, same)
        if score is not None and score.goodput > best_g:
            best_g, best = score.goodput, (tuple(chosen), score)

    def rec(start: int) -> None:
        if chosen:
            visit()
        if len(chosen) == max_replicas:
            return
        for j in range(start, len(cands)):
            usage = cands[j].usage
            if all(used[i] + n <= capacity[i] for i, n in usage):
                for i, n in usage:
                    used[i] += n
                chosen.append(j)
                rec(j)  # j again: a candidate may repeat when its classes allow (R2)
                chosen.pop()
                for i, n in usage:
                    used[i] -= n

    rec(0)
    if best is None:
        plan = Plan(
            instance.name,
            (),
            {"goodput": 0.0, "relative_goodput": 0.0, "policy": "bruteforce"},
        )
        return 0.0, plan
    return best_g, _write_plan(instance, cl, classes, p, [cands[i] for i in best[0]], best[1])


def _write_plan(
    instance: Instance,
    cl: _Cluster,
    classes: list[_Class],
    p: _Params,
    reps: list[_ReplicaCand],
    score: _Score,
) -> Plan:
    """Turn the best structure into a plan: GPU ids in graph order, smallest powers."""
    m = 1.0 + p.rho if any(r.tp < p.T for r in reps) else 1.0
    nxt = [0] * len(classes)
    replicas = []
    for r, b in zip(reps, score.batches, strict=True):
        stages = []
        for s in r.stages:
            ids: list[Hashable] = []
            for i, n in s.shape:
                ids += classes[i].gpus[nxt[i] : nxt[i] + n]
                nxt[i] += n
            a = m * b * p.c / (p.f(r.tp) * s.speed)
            power = 1.0
            if p.alpha > 0.0 and a > score.theta:
                power = min(s.cap, (a / score.theta) ** (1.0 / p.alpha))
            stages.append(Stage(cl.domains[s.domain], tuple(ids), power))
        replicas.append(Replica(r.tp, b, tuple(stages)))
    g = score.goodput
    metrics = {"goodput": g, "relative_goodput": g * p.c / instance.job.dp, "policy": "bruteforce"}
    return Plan(instance.name, tuple(replicas), metrics)


# --------------------------------------------------------------------------------------------
# an independent check of any plan
# --------------------------------------------------------------------------------------------


def plan_figures(instance: Instance, plan: Plan) -> tuple[float, list[str]]:
    """Goodput of ``plan`` and the model rules it breaks, from the graph alone.

    Parameters
    ----------
    instance
        The instance.
    plan
        Any plan for it.

    Returns
    -------
    tuple of float and list of str
        Goodput by the formula of docs/model.md, spec section 3 (0 for the empty plan) and
        one message per broken rule (empty when the plan is feasible). Budgets
        and power ranges are checked with a relative tolerance of 1e-9.
    """
    p = _read_job(instance)
    cl = _read_cluster(instance)
    problems: list[str] = []
    if len(plan.replicas) > p.dp_max:
        problems.append(f"{len(plan.replicas)} replicas > dp_max {p.dp_max}")
    draw: dict[Hashable, float] = {}
    seen: set[Hashable] = set()
    speeds: list[float] = []
    for r, rep in enumerate(plan.replicas):
        if rep.tp not in p.allowed:
            problems.append(f"replica {r}: degree {rep.tp} not allowed")
        b = rep.local_batch
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= p.mlb:
            problems.append(f"replica {r}: batch {b!r}")
        if len(rep.stages) != p.pp:
            problems.append(f"replica {r}: {len(rep.stages)} stages")
        slowest_stage = math.inf
        for k, st in enumerate(rep.stages):
            if not 1.0 - CHECK_TOL <= st.power <= p.pmax * (1 + CHECK_TOL):
                problems.append(f"replica {r} stage {k}: power {st.power}")
            if len(st.gpus) != rep.tp:
                problems.append(f"replica {r} stage {k}: {len(st.gpus)} GPUs")
            slowest = math.inf
            for gid in st.gpus:
                x = cl.gpus.get(gid)
                if x is None or not x.healthy or x.domain != st.domain or gid in seen:
                    problems.append(f"replica {r} stage {k}: GPU {gid!r} unusable")
                    continue
                seen.add(gid)
                draw[gid] = x.tdp * st.power
                if x.tdp * st.power > x.max_w * (1 + CHECK_TOL):
                    problems.append(f"replica {r} stage {k}: GPU {gid!r} above its max_power_w")
                slowest = min(slowest, x.speed)
            slowest_stage = min(slowest_stage, st.power**p.alpha * slowest)
        speeds.append(p.f(rep.tp) * slowest_stage / p.c)
    for x in cl.gpus.values():
        if x.id not in draw:
            draw[x.id] = x.tdp * p.idle if x.healthy else 0.0
    for rack in cl.racks:
        w = sum(draw[x.id] for x in cl.gpus.values() if x.rack == rack)
        if w > cl.rack_budget[rack] * (1 + CHECK_TOL):
            problems.append(f"rack {rack!r} draws {w} W > {cl.rack_budget[rack]} W")
    if sum(draw.values()) > cl.site_budget * (1 + CHECK_TOL):
        problems.append(f"site draws {sum(draw.values())} W > {cl.site_budget} W")
    if not plan.replicas:
        return 0.0, problems
    total = sum(rep.local_batch for rep in plan.replicas)
    if (total != p.B) if p.fixed else (total > p.B):
        problems.append(f"batches sum to {total} (B = {p.B}, {'fixed' if p.fixed else 'elastic'})")
    m = 1.0 + p.rho if any(rep.tp < p.T for rep in plan.replicas) else 1.0
    theta = m * max(rep.local_batch / v for rep, v in zip(plan.replicas, speeds, strict=True))
    return total / theta, problems
