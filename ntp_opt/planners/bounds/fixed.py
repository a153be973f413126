"""The ``fixed`` batch policy's refinement of a case of
:func:`~ntp_opt.planners.bounds.stage.stage_bound`: a bound from the speed of the
``k``-th fastest replica (:func:`fixed_case_bound`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.job import Job
from ntp_opt.planners.bounds.batched import lookahead_depth, masked_row_sums, midpoints
from ntp_opt.planners.bounds.rows import ClassTable
from ntp_opt.rules.power import budget_limit, extra_draw
from ntp_opt.rules.tolerances import BUDGET_SLACK

__all__ = ["fixed_case_bound"]

_FIXED_LADDER = (-1e-3, -1e-4, -1e-5, -1e-6, 0.0, 1e-6, 1e-5, 1e-4, 1e-3)
"""Relative steps around a kept speed bound at which :func:`fixed_case_bound`
re-checks it (ascending)."""

_CARRY_MARGIN = 1e-12
"""Relative amount :func:`fixed_case_bound` takes off the step time it solves
directly (far above its rounding): the bound stays above the exact one."""


@dataclass(frozen=True, eq=False)
class _StageFit:
    """A case's stage candidates and the site's power room: whether ``n`` stages
    can all run at a speed (single-stage classes deduplicated by option row)."""

    alpha: float
    idle: float
    pp: int
    s_val: np.ndarray  # single-stage classes, distinct option rows: values
    s_w: np.ndarray  # their watts
    s_hi: np.ndarray  # their caps
    row_of: np.ndarray  # each single-stage class's option row
    m_val: np.ndarray  # multi-stage classes: value, watts, cap
    m_w: np.ndarray
    m_hi: np.ndarray
    k_all: np.ndarray  # candidates per class (single, then multi)
    limit: float
    top: float  # no stage runs faster
    per_point: int

    def cost(self, v: np.ndarray, w: np.ndarray, tau: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Extra watts of a stage of value ``v`` and watts ``w`` lifted to speed ``tau``."""
        alpha = self.alpha
        with np.errstate(divide="ignore", invalid="ignore"):
            if alpha > 0:
                pi = np.maximum(1.0, (tau / v) ** (1.0 / alpha))
            else:
                pi = np.where(v >= tau, 1.0, np.inf)
        pi = np.where(v > 0, pi, np.inf)
        return np.where(
            pi <= hi * (1 + BUDGET_SLACK), extra_draw(w, np.minimum(pi, hi), self.idle), np.inf
        )

    def feasible_many(self, tau: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Whether ``n`` stages at speed ``tau`` or faster fit the power room, per point.

        Bit for bit what one point alone gives: the same element-wise
        costs, the same stable order, and numpy's own sum of the costs taken.
        """
        parts = []
        if len(self.s_val):
            c1 = self.cost(
                self.s_val[None], self.s_w[None], tau[:, None, None], self.s_hi[None, :, None]
            )
            parts.append(c1.min(axis=2)[:, self.row_of])
        if len(self.m_val):
            parts.append(self.cost(self.m_val[None], self.m_w[None], tau[:, None], self.m_hi[None]))
        c = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        fin = np.isfinite(c)
        k_all = self.k_all
        enough = np.where(fin, k_all, 0.0).sum(axis=1) >= n
        order = np.argsort(np.where(fin, c, np.inf), axis=1, kind="stable")
        flat = order + c.shape[1] * np.arange(len(c))[:, None]
        c = c.reshape(-1)[flat]
        fin = fin.reshape(-1)[flat]  # the finite ones first
        k = np.where(fin, k_all[order], 0.0)
        before = np.concatenate([np.zeros((len(c), 1)), np.cumsum(k, axis=1)[:, :-1]], axis=1)
        take = np.clip(n[:, None] - before, 0.0, k)
        with np.errstate(invalid="ignore"):
            (used,) = masked_row_sums(fin, c * take)
        return enough & (used <= self.limit)


def _stage_fit(job: Job, degrees: tuple[int, ...], table: ClassTable) -> _StageFit:
    """The stage candidates of the case ``degrees`` (see :func:`fixed_case_bound`)."""
    h, speeds, cum_w, counts, hi = table.h, table.speeds, table.cum_w, table.counts, table.hi
    alpha = job.power_exponent
    single = h < 2 * min(degrees)
    val = np.stack(
        [np.where(single & (h >= t), job.tp_factor(t) * speeds[:, t - 1], 0.0) for t in degrees],
        axis=1,
    )
    watts = np.stack([cum_w[:, t] for t in degrees], axis=1)
    multi = ~single
    m_val = max(job.tp_factor(t) for t in degrees) * speeds[:, 0]
    m_w = min(degrees) * np.where(multi, table.tdps[:, 0], 1.0)
    m_cnt = np.where(multi, counts * (h // min(degrees)), 0)
    top = float(max(val.max(initial=0.0), m_val[multi].max(initial=0.0))) * float(hi.max()) ** alpha
    k_all = np.concatenate([counts[single], m_cnt[multi]]).astype(float)
    limit = budget_limit(table.room, tol=BUDGET_SLACK, slack=0.0)
    # cost is element-wise: the single-stage classes' costs once per distinct
    # option row (values, watts, cap), gathered back (the same numbers)
    _, first, row_of = np.unique(
        np.hstack([val[single], watts[single], hi[single, None]]),
        axis=0,
        return_index=True,
        return_inverse=True,
    )
    return _StageFit(
        alpha,
        job.idle_power_fraction,
        job.pp,
        val[single][first],
        watts[single][first],
        hi[single][first],
        row_of.reshape(-1),
        m_val[multi],
        m_w[multi],
        hi[multi],
        k_all,
        limit,
        top,
        max(1, val.size + len(m_val)),
    )


def _u_many(fit: _StageFit, ks: list[int]) -> list[float]:
    """The bound ``u_k`` per ``k``: a bisection on ``tau`` per ``k``, all at once.

    The same 50 steps per ``k``; each round evaluates every midpoint
    the next ``depth`` steps could visit, then follows the path taken.
    """
    ns = np.array([k * fit.pp for k in ks], dtype=float)
    start = fit.feasible_many(np.zeros(len(ks)), ns)
    out = [0.0] * len(ks)
    active = [i for i in range(len(ks)) if start[i]]
    los = [0.0] * len(active)
    ups = [fit.top] * len(active)
    steps = 50
    while active and steps:
        depth = min(lookahead_depth(fit.per_point, len(active)), steps)
        mids = midpoints(los, ups, depth)
        n_pts = len(mids[0])
        ok = (
            fit.feasible_many(np.array(mids).ravel(), np.repeat(ns[active], n_pts))
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


def _recheck_kept(fit: _StageFit, grid: list[int], kept: dict[int, float]) -> dict[int, float]:
    """The kept speed bounds re-checked at :data:`_FIXED_LADDER` around each, every
    rank at once: the ranks it decides and their bounds."""
    u_grid: dict[int, float] = {}
    ks = [k for k in grid if kept.get(k, 0.0) > 0.0]
    if ks:
        taus = np.array([kept[k] * (1.0 + d) for k in ks for d in _FIXED_LADDER])
        ns = np.repeat(np.array(ks, dtype=float) * fit.pp, len(_FIXED_LADDER))
        no = np.logical_not(fit.feasible_many(taus, ns)).reshape(len(ks), len(_FIXED_LADDER))
        first = no.argmax(axis=1)  # the ladder ascends: the first speed that does not fit
        at_tau = taus.reshape(len(ks), len(_FIXED_LADDER))[np.arange(len(ks)), first]
        # decided where a step fits and a higher one does not (tight within a
        # step); where even the lowest does not fit, the bound fell: bisected
        decided: list[bool] = (no.any(axis=1) & (first > 0)).tolist()
        for k, ok, tau in zip(ks, decided, at_tau.tolist(), strict=True):
            if ok:  # no stage runs faster than ``top`` either
                u_grid[k] = min(tau, fit.top)
    return u_grid


def fixed_case_bound(
    job: Job,
    degrees: tuple[int, ...],
    factor: float,
    replicas: int,
    table: ClassTable,
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

    Parameters
    ----------
    job
        The job.
    degrees
        The case's TP degrees.
    factor
        The case's step-time factor (``1 + rho`` with reduced replicas).
    replicas
        The most replicas the case can have.
    table
        The domain classes and the site's power room.
    kept
        Speed bounds ``u_k`` from an earlier instance (re-planning); each is
        re-checked at :data:`_FIXED_LADDER` around it instead of bisected:
        where a step fits and the next does not, the latter bounds ``v_(k)``
        (fitting only gets harder as ``tau`` grows); a rank the steps do not
        bracket is bisected. The step time is then solved directly, a hair
        low (:func:`_carry_time`, :data:`_CARRY_MARGIN`): the value may exceed
        the searched one by about ``1e-12``, never fall below what is valid.
    out
        Receives the ``u_k`` used.

    Returns
    -------
    float
        Upper bound on the case's goodput (sequences per second).
    """
    fit = _stage_fit(job, degrees, table)
    if replicas <= 0:
        return 0.0
    grid = sorted(
        {2**i for i in range(replicas.bit_length())}
        | set(range(max(1, replicas - 16), replicas + 1))
    )
    u_grid: dict[int, float] = _recheck_kept(fit, grid, kept) if kept else {}
    rest = [k for k in grid if k not in u_grid]
    if rest:
        u_grid.update(zip(rest, _u_many(fit, rest), strict=True))
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
    return _searched_bound(u_rank, factor, b_max, big_b)


def _searched_bound(u_rank: np.ndarray, factor: float, b_max: int, big_b: int) -> float:
    """``big_b / theta`` at the least ``theta`` whose replicas carry ``big_b`` (bisection)."""

    lo, up = 0.0, 1.0
    while _carried(up, u_rank, factor, b_max) < big_b:
        up *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + up)
        if _carried(mid, u_rank, factor, b_max) >= big_b:
            up = mid
        else:
            lo = mid
    return big_b / lo if lo > 0 else math.inf


def _carried(theta: float, u_rank: np.ndarray, factor: float, b_max: int) -> float:
    """Sequences the replicas carry at step time ``theta``."""
    return float(np.minimum(b_max, theta * u_rank / factor).sum())


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
