"""Cheap upper bounds on goodput, valid for every plan.

:func:`gpu_bound`: every healthy GPU at its best power.

A replica's speed is at most the average over its ``t pp`` GPUs of
``pi^alpha s`` times ``f(t) / (t pp c)``, so the total speed of any plan is at
most ``phi / (pp c) * sum_g pi_g^alpha s_g`` over the GPUs it uses, with
``phi = max_t f(t) / t``. The site budget limits ``sum_g tdp_g (pi_g - idle)``.
Lagrangian duality on that budget gives a bound for every multiplier; the
best one is found by bisection. Goodput never exceeds total speed (each
replica's batch is at most ``theta v_r``), nor ``dp_max`` replicas at the
fastest possible speed. Rack budgets are left out, which keeps it valid.
Each GPU's multiplier is capped by :attr:`ntp_opt.model.instance.Instance.max_multiplier`
(``1 + max_boost``, or less where its board accepts less); in the stage
bound a domain's stages are capped by the largest cap among its healthy GPUs
(a stage's true cap, the smallest of its GPUs', is never above it).

:func:`stage_bound` adds the stage structure of each domain and the
resharding overhead (see its docstring); :func:`capacity_bound` takes the
smaller of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.rules.power import budget_limit, budget_slack, extra_draw, idle_draw
from ntp_opt.rules.tolerances import BUDGET_SLACK, POWER_TOL


def capacity_bound(instance: Instance) -> float:
    """Upper bound on the goodput (sequences per second) of any plan.

    The smaller of :func:`gpu_bound` and :func:`stage_bound`.

    Parameters
    ----------
    instance
        The instance.

    Returns
    -------
    float
    """
    return min(gpu_bound(instance), stage_bound(instance))


def gpu_bound(instance: Instance) -> float:
    """Upper bound on goodput: every healthy GPU at its best power (module docstring).

    Parameters
    ----------
    instance
        The instance.

    Returns
    -------
    float
    """
    job = instance.job
    a = instance.arrays
    if not a.healthy.any():
        return 0.0
    # GPUs with the same speed, TDP and cap are interchangeable: aggregate them
    s_vals, s_idx = np.unique(a.speed[a.healthy], return_inverse=True)
    w_vals, w_idx = np.unique(a.tdp[a.healthy], return_inverse=True)
    c_vals, c_idx = np.unique(instance.max_multiplier[a.healthy], return_inverse=True)
    nw, nc = len(w_vals), len(c_vals)
    keys, n = np.unique((s_idx * nw + w_idx) * nc + c_idx, return_counts=True)
    sw, n = keys // nc, n.astype(float)
    s, w, cap = s_vals[sw // nw], w_vals[sw % nw], c_vals[keys % nc]
    alpha = job.power_exponent
    idle = job.idle_power_fraction
    room = a.site_budget - float((w * n * idle).sum()) + budget_slack(a.site_budget)
    hi = cap * (1 + POWER_TOL)  # per group: 1 + max_boost, or its boards' limit
    phi = max(job.tp_factor(t) / t for t in job.allowed)
    v_max = max(job.tp_factor(t) for t in job.allowed) * float(s.max()) * float(hi.max()) ** alpha
    replicas_cap = job.replicas_max * v_max / job.seq_time_s

    def best_pi(lam: float) -> np.ndarray:
        if alpha <= 0 or job.max_boost <= 0 or lam <= 0:
            return hi.copy() if lam <= 0 and alpha > 0 else np.ones(len(s))
        if alpha >= 1:  # convex or linear in pi: the best is an end point
            return np.where(s * hi**alpha - lam * w * hi > s - lam * w, hi, 1.0)
        pi = (alpha * s / (lam * w)) ** (1.0 / (1.0 - alpha))
        return np.clip(pi, 1.0, hi)

    def dual(lam: float) -> tuple[float, float]:
        pi = best_pi(lam)
        gain = s * pi**alpha - extra_draw(lam * w, pi, idle)
        on = gain > 0
        used = float(extra_draw(n * w, pi, idle)[on].sum())
        return lam * room + float((n * gain)[on].sum()), room - used

    # D is convex in lambda; its slope is `room - used watts`, increasing in lambda
    value, slope = dual(0.0)
    if slope >= 0:
        best = value
    else:
        lo, hi_lam = 0.0, 1.0
        while dual(hi_lam)[1] < 0:
            hi_lam *= 2
        for _ in range(100):
            mid = 0.5 * (lo + hi_lam)
            if dual(mid)[1] < 0:
                lo = mid
            else:
                hi_lam = mid
        best = min(dual(lo)[0], dual(hi_lam)[0])
    speed_sum = best * phi / (job.pp * job.seq_time_s)
    return float(min(speed_sum, replicas_cap))


def _usable(h: int, degrees: tuple[int, ...]) -> int:
    """Most GPUs ``h`` healthy GPUs can give to stages of the given degrees."""
    reach = np.zeros(h + 1, dtype=bool)
    reach[0] = True
    for n in range(1, h + 1):
        reach[n] = any(t <= n and reach[n - t] for t in degrees)
    return int(np.flatnonzero(reach).max())


def stage_bound(instance: Instance, only: tuple[int, ...] | None = None) -> float:
    """A tighter upper bound: per-domain stage structure and the resharding overhead.

    Any plan either runs every replica at the nominal degree ``T`` (case A:
    no resharding overhead, only ``T``-stages, at most
    ``floor(sum_d floor(h_d / T) / pp)`` replicas) or has a reduced replica
    (case B: every replica pays ``1 + rho``). Goodput is at most the sum of
    replica speeds divided by that factor, and a replica's speed is at most
    the mean over its stages of ``f(t) pi^alpha m / c`` (``m``: the stage's
    slowest GPU). In each case the sum is bounded by a Lagrangian relaxation
    of the site power budget (multiplier ``lambda``) and of the GPU count
    ``dp_max pp T`` (multiplier ``mu``), solved per domain class:

    * a domain that can host only one stage (fewer than ``2 min(degrees)``
      healthy GPUs) takes the best single stage, ``m`` being the ``t``-th
      fastest speed and its power the ``t`` smallest TDPs (exact for one
      stage);
    * a domain that can host several stages is relaxed per GPU, over its
      ``u`` fastest GPUs (``u``: the most GPUs whole stages can use), each at
      the domain's smallest TDP.

    Rack budgets and batch integrality are left out, which keeps it valid.
    Every ``(lambda, mu) >= 0`` gives a bound; the search over them only
    tightens it.

    Parameters
    ----------
    instance
        The instance.
    only
        Bound only the plans of one case: ``(job.tp,)`` (case A) or
        ``job.allowed`` (case B); ``None``: every plan.

    Returns
    -------
    float
        Upper bound on goodput (sequences per second).
    """
    return _stage_bound(instance, only=only)


DualPoints = dict[tuple[int, ...], tuple[float, float]]
"""Per case of :func:`stage_bound` (its degrees), multipliers ``(lambda, mu)``."""

FixedSpeeds = dict[tuple[int, ...], dict[int, float]]
"""Per case of :func:`stage_bound` (its degrees), the ``fixed`` refinement's speed
bounds ``u_k`` by rank ``k`` (a speed at which ``k`` replicas cannot all run:
valid for any later instance that it still does not fit)."""


def stage_bound_point(
    instance: Instance, rows: DomainRows | None = None, fixed: FixedSpeeds | None = None
) -> tuple[float, DualPoints]:
    """:func:`stage_bound`, and per case the multipliers whose dual gave its value.

    ``rows``: ``domain_rows(instance)``, when known. ``fixed``: receives, for
    a ``fixed`` job, the speed bounds of the refinement per case where it
    was computed (:func:`stage_bound_at` starts from them); the value is the
    same with or without it.

    Returns
    -------
    tuple of (float, DualPoints)
        The bound (the same number as :func:`stage_bound`) and the points
        :func:`stage_bound_at` takes.
    """
    points: DualPoints = {}
    return _stage_bound(instance, record=points, rows_in=rows, fixed_out=fixed), points


def stage_bound_at(
    instance: Instance,
    points: DualPoints,
    rows: DomainRows | None = None,
    fixed: FixedSpeeds | None = None,
    fixed_out: FixedSpeeds | None = None,
) -> float:
    """A valid upper bound from given multipliers: no search (re-planning's incremental bound).

    Every ``(lambda, mu) >= 0`` gives a bound (:func:`stage_bound`), so the
    dual of ``instance`` at the multipliers another instance's
    :func:`stage_bound_point` found (an instance a few events ago) bounds
    every plan of ``instance``. It is close to ``stage_bound(instance)``
    when the instances differ little (above it as a rule; below only by the
    search's resolution, where the given point beats the searched one; the
    ``fixed`` refinement is left out); a case with no point is searched as
    usual.

    Parameters
    ----------
    instance
        The instance.
    points
        Multipliers per case (:func:`stage_bound_point`).
    rows
        ``domain_rows(instance)``, when known (re-planning keeps them up to
        date with :func:`domain_rows_after`).
    fixed
        For a ``fixed`` job, speed bounds of the ``fixed`` refinement kept
        from an earlier instance (:func:`stage_bound_point`, or ``fixed_out``
        of an earlier call): with them the refinement is added without its
        search. Each kept ``u_k`` is re-checked on ``instance`` at a few
        speeds around it (``u_k (1 +- 1e-6 .. 1e-3)``, all at once); where
        one fits and the next does not, the latter is this instance's bound
        for rank ``k`` (the fit only gets harder as the speed grows); a rank
        the steps do not bracket is bisected as usual. ``None``: the
        refinement is left out, as before.
    fixed_out
        Receives the speed bounds used (to pass as ``fixed`` next time).

    Returns
    -------
    float
    """
    return _stage_bound(instance, at=points, rows_in=rows, fixed_in=fixed, fixed_out=fixed_out)


@dataclass(frozen=True, eq=False)
class DomainRows:
    """Per domain, what :func:`stage_bound` classifies it by (its *row*).

    ``key[d]``: the healthy GPU count, the healthy speeds descending and TDPs
    ascending (zero-padded to ``width`` columns each), and the largest
    multiplier cap (with the validator's tolerance). Domains with equal rows
    form one class. Kept by re-planning, which recomputes only the rows of
    the domains an event touches (:func:`domain_rows_after`), and with
    them the classes (:meth:`classes`).
    """

    key: np.ndarray
    width: int
    known: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    """The classes (:meth:`classes`) and each domain's class, once computed."""

    def classes(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct rows (lexicographic order) and how many domains have each.

        ``np.unique(key, axis=0, return_counts=True)`` (``-0.0`` read as
        ``0.0``), computed once and kept; :func:`domain_rows_after` updates
        them for the domains it recomputes.
        """
        if self.known is None:
            object.__setattr__(self, "known", _row_classes(self.key))
        assert self.known is not None
        return self.known[0], self.known[1]

    def domain_class(self) -> np.ndarray:
        """Each domain's class (an index into :meth:`classes`)."""
        self.classes()
        assert self.known is not None
        return self.known[2]


def domain_rows(instance: Instance) -> DomainRows:
    """Every domain's row (:class:`DomainRows`)."""
    job = instance.job
    a = instance.arrays
    ok = a.healthy
    # per domain: the largest cap of its healthy GPUs bounds every stage's multiplier
    dom_cap = np.ones(a.n_domains)
    if job.power_exponent > 0:
        np.maximum.at(dom_cap, a.gpu_domain[ok], instance.max_multiplier[ok])
    dom_hi = dom_cap * (1 + POWER_TOL)
    # per domain: healthy speeds descending and TDPs ascending, zero-padded
    dom = a.gpu_domain[ok]
    spd = a.speed[ok]
    tdp = a.tdp[ok]
    h = np.bincount(dom, minlength=a.n_domains)
    width = max(int(h.max(initial=0)), job.tp)  # every degree indexes a column
    starts = np.concatenate(([0], np.cumsum(h)[:-1]))
    by_speed = np.lexsort((-spd, dom))
    pos = np.arange(len(dom)) - starts[dom[by_speed]]
    speeds = np.zeros((a.n_domains, width))
    speeds[dom[by_speed], pos] = spd[by_speed]
    by_tdp = np.lexsort((tdp, dom))
    tdps = np.zeros((a.n_domains, width))
    tdps[dom[by_tdp], np.arange(len(dom)) - starts[dom[by_tdp]]] = tdp[by_tdp]
    key = np.hstack([h[:, None].astype(float), speeds, tdps, dom_hi[:, None]])
    return DomainRows(key, width)


def domain_rows_after(instance: Instance, rows: DomainRows, domains: list[int]) -> DomainRows:
    """``rows`` with the rows of ``domains`` recomputed from ``instance`` (copy-on-write).

    Equal to ``domain_rows(instance)`` when only those domains changed
    (their health, speeds, caps or TDPs); recomputed in full when a domain
    outgrows the width.
    """
    job = instance.job
    a = instance.arrays
    width = rows.width
    key = rows.key.copy()
    domains = sorted(set(domains))
    for d in domains:
        members = a.domain_gpus[d]
        live = members[a.healthy[members]]
        n = len(live)
        if n > width:
            return domain_rows(instance)
        cap = 1.0
        if job.power_exponent > 0 and n:
            cap = max(1.0, float(instance.max_multiplier[live].max()))
        row = np.zeros(2 * width + 2)
        row[0] = n
        row[1 : 1 + n] = np.sort(a.speed[live])[::-1]
        row[1 + width : 1 + width + n] = np.sort(a.tdp[live])
        row[-1] = cap * (1 + POWER_TOL)
        key[d] = row
    if width > job.tp and not (key[:, 0] == width).any():
        return domain_rows(instance)  # the widest domain shrank: the width with it
    if not domains:
        return DomainRows(key, width, rows.known)
    if rows.known is None:
        return DomainRows(key, width)
    # the classes: the old ones less the recomputed domains, plus their new rows
    old_class = rows.domain_class()
    reps, counts = rows.classes()
    counts = counts.copy()
    np.subtract.at(counts, old_class[domains], 1)
    idx: list[int] = []
    extra: list[np.ndarray] = []
    for row in key[domains] + 0.0:
        hit = np.flatnonzero((reps == row).all(axis=1))
        if hit.size:
            idx.append(int(hit[0]))
            continue
        j = next((j for j, r in enumerate(extra) if np.array_equal(r, row)), len(extra))
        if j == len(extra):
            extra.append(row)
        idx.append(len(reps) + j)
    cand = np.vstack([reps, *extra]) if extra else reps
    total = np.concatenate([counts, np.zeros(len(extra), dtype=counts.dtype)])
    np.add.at(total, idx, 1)
    alive = np.flatnonzero(total > 0)
    order = np.lexsort(cand[alive].T[::-1])  # first column most significant
    renumber = np.full(len(cand), -1, dtype=np.int64)
    renumber[alive[order]] = np.arange(len(order))
    of = renumber[old_class]
    of[domains] = renumber[idx]
    return DomainRows(key, width, (cand[alive[order]], total[alive[order]], of))


def _stage_bound(
    instance: Instance,
    *,
    record: DualPoints | None = None,
    at: DualPoints | None = None,
    rows_in: DomainRows | None = None,
    only: tuple[int, ...] | None = None,
    fixed_in: FixedSpeeds | None = None,
    fixed_out: FixedSpeeds | None = None,
) -> float:
    """:func:`stage_bound`; ``record`` receives each case's multipliers, ``at`` gives
    them; ``rows_in``: the instance's :func:`domain_rows`, when known; ``only``: one
    case's degrees; ``fixed_in`` / ``fixed_out``: the ``fixed`` refinement's speed
    bounds kept / used (:func:`stage_bound_at`; with ``at``, ``fixed_in`` adds the
    refinement)."""
    job = instance.job
    a = instance.arrays
    alpha = job.power_exponent
    idle = job.idle_power_fraction
    c = job.seq_time_s
    ok = a.healthy
    if not ok.any():
        return 0.0
    room = a.site_budget - float(idle_draw(instance)[ok].sum()) + budget_slack(a.site_budget)
    if room < 0:
        return 0.0
    if rows_in is None:
        rows_in = domain_rows(instance)
    width = rows_in.width
    rows, counts = rows_in.classes()
    h_cls = rows[:, 0].astype(np.int64)
    s_cls = rows[:, 1 : 1 + width]
    w_cls = rows[:, 1 + width : 1 + 2 * width]
    hi = rows[:, -1]  # per class
    cum_w = np.concatenate([np.zeros((len(rows), 1)), np.cumsum(w_cls, axis=1)], axis=1)
    cases: list[tuple[tuple[int, ...], float]] = [((job.tp,), 1.0)]
    reduced = tuple(t for t in job.allowed if t < job.tp)
    if reduced:
        cases.append((job.allowed, 1.0 + job.reshard_overhead))
    if only is not None:
        cases = [case for case in cases if case[0] == only]
    best = 0.0
    s_max = float(a.speed[ok].max())
    hi_max = float(hi.max())
    classes = (h_cls, s_cls, w_cls, cum_w)
    h_all = rows_in.key[:, 0].astype(np.int64)
    fixed_first = job.batch_policy == "fixed" and at is None

    def replicas_of(degrees: tuple[int, ...]) -> int:
        if degrees == (job.tp,):
            slots = int((h_all // job.tp).sum())
            return min(job.replicas_max, slots // job.pp)
        return job.replicas_max

    for degrees, factor in reversed(cases):  # case B first: it usually decides
        fixed: float | None = None
        if at is not None and degrees in at:
            value = _case_bound(
                job, degrees, h_cls, s_cls, w_cls, cum_w, counts, room, hi, idle, at=at[degrees]
            )
        else:
            # a quick valid bound for the case first; refine only if it could matter
            found: list[tuple[float, float]] = []
            shared: dict[str, float] = {}  # the mu = 0 search, done once for both
            args = (job, degrees, h_cls, s_cls, w_cls, cum_w, counts, room, hi, idle)
            quick = _case_bound(*args, False, found=found, shared=shared)
            if record is not None and found:
                record[degrees] = (float(found[-1][0]), float(found[-1][1]))
            if quick / factor <= best:
                continue
            if fixed_first and record is None:
                # the case is at most its fixed bound: when that cannot beat
                # ``best``, neither can the refined value (the same result)
                fixed = _fixed_case_bound(
                    job, degrees, factor, replicas_of(degrees), *classes, counts, room, hi
                )
                if fixed <= best:
                    continue
            value = _case_bound(*args, found=found, shared=shared)
            if record is not None and found:
                record[degrees] = (float(found[-1][0]), float(found[-1][1]))
        replicas = replicas_of(degrees)
        v_top = max(job.tp_factor(t) for t in degrees) * s_max * hi_max**alpha / c
        case = min(value, replicas * v_top) / factor
        if job.batch_policy == "fixed" and case > best and at is None:
            if fixed is None:
                fixed = _fixed_case_bound(
                    job,
                    degrees,
                    factor,
                    replicas,
                    *classes,
                    counts,
                    room,
                    hi,
                    out=None if fixed_out is None else fixed_out.setdefault(degrees, {}),
                )
            case = min(case, fixed)
        elif job.batch_policy == "fixed" and case > best and fixed_in is not None:
            # re-planning: the refinement from the kept speed bounds (valid)
            case = min(
                case,
                _fixed_case_bound(
                    job,
                    degrees,
                    factor,
                    replicas,
                    *classes,
                    counts,
                    room,
                    hi,
                    kept=fixed_in.get(degrees, {}),
                    out=None if fixed_out is None else fixed_out.setdefault(degrees, {}),
                ),
            )
        best = max(best, case)
    return float(best)


_SPARSE_POWERS = 4096
"""From this many options x points on, the dual takes powers only between the
clips (speed only: the same numbers either way)."""

_BATCH = 8192
"""About how many numbers one batched evaluation handles: look-ahead grows
while the work per call stays near numpy's fixed cost per call (speed only)."""


_PY_MIDPOINTS = 256
"""Up to this many midpoints per call are computed as Python floats (speed only)."""


def _midpoints(los: list[float], ups: list[float], depth: int) -> list[list[float]]:
    """Per interval ``[los[i], ups[i]]``: every midpoint the next ``depth`` bisection
    steps can visit, level by level (heap order), one row per interval.

    A few midpoints as Python floats (``0.5 * (lo + up)`` is the same IEEE
    double numpy gives, without numpy's fixed cost per call); many with numpy."""
    if len(los) * (2**depth - 1) > _PY_MIDPOINTS:
        lo_l = np.array(los)[:, None]
        up_l = np.array(ups)[:, None]
        levels = []
        for _ in range(depth):
            mid = 0.5 * (lo_l + up_l)
            levels.append(mid)
            lo_l = np.stack([lo_l, mid], axis=2).reshape(len(los), -1)
            up_l = np.stack([mid, up_l], axis=2).reshape(len(los), -1)
        rows: list[list[float]] = np.concatenate(levels, axis=1).tolist()
        return rows
    out = []
    for lo, up in zip(los, ups, strict=True):
        row: list[float] = []
        level = [(lo, up)]
        for _ in range(depth):
            nxt = []
            for a, b in level:
                m = 0.5 * (a + b)
                row.append(m)
                nxt += [(a, m), (m, b)]
            level = nxt
        out.append(row)
    return out


def _depth(per_point: int, searches: int, most: int = 8) -> int:
    """Look-ahead depth: the most bisection steps whose every midpoint fits one batch."""
    d = 1
    while d < most and (2 ** (d + 1) - 1) * per_point * searches <= _BATCH:
        d += 1
    return d


def _unique_rows(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(key, axis=0, return_counts=True)`` for a float matrix, faster
    (:func:`_row_classes` without the inverse)."""
    rows, counts, _ = _row_classes(key)
    return rows, counts


def _row_classes(key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(key, axis=0, return_counts=True, return_inverse=True)``, faster.

    The same rows in the same (lexicographic) order with the same counts,
    and each row's class: rows are grouped by a hash of their bits
    (checked; on a collision the plain ``np.unique`` answers), and only the
    distinct rows are sorted. ``-0.0`` is read as ``0.0``.
    """
    key = np.ascontiguousarray(key + 0.0)  # -0.0 -> 0.0: equal rows, equal bits
    n, m = key.shape
    if n == 0 or m == 0:
        rows, inv, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
        return rows, counts, inv.reshape(-1)
    bits = key.view(np.uint64)
    mult = np.arange(1, 2 * m, 2, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    mult |= np.uint64(1)
    hashed = (bits * mult).sum(axis=1, dtype=np.uint64)  # wraps: a hash, checked below
    _, first, inverse = np.unique(hashed, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    reps = key[first]
    if not np.array_equal(reps[inverse], key):
        rows, inv, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
        return rows, counts, inv.reshape(-1)
    order = np.lexsort(reps.T[::-1])  # first column most significant
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return reps[order], np.bincount(inverse, minlength=len(reps))[order], rank[inverse]


def _masked_row_sums(on: np.ndarray, *xs: np.ndarray) -> list[np.ndarray]:
    """Per ``x`` in ``xs`` and per row, ``x[row][on[row]].sum()``: bit for bit, numpy's own sum.

    Rows with the same number of selected entries are summed together as a
    contiguous matrix, which numpy reduces row by row exactly as a 1-D array
    (the same pairwise order).
    """
    outs = [np.zeros(on.shape[0]) for _ in xs]
    counts = on.sum(axis=1)
    present = np.flatnonzero(np.bincount(counts, minlength=1)).tolist()
    for c in present:
        if c == 0:
            continue
        if len(present) == 1:  # every row selects c entries
            for out, x in zip(outs, xs, strict=True):
                out[:] = x[on].reshape(on.shape[0], c).sum(axis=1)
            break
        rows = np.flatnonzero(counts == c)
        sel = on[rows]
        for out, x in zip(outs, xs, strict=True):
            out[rows] = x[rows][sel].reshape(len(rows), c).sum(axis=1)
    return outs


_FIXED_LADDER = (-1e-3, -1e-4, -1e-5, -1e-6, 0.0, 1e-6, 1e-5, 1e-4, 1e-3)
"""Relative steps around a kept speed bound at which :func:`_fixed_case_bound`
re-checks it (ascending)."""


def _fixed_case_bound(
    job: Job,
    degrees: tuple[int, ...],
    factor: float,
    replicas: int,
    h: np.ndarray,
    speeds: np.ndarray,
    tdps: np.ndarray,
    cum_w: np.ndarray,
    counts: np.ndarray,
    room: float,
    hi: np.ndarray,
    *,
    kept: dict[int, float] | None = None,
    out: dict[int, float] | None = None,
) -> float:
    """Bound for the ``fixed`` policy from the speed of the ``k``-th fastest replica.

    Goodput is ``B / theta`` with ``sum_r min(b_max, theta v_r / F) >= B``.
    The ``k``-th fastest replica runs at speed ``tau`` only if ``k pp``
    stages run at ``tau`` or faster, all at once: the cheapest ``k pp``
    stage candidates lifted to ``tau`` must fit the site's power room. That
    bounds ``v_(k)`` by ``u_k`` (bisection on ``tau``), on a grid of ``k``
    (``u`` is non-increasing in ``k``, so a grid point bounds the ranks above
    it). Stage candidates: a single-stage domain offers its best degree-``t``
    stage (``t``-th fastest speed, ``t`` smallest TDPs); a domain with room
    for several stages offers ``h // min(degrees)`` stages at its fastest
    speed and smallest TDP (an over-estimate, so still valid).

    ``kept``: speed bounds ``u_k`` from an earlier instance (re-planning); each
    is re-checked at :data:`_FIXED_LADDER` around it instead of bisected:
    where a step fits and the next does not, the latter bounds ``v_(k)``
    (fitting only gets harder as ``tau`` grows); a rank the steps do not
    bracket is bisected. The step time is then solved directly, a hair low
    (:func:`_carry_time`, :data:`_CARRY_MARGIN`): the value may exceed the
    searched one by about ``1e-12``, never fall below what is valid. ``out``
    receives the ``u_k`` used.
    """
    alpha = job.power_exponent
    idle = job.idle_power_fraction
    single = h < 2 * min(degrees)
    val = np.stack(
        [np.where(single & (h >= t), job.tp_factor(t) * speeds[:, t - 1], 0.0) for t in degrees],
        axis=1,
    )
    watts = np.stack([cum_w[:, t] for t in degrees], axis=1)
    multi = ~single
    m_val = max(job.tp_factor(t) for t in degrees) * speeds[:, 0]
    m_w = min(degrees) * np.where(multi, tdps[:, 0], 1.0)
    m_cnt = np.where(multi, counts * (h // min(degrees)), 0)
    top = float(max(val.max(initial=0.0), m_val[multi].max(initial=0.0))) * float(hi.max()) ** alpha

    def cost(v: np.ndarray, w: np.ndarray, tau: np.ndarray, hi: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            if alpha > 0:
                pi = np.maximum(1.0, (tau / v) ** (1.0 / alpha))
            else:
                pi = np.where(v >= tau, 1.0, np.inf)
        pi = np.where(v > 0, pi, np.inf)
        return np.where(
            pi <= hi * (1 + BUDGET_SLACK), extra_draw(w, np.minimum(pi, hi), idle), np.inf
        )

    k_all = np.concatenate([counts[single], m_cnt[multi]]).astype(float)
    limit = budget_limit(room, tol=BUDGET_SLACK, slack=0.0)
    # cost is element-wise: the single-stage classes' costs once per distinct
    # option row (values, watts, cap), gathered back (the same numbers)
    _, first, row_of = np.unique(
        np.hstack([val[single], watts[single], hi[single, None]]),
        axis=0,
        return_index=True,
        return_inverse=True,
    )
    row_of = row_of.reshape(-1)
    s_val, s_w, s_hi = val[single][first], watts[single][first], hi[single][first]
    m_val_m, m_w_m, m_hi = m_val[multi], m_w[multi], hi[multi]

    def feasible_many(tau: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Whether ``n`` stages at speed ``tau`` or faster fit the power room, per point.

        Bit for bit what one point alone gives: the same element-wise
        costs, the same stable order, and numpy's own sum of the costs taken.
        """
        parts = []
        if len(s_val):
            c1 = cost(s_val[None], s_w[None], tau[:, None, None], s_hi[None, :, None])
            parts.append(c1.min(axis=2)[:, row_of])
        if len(m_val_m):
            parts.append(cost(m_val_m[None], m_w_m[None], tau[:, None], m_hi[None]))
        c = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        fin = np.isfinite(c)
        enough = np.where(fin, k_all, 0.0).sum(axis=1) >= n
        order = np.argsort(np.where(fin, c, np.inf), axis=1, kind="stable")
        flat = order + c.shape[1] * np.arange(len(c))[:, None]
        c = c.reshape(-1)[flat]
        fin = fin.reshape(-1)[flat]  # the finite ones first
        k = np.where(fin, k_all[order], 0.0)
        before = np.concatenate([np.zeros((len(c), 1)), np.cumsum(k, axis=1)[:, :-1]], axis=1)
        take = np.clip(n[:, None] - before, 0.0, k)
        with np.errstate(invalid="ignore"):
            (used,) = _masked_row_sums(fin, c * take)
        return enough & (used <= limit)

    def u_many(ks: list[int]) -> list[float]:
        """The bound ``u_k`` per ``k``: a bisection on ``tau`` per ``k``, all at once.

        The same 50 steps per ``k``; each round evaluates every midpoint
        the next ``depth`` steps could visit, then follows the path taken.
        """
        ns = np.array([k * job.pp for k in ks], dtype=float)
        start = feasible_many(np.zeros(len(ks)), ns)
        out = [0.0] * len(ks)
        active = [i for i in range(len(ks)) if start[i]]
        los = [0.0] * len(active)
        ups = [top] * len(active)
        steps = 50
        per_point = max(1, val.size + len(m_val))
        while active and steps:
            depth = min(_depth(per_point, len(active)), steps)
            mids = _midpoints(los, ups, depth)
            n_pts = len(mids[0])
            ok = (
                feasible_many(np.array(mids).ravel(), np.repeat(ns[active], n_pts))
                .reshape(len(active), n_pts)
                .tolist()
            )
            for a in range(len(active)):
                node = 0
                for _ in range(depth):
                    if ok[a][node]:
                        los[a] = mids[a][node]
                        node = 2 * node + 2
                    else:
                        ups[a] = mids[a][node]
                        node = 2 * node + 1
            steps -= depth
        for a, i in enumerate(active):
            out[i] = ups[a]  # feasible below up: a valid upper bound on the speed
        return out

    if replicas <= 0:
        return 0.0
    grid = sorted(
        {2**i for i in range(replicas.bit_length())}
        | set(range(max(1, replicas - 16), replicas + 1))
    )
    u_grid: dict[int, float] = {}
    if kept:
        # re-check each kept bound at a few speeds around it, every rank at once
        ks = [k for k in grid if kept.get(k, 0.0) > 0.0]
        if ks:
            taus = np.array([kept[k] * (1.0 + d) for k in ks for d in _FIXED_LADDER])
            ns = np.repeat(np.array(ks, dtype=float) * job.pp, len(_FIXED_LADDER))
            no = np.logical_not(feasible_many(taus, ns)).reshape(len(ks), len(_FIXED_LADDER))
            first = no.argmax(axis=1)  # the ladder ascends: the first speed that does not fit
            at_tau = taus.reshape(len(ks), len(_FIXED_LADDER))[np.arange(len(ks)), first]
            # decided where a step fits and a higher one does not (tight within a
            # step); where even the lowest does not fit, the bound fell: bisected
            decided: list[bool] = (no.any(axis=1) & (first > 0)).tolist()
            for k, ok, tau in zip(ks, decided, at_tau.tolist(), strict=True):
                if ok:  # no stage runs faster than ``top`` either
                    u_grid[k] = min(tau, top)
    rest = [k for k in grid if k not in u_grid]
    if rest:
        u_grid.update(zip(rest, u_many(rest), strict=True))
    if out is not None:
        out.clear()
        out.update(u_grid)
    ranks = np.arange(1, replicas + 1)
    # per rank, the largest grid point at or below it
    at = np.searchsorted(np.array(grid), ranks, side="right") - 1
    u_rank = np.array([u_grid[k] for k in grid])[at] / job.seq_time_s  # sequences per second
    b_max = min(job.local_batch_max, job.global_batch)
    big_b = job.global_batch
    if b_max * int((u_rank > 0).sum()) < big_b:
        return 0.0  # no replica set can carry B: the job pauses

    if kept is not None:  # re-planning: the step time solved directly, a hair low (valid)
        return big_b / (_carry_time(u_rank / factor, b_max, big_b) * (1.0 - _CARRY_MARGIN))

    def carried(theta: float) -> float:
        return float(np.minimum(b_max, theta * u_rank / factor).sum())

    lo, up = 0.0, 1.0
    while carried(up) < big_b:
        up *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + up)
        if carried(mid) >= big_b:
            up = mid
        else:
            lo = mid
    return big_b / lo if lo > 0 else math.inf


_CARRY_MARGIN = 1e-12
"""Relative amount :func:`_fixed_case_bound` takes off the step time it solves
directly (far above its rounding): the bound stays above the exact one."""


def _carry_time(w: np.ndarray, b_max: int, big_b: int) -> float:
    """The least ``theta`` with ``sum_r min(b_max, theta w_r) >= big_b`` (``w >= 0``,
    ``b_max * (w > 0).sum() >= big_b``), solved on the breakpoints ``b_max / w_r``."""
    w = np.sort(w[w > 0])[::-1]
    t = b_max / w  # breakpoints, ascending
    tail = np.concatenate((np.cumsum(w[::-1])[::-1][1:], [0.0]))  # sum of w_j, j > i
    carried = b_max * np.arange(1, len(w) + 1) + t * tail
    i = int(np.argmax(carried >= big_b))  # the first breakpoint that carries B
    # between breakpoints i - 1 and i: the first i replicas saturated
    return float((big_b - b_max * i) / w[i:].sum())


def _case_bound(
    job: Job,
    degrees: tuple[int, ...],
    h: np.ndarray,
    speeds: np.ndarray,
    tdps: np.ndarray,
    cum_w: np.ndarray,
    counts: np.ndarray,
    room: float,
    hi: np.ndarray,
    idle: float,
    refine: bool = True,
    at: tuple[float, float] | None = None,
    found: list[tuple[float, float]] | None = None,
    shared: dict[str, float] | None = None,
) -> float:
    """Lagrangian bound on the sum of replica speeds using only ``degrees``.

    ``refine=False`` skips the search over the GPU-count multiplier (a valid,
    possibly weaker bound). ``hi`` caps the multiplier, per domain class.
    ``at``: no search, the dual at these multipliers ``(lambda, mu)`` (valid
    for any; :func:`stage_bound_at`). ``found``: receives the multipliers of
    the value returned. ``shared``: the search at ``mu = 0``, kept by the
    quick call (``refine=False``) and taken by the refining one (the same
    numbers, computed once).
    """
    alpha = job.power_exponent
    scale = 1.0 / (job.pp * job.seq_time_s)
    single = h < 2 * min(degrees)
    # single-stage classes: options (class, degree) with value coefficient and watts
    opt_val: list[np.ndarray] = []
    opt_w: list[np.ndarray] = []
    opt_n: list[int] = []
    for t in degrees:
        fits = single & (h >= t)
        val = np.where(fits, job.tp_factor(t) * speeds[:, t - 1] * scale, 0.0)
        opt_val.append(val)
        opt_w.append(np.where(fits, cum_w[:, t], 1.0))
        opt_n.append(t)
    val_s = np.stack(opt_val, axis=1) if opt_val else np.zeros((len(h), 0))
    w_s = np.stack(opt_w, axis=1) if opt_w else np.zeros((len(h), 0))
    n_s = np.array(opt_n, dtype=float)
    # multi-stage classes: per GPU over the u fastest, at the smallest TDP
    phi = max(job.efficiency(t) / (job.tp * job.efficiency(job.tp)) for t in degrees) * scale
    multi = np.flatnonzero(~single)
    g_val: list[float] = []
    g_w: list[float] = []
    g_cnt: list[float] = []
    g_hi: list[float] = []
    for i in multi:
        u = _usable(int(h[i]), degrees)
        w_min = float(tdps[i, : int(h[i])].min())
        for s in speeds[i, :u]:
            g_val.append(phi * float(s))
            g_w.append(w_min)
            g_cnt.append(float(counts[i]))
            g_hi.append(float(hi[i]))
    gv, gw, gc, ghi = np.array(g_val), np.array(g_w), np.array(g_cnt), np.array(g_hi)
    hi_s = hi[:, None]
    cap_gpus = job.replicas_max * job.pp * job.tp
    if degrees == (job.tp,):
        slots = int((np.minimum(h, 10**9) // job.tp * counts).sum())
        cap_gpus = min(job.replicas_max, slots // job.pp) * job.pp * job.tp
    if cap_gpus <= 0:
        return 0.0

    n_cls = len(h)
    # Options that are equal (value, watts, cap) get equal element-wise results:
    # compute those once per distinct option row (classes) or option (GPUs) and
    # gather them back, which changes no number.
    _, first, opt_of = np.unique(
        np.hstack([val_s, w_s, hi_s]), axis=0, return_index=True, return_inverse=True
    )
    opt_of = opt_of.reshape(-1)
    u_val, u_w, u_hi = val_s[first], w_s[first], hi_s[first]
    if gv.size:
        _, first, gpu_of = np.unique(
            np.stack([gv, gw, ghi], axis=1), axis=0, return_index=True, return_inverse=True
        )
        gpu_of = gpu_of.reshape(-1)
        u_gv, u_gw, u_ghi = gv[first], gw[first], ghi[first]
    # numbers per (lambda, mu) point; batches are sized to about _BATCH of them
    per_point = max(1, u_val.size + n_cls + (2 * gv.size if gv.size else 0))
    # what every evaluation of the single-stage options shares (the same bits
    # as computed inline): alpha v, the options' degrees per slot, which exist
    boosted = alpha > 0 and not bool(np.all(u_hi <= 1.0))
    av_u = alpha * u_val
    expo = 1.0 / (1.0 - alpha) if 0 < alpha < 1 else 1.0
    absent = ~(u_val > 0)
    n_opt = u_val.shape[1]
    wk_all = np.ascontiguousarray(w_s)
    # above this, pi = (alpha v / (lambda w)) ** (1 / (1 - alpha)) is surely at
    # least the cap: pi = cap with no power taken (a margin far above rounding)
    hi_b = np.broadcast_to(u_hi, u_val.shape)
    sure_top = hi_b ** (1.0 - alpha) * (1.0 + 1e-9) if 0 < alpha < 1 else hi_b
    hi_alpha = hi_b**alpha

    def clipped_powers(lw: np.ndarray, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``pi = clip((alpha v / lw) ** (1 / (1 - alpha)), 1, hi)`` (``hi`` where
        ``lambda = 0``) and ``pi ** alpha``, the powers taken only strictly
        between the clips: where ``alpha v / lw <= 1`` the power is at most 1
        (pi = 1, pi ** alpha = 1 exactly), where it is above ``sure_top`` at least
        ``hi``; bit for bit the dense computation."""
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            x = np.divide(av_u, lw)
        top = x >= sure_top
        inner = (x > 1.0) & ~top  # NaN (v = 0 at lambda = 0): neither, overwritten below
        pi = np.where(top, hi_b, 1.0)
        pa = np.where(top, hi_alpha, 1.0)
        xi = x[inner]
        pin = np.minimum(np.maximum(xi**expo, 1.0), np.broadcast_to(hi_b, x.shape)[inner])
        pi[inner] = pin
        pa[inner] = pin**alpha
        zero = np.flatnonzero(lam <= 0)
        if len(zero):
            pi[zero] = hi_b
            pa[zero] = hi_alpha
        return pi, pa

    def best_pi(v: np.ndarray, w: np.ndarray, lam: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The best multiplier per option, at each ``lam`` (broadcast against ``v``)."""
        shape = np.broadcast_shapes(v.shape, lam.shape, np.shape(hi))
        if alpha <= 0 or bool(np.all(hi <= 1.0)):
            return np.ones(shape)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if alpha >= 1:  # convex or linear in pi: the best is an end point
                at_hi = v * hi**alpha - lam * w * hi
                at_one = v - lam * w
                pi = np.where(at_hi > at_one, hi, 1.0)
            else:  # w > 0 (TDPs are positive); v = 0 gives pi = 0, clipped to 1
                pi = np.clip((alpha * v / (lam * w)) ** (1.0 / (1.0 - alpha)), 1.0, hi)
        return np.where(lam <= 0, np.broadcast_to(hi, shape), pi)

    def duals(lam: np.ndarray, mu: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dual values and the used watts and GPUs of their maximisers, per ``(lam, mu)``.

        Each point gives bit for bit what evaluating it alone would: the
        same element-wise operations, and every sum over the selected
        options is numpy's sum of exactly those entries (:func:`_masked_row_sums`).
        """
        total = lam * room + mu * cap_gpus
        watts = np.zeros(len(lam))
        gpus = np.zeros(len(lam))
        if val_s.size:
            lam3, mu3 = lam[:, None, None], mu[:, None, None]
            lw = lam3 * u_w
            pa_u: np.ndarray | None = None
            if not boosted:
                pi_u = np.ones(lw.shape)
            elif 0 < alpha < 1 and lw.size >= _SPARSE_POWERS:
                pi_u, pa_u = clipped_powers(lw, lam)
            elif 0 < alpha < 1:  # best_pi, step by step (w > 0, TDPs are positive)
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    pi_u = np.divide(av_u, lw)
                    np.power(pi_u, expo, out=pi_u)
                np.maximum(pi_u, 1.0, out=pi_u)  # np.clip(pi, 1, hi), NaN kept
                np.minimum(pi_u, u_hi, out=pi_u)
                zero = np.flatnonzero(lam <= 0)
                if len(zero):
                    pi_u[zero] = np.broadcast_to(u_hi, pi_u.shape[1:])
            else:
                pi_u = best_pi(u_val, u_w, lam3, u_hi)
            if pa_u is None:
                pa_u = pi_u**alpha
            gain_u = u_val * pa_u
            gain_u -= extra_draw(lw, pi_u, idle)
            gain_u -= mu3 * n_s
            gain_u[:, absent] = -np.inf
            k_u = np.argmax(gain_u, axis=2)
            flat = k_u + n_opt * np.arange(k_u.size).reshape(k_u.shape)
            g_u = gain_u.reshape(-1)[flat]
            pk_u = pi_u.reshape(-1)[flat]
            k, g, pk = k_u[:, opt_of], g_u[:, opt_of], pk_u[:, opt_of]
            on = single & (g > 0)
            wk = wk_all.reshape(-1)[k + n_opt * np.arange(n_cls)]
            s_val, s_watts = _masked_row_sums(on, g * counts, extra_draw(wk, pk, idle) * counts)
            total = total + s_val
            watts = watts + s_watts
            gpus = gpus + np.where(on, n_s[k] * counts, 0.0).sum(axis=1)
        if gv.size:
            lam2, mu2 = lam[:, None], mu[:, None]
            pi_u = best_pi(u_gv, u_gw, lam2, u_ghi)
            gain_u = u_gv * pi_u**alpha - extra_draw(lam2 * u_gw, pi_u, idle) - mu2
            pi, gain = pi_u[:, gpu_of], gain_u[:, gpu_of]
            on = gain > 0
            m_val, m_watts = _masked_row_sums(on, gain * gc, extra_draw(gw, pi, idle) * gc)
            total = total + m_val
            watts = watts + m_watts
            gpus = gpus + np.where(on, gc, 0.0).sum(axis=1)
        return total, watts, gpus

    def dual(lam: float, mu: float) -> tuple[float, float, float]:
        """Dual value and the used watts and GPUs of its maximiser."""
        v, w, g = duals(np.array([lam]), np.array([mu]))
        return float(v[0]), float(w[0]), float(g[0])

    # the lambda doubling steps of the search: 1e-12 * 4**k, k = 0..40
    ups = [1e-12]
    while ups[-1] <= 1e12:
        ups.append(ups[-1] * 4.0)

    if at is not None:
        return dual(*at)[0]

    gpus_at_zero: list[float] = [0.0]

    def inner_many(mus: list[float]) -> tuple[list[float], list[float], list[float]]:
        """min over lambda of the dual at each ``mu``; and the GPUs used there.

        The same steps as a search per ``mu`` (the dual at ``lambda = 0``;
        doubling ``lambda`` by 4 from 1e-12 until the power fits or past
        1e12; 40 bisection steps keeping the smallest value), run for all
        ``mu`` at once: the doubling candidates are evaluated in one batch,
        and each bisection round evaluates every midpoint the next ``depth``
        steps could visit, then follows the path the steps take.
        """
        n_mu = len(mus)
        mu_arr = np.array(mus, dtype=float)
        cand = np.array([0.0, *ups])  # lambda = 0, then the doubling steps
        v, w, g = (
            x.reshape(n_mu, len(cand))
            for x in duals(np.tile(cand, n_mu), np.repeat(mu_arr, len(cand)))
        )
        values, used = v[:, 0].tolist(), g[:, 0].tolist()
        gpus_at_zero[:] = used[:1]  # lambda = mu = 0 when mus[0] == 0
        lams = [0.0] * n_mu
        active: list[int] = []
        los: list[float] = []
        hs: list[float] = []
        best_v: list[float] = []
        best_g: list[float] = []
        best_l: list[float] = []
        for i in range(n_mu):
            if float(w[i, 0]) <= room:
                continue
            j = 1
            while j < len(ups) and float(w[i, j]) > room:
                j += 1
            active.append(i)
            los.append(0.0)
            hs.append(float(cand[j]))
            best_v.append(float(v[i, j]))
            best_g.append(float(g[i, j]))
            best_l.append(float(cand[j]))
        steps = 40
        while active and steps:
            depth = min(_depth(per_point, len(active)), steps)
            mids = _midpoints(los, hs, depth)
            n_pts = len(mids[0])
            vs, ws, gs = (
                x.reshape(len(active), n_pts).tolist()
                for x in duals(np.array(mids).ravel(), np.repeat(mu_arr[active], n_pts))
            )
            for a in range(len(active)):
                node = 0
                va, wa, ga, ma = vs[a], ws[a], gs[a], mids[a]
                for _ in range(depth):
                    mid_v = ma[node]
                    if va[node] < best_v[a]:
                        best_v[a], best_g[a] = va[node], ga[node]
                        best_l[a] = mid_v
                    if wa[node] > room:
                        los[a] = mid_v
                        node = 2 * node + 2
                    else:
                        hs[a] = mid_v
                        node = 2 * node + 1
            steps -= depth
        for a, i in enumerate(active):
            values[i], used[i], lams[i] = best_v[a], best_g[a], best_l[a]
        return values, used, lams

    if shared is not None and "value0" in shared:
        value, lam0, gpus0 = shared["value0"], shared["lam0"], shared["gpus0"]
    else:
        values0, _, lams0 = inner_many([0.0])
        value, lam0, gpus0 = values0[0], lams0[0], gpus_at_zero[0]
        if shared is not None:
            shared.update(value0=value, lam0=lam0, gpus0=gpus0)
    point = (lam0, 0.0)
    if not refine or gpus0 <= cap_gpus:
        if found is not None:
            found.append(point)
        return value  # (the second: the GPU count can never bind, mu = 0 is optimal)
    # D(mu) = min over lambda is convex in mu: ternary search on its values
    # (not on a subgradient, which ties between domain classes make unreliable).
    # Beyond mu_hi every option's gain is negative, so the minimum is below it.
    per_gpu = [val_s.max(initial=0.0) / min(degrees), gv.max(initial=0.0)]
    lo, up = 0.0, max(per_gpu) * float(hi.max()) ** alpha * 1.01
    best = value
    steps = 24
    while steps:
        # every (m1, m2) the next `depth` ternary steps could visit, heap order
        # (each mu's lambda search takes about 7 batches)
        depth = min(_depth(per_point * 7, 2, most=3), steps)
        nodes = [(lo, up)]
        points: list[float] = []
        for _ in range(depth):
            nxt = []
            for a, b in nodes:
                m1, m2 = a + (b - a) / 3, b - (b - a) / 3
                points += [m1, m2]
                nxt += [(a, m2), (m1, b)]
            nodes = nxt
        vals, _, lams = inner_many(points)
        node = 0
        for _ in range(depth):
            m1, m2 = points[2 * node], points[2 * node + 1]
            v1, v2 = vals[2 * node], vals[2 * node + 1]
            for v_i, pt in ((v1, (lams[2 * node], m1)), (v2, (lams[2 * node + 1], m2))):
                if v_i < best:  # min(best, v1, v2), and where it is
                    best, point = v_i, pt
            if v1 <= v2:
                up = m2
                node = 2 * node + 1
            else:
                lo = m1
                node = 2 * node + 2
        steps -= depth
    if found is not None:
        found.append(point)
    return best
