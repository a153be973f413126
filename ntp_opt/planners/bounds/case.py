"""The Lagrangian bound of one case of :func:`~ntp_opt.planners.bounds.stage.stage_bound`
(:func:`case_bound`): the sum of replica speeds using only the case's TP degrees.

The site power budget (multiplier ``lambda``) and the GPU count ``dp_max pp T``
(multiplier ``mu``) are relaxed; every ``(lambda, mu) >= 0`` gives a bound, and
the search over them (bisection on ``lambda`` per ``mu``, ternary search on
``mu``) only tightens it. The searches are batched: every point a few steps
could visit is evaluated in one numpy call (:mod:`ntp_opt.planners.bounds.batched`),
with the same numbers as one point at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ntp_opt.model.job import Job
from ntp_opt.planners.bounds.batched import lookahead_depth, masked_row_sums, midpoints
from ntp_opt.planners.bounds.rows import ClassTable, distinct_rows
from ntp_opt.rules.power import extra_draw

__all__ = ["case_bound"]

_SPARSE_POWERS = 4096
"""From this many options x points on, the dual takes powers only between the
clips (speed only: the same numbers either way)."""


def _doubling_steps() -> list[float]:
    """The lambda doubling steps of the search: ``1e-12 * 4**k``, ``k = 0..40``."""
    ups = [1e-12]
    while ups[-1] <= 1e12:
        ups.append(ups[-1] * 4.0)
    return ups


_UPS = _doubling_steps()


def _usable(h: int, degrees: tuple[int, ...]) -> int:
    """Most GPUs ``h`` healthy GPUs can give to stages of the given degrees."""
    reach = np.zeros(h + 1, dtype=bool)
    reach[0] = True
    for n in range(1, h + 1):
        reach[n] = any(t <= n and reach[n - t] for t in degrees)
    return int(np.flatnonzero(reach).max())


@dataclass(frozen=True, eq=False)
class _CaseDual:
    """The dual of one case: its options (single-stage classes, and per GPU the
    multi-stage ones), deduplicated, and what every evaluation shares."""

    alpha: float
    idle: float
    room: float
    cap_gpus: int
    n_cls: int
    single: np.ndarray  # per class: hosts one stage at most
    counts: np.ndarray
    val_s: np.ndarray  # single-stage options (class, degree): value, watts, degree
    n_s: np.ndarray
    wk_all: np.ndarray
    opt_of: np.ndarray  # each class's distinct option row
    u_val: np.ndarray  # the distinct option rows: value, watts, cap
    u_w: np.ndarray
    u_hi: np.ndarray
    gv: np.ndarray  # multi-stage classes, per GPU: value, watts, count, cap
    gw: np.ndarray
    gc: np.ndarray
    gpu_of: np.ndarray  # each GPU's distinct option
    u_gv: np.ndarray  # the distinct GPU options: value, watts, cap
    u_gw: np.ndarray
    u_ghi: np.ndarray
    per_point: int  # numbers per (lambda, mu) point
    # what every evaluation of the single-stage options shares
    boosted: bool = field(init=False)
    av_u: np.ndarray = field(init=False)
    expo: float = field(init=False)
    absent: np.ndarray = field(init=False)
    hi_b: np.ndarray = field(init=False)
    sure_top: np.ndarray = field(init=False)
    hi_alpha: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        """The shared numbers (the same bits as computed inline)."""
        alpha, u_val, u_hi = self.alpha, self.u_val, self.u_hi
        hi_b = np.broadcast_to(u_hi, u_val.shape)
        # above ``sure_top``, pi = (alpha v / (lambda w)) ** (1 / (1 - alpha)) is
        # surely at least the cap: pi = cap with no power taken (a margin far above rounding)
        shared = {
            "boosted": alpha > 0 and not bool(np.all(u_hi <= 1.0)),
            "av_u": alpha * u_val,
            "expo": 1.0 / (1.0 - alpha) if 0 < alpha < 1 else 1.0,
            "absent": ~(u_val > 0),
            "hi_b": hi_b,
            "sure_top": hi_b ** (1.0 - alpha) * (1.0 + 1e-9) if 0 < alpha < 1 else hi_b,
            "hi_alpha": hi_b**alpha,
        }
        for name, value in shared.items():
            object.__setattr__(self, name, value)

    def clipped_powers(self, lw: np.ndarray, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``pi = clip((alpha v / lw) ** (1 / (1 - alpha)), 1, hi)`` (``hi`` where
        ``lambda = 0``) and ``pi ** alpha``, the powers taken only strictly
        between the clips: where ``alpha v / lw <= 1`` the power is at most 1
        (pi = 1, pi ** alpha = 1 exactly), where it is above ``sure_top`` at least
        ``hi``; bit for bit the dense computation."""
        hi_b, hi_alpha = self.hi_b, self.hi_alpha
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            x = np.divide(self.av_u, lw)
        top = x >= self.sure_top
        inner = (x > 1.0) & ~top  # NaN (v = 0 at lambda = 0): neither, overwritten below
        pi = np.where(top, hi_b, 1.0)
        pa = np.where(top, hi_alpha, 1.0)
        xi = x[inner]
        pin = np.minimum(np.maximum(xi**self.expo, 1.0), np.broadcast_to(hi_b, x.shape)[inner])
        pi[inner] = pin
        pa[inner] = pin**self.alpha
        zero = np.flatnonzero(lam <= 0)
        if len(zero):
            pi[zero] = hi_b
            pa[zero] = hi_alpha
        return pi, pa

    def best_pi(self, v: np.ndarray, w: np.ndarray, lam: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The best multiplier per option, at each ``lam`` (broadcast against ``v``)."""
        alpha = self.alpha
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

    def single_powers(
        self, lw: np.ndarray, lam: np.ndarray, lam3: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The distinct single-stage options' best multipliers and their powers ``** alpha``."""
        alpha = self.alpha
        pa_u: np.ndarray | None = None
        if not self.boosted:
            pi_u = np.ones(lw.shape)
        elif 0 < alpha < 1 and lw.size >= _SPARSE_POWERS:
            pi_u, pa_u = self.clipped_powers(lw, lam)
        elif 0 < alpha < 1:  # best_pi, step by step (w > 0, TDPs are positive)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                pi_u = np.divide(self.av_u, lw)
                np.power(pi_u, self.expo, out=pi_u)
            np.maximum(pi_u, 1.0, out=pi_u)  # np.clip(pi, 1, hi), NaN kept
            np.minimum(pi_u, self.u_hi, out=pi_u)
            zero = np.flatnonzero(lam <= 0)
            if len(zero):
                pi_u[zero] = np.broadcast_to(self.u_hi, pi_u.shape[1:])
        else:
            pi_u = self.best_pi(self.u_val, self.u_w, lam3, self.u_hi)
        if pa_u is None:
            pa_u = pi_u**alpha
        return pi_u, pa_u

    def single_part(self, lam: np.ndarray, mu: np.ndarray) -> tuple[np.ndarray, ...]:
        """The single-stage classes' dual value, watts and GPUs, per ``(lam, mu)``."""
        n_opt = self.u_val.shape[1]
        lam3, mu3 = lam[:, None, None], mu[:, None, None]
        lw = lam3 * self.u_w
        pi_u, pa_u = self.single_powers(lw, lam, lam3)
        gain_u = self.u_val * pa_u
        gain_u -= extra_draw(lw, pi_u, self.idle)
        gain_u -= mu3 * self.n_s
        gain_u[:, self.absent] = -np.inf
        k_u = np.argmax(gain_u, axis=2)
        flat = k_u + n_opt * np.arange(k_u.size).reshape(k_u.shape)
        g_u = gain_u.reshape(-1)[flat]
        pk_u = pi_u.reshape(-1)[flat]
        k, g, pk = k_u[:, self.opt_of], g_u[:, self.opt_of], pk_u[:, self.opt_of]
        counts = self.counts
        on = self.single & (g > 0)
        wk = self.wk_all.reshape(-1)[k + n_opt * np.arange(self.n_cls)]
        s_val, s_watts = masked_row_sums(on, g * counts, extra_draw(wk, pk, self.idle) * counts)
        return s_val, s_watts, np.where(on, self.n_s[k] * counts, 0.0).sum(axis=1)

    def multi_part(self, lam: np.ndarray, mu: np.ndarray) -> tuple[np.ndarray, ...]:
        """The multi-stage classes' dual value, watts and GPUs, per ``(lam, mu)``."""
        lam2, mu2 = lam[:, None], mu[:, None]
        pi_u = self.best_pi(self.u_gv, self.u_gw, lam2, self.u_ghi)
        gain_u = self.u_gv * pi_u**self.alpha - extra_draw(lam2 * self.u_gw, pi_u, self.idle) - mu2
        pi, gain = pi_u[:, self.gpu_of], gain_u[:, self.gpu_of]
        gc = self.gc
        on = gain > 0
        m_val, m_watts = masked_row_sums(on, gain * gc, extra_draw(self.gw, pi, self.idle) * gc)
        return m_val, m_watts, np.where(on, gc, 0.0).sum(axis=1)

    def duals(self, lam: np.ndarray, mu: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dual values and the used watts and GPUs of their maximisers, per ``(lam, mu)``.

        Each point gives bit for bit what evaluating it alone would: the
        same element-wise operations, and every sum over the selected
        options is numpy's sum of exactly those entries (:func:`masked_row_sums`).
        """
        total = lam * self.room + mu * self.cap_gpus
        watts = np.zeros(len(lam))
        gpus = np.zeros(len(lam))
        if self.val_s.size:
            s_val, s_watts, s_gpus = self.single_part(lam, mu)
            total = total + s_val
            watts = watts + s_watts
            gpus = gpus + s_gpus
        if self.gv.size:
            m_val, m_watts, m_gpus = self.multi_part(lam, mu)
            total = total + m_val
            watts = watts + m_watts
            gpus = gpus + m_gpus
        return total, watts, gpus

    def dual(self, lam: float, mu: float) -> tuple[float, float, float]:
        """Dual value and the used watts and GPUs of its maximiser."""
        v, w, g = self.duals(np.array([lam]), np.array([mu]))
        return float(v[0]), float(w[0]), float(g[0])


def _single_options(
    job: Job, degrees: tuple[int, ...], table: ClassTable, scale: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Classes that host one stage at most, and per (class, degree) option its value
    coefficient and watts (the ``t``-th fastest speed, the ``t`` smallest TDPs); the
    options' degrees."""
    h = table.h
    single = h < 2 * min(degrees)
    opt_val: list[np.ndarray] = []
    opt_w: list[np.ndarray] = []
    opt_n: list[int] = []
    for t in degrees:
        fits = single & (h >= t)
        val = np.where(fits, job.tp_factor(t) * table.speeds[:, t - 1] * scale, 0.0)
        opt_val.append(val)
        opt_w.append(np.where(fits, table.cum_w[:, t], 1.0))
        opt_n.append(t)
    val_s = np.stack(opt_val, axis=1) if opt_val else np.zeros((len(h), 0))
    w_s = np.stack(opt_w, axis=1) if opt_w else np.zeros((len(h), 0))
    return single, val_s, w_s, np.array(opt_n, dtype=float)


def _multi_gpus(
    job: Job, degrees: tuple[int, ...], table: ClassTable, single: np.ndarray, scale: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Classes that can host several stages, relaxed per GPU over the ``u`` fastest
    at the class's smallest TDP: per GPU its value, watts, count and cap."""
    phi = max(job.efficiency(t) / (job.tp * job.efficiency(job.tp)) for t in degrees) * scale
    g_val: list[float] = []
    g_w: list[float] = []
    g_cnt: list[float] = []
    g_hi: list[float] = []
    for i in np.flatnonzero(~single):
        u = _usable(int(table.h[i]), degrees)
        w_min = float(table.tdps[i, : int(table.h[i])].min())
        for s in table.speeds[i, :u]:
            g_val.append(phi * float(s))
            g_w.append(w_min)
            g_cnt.append(float(table.counts[i]))
            g_hi.append(float(table.hi[i]))
    return np.array(g_val), np.array(g_w), np.array(g_cnt), np.array(g_hi)


def _case_dual(job: Job, degrees: tuple[int, ...], table: ClassTable) -> _CaseDual | None:
    """The dual of the case ``degrees`` (``None``: no GPU may be used, the bound is 0)."""
    h, counts = table.h, table.counts
    scale = 1.0 / (job.pp * job.seq_time_s)
    single, val_s, w_s, n_s = _single_options(job, degrees, table, scale)
    gv, gw, gc, ghi = _multi_gpus(job, degrees, table, single, scale)
    hi_s = table.hi[:, None]
    cap_gpus = job.replicas_max * job.pp * job.tp
    if degrees == (job.tp,):
        slots = int((np.minimum(h, 10**9) // job.tp * counts).sum())
        cap_gpus = min(job.replicas_max, slots // job.pp) * job.pp * job.tp
    if cap_gpus <= 0:
        return None
    # Options that are equal (value, watts, cap) get equal element-wise results:
    # compute those once per distinct option row (classes) or option (GPUs) and
    # gather them back, which changes no number.
    first, opt_of = distinct_rows(np.hstack([val_s, w_s, hi_s]))
    gpu_of: np.ndarray = np.zeros(0, dtype=np.int64)
    u_gv = u_gw = u_ghi = np.zeros(0)
    if gv.size:
        g_first, gpu_of = distinct_rows(np.stack([gv, gw, ghi], axis=1))
        u_gv, u_gw, u_ghi = gv[g_first], gw[g_first], ghi[g_first]
    u_val = val_s[first]
    # numbers per (lambda, mu) point; batches are sized to about ``batched._BATCH`` of them
    per_point = max(1, u_val.size + len(h) + (2 * gv.size if gv.size else 0))
    return _CaseDual(
        job.power_exponent,
        job.idle_power_fraction,
        table.room,
        cap_gpus,
        len(h),
        single,
        counts,
        val_s,
        n_s,
        np.ascontiguousarray(w_s),
        opt_of.reshape(-1),
        u_val,
        w_s[first],
        hi_s[first],
        gv,
        gw,
        gc,
        gpu_of.reshape(-1),
        u_gv,
        u_gw,
        u_ghi,
        per_point,
    )


@dataclass
class _Brackets:
    """The lambda searches still open (indices into the ``mu`` list), their
    intervals and the best point each has seen."""

    active: list[int] = field(default_factory=list)
    los: list[float] = field(default_factory=list)
    hs: list[float] = field(default_factory=list)
    best_v: list[float] = field(default_factory=list)
    best_g: list[float] = field(default_factory=list)
    best_l: list[float] = field(default_factory=list)


def _doubling(cd: _CaseDual, mu_arr: np.ndarray) -> tuple[list[float], list[float], _Brackets]:
    """Per ``mu``: the dual at ``lambda = 0`` and its GPUs; where the power does not
    fit there, the first doubling step where it does (or the last one), to bisect."""
    n_mu = len(mu_arr)
    cand = np.array([0.0, *_UPS])  # lambda = 0, then the doubling steps
    v, w, g = (
        x.reshape(n_mu, len(cand))
        for x in cd.duals(np.tile(cand, n_mu), np.repeat(mu_arr, len(cand)))
    )
    values, used = v[:, 0].tolist(), g[:, 0].tolist()
    br = _Brackets()
    for i in range(n_mu):
        if float(w[i, 0]) <= cd.room:
            continue
        j = 1
        while j < len(_UPS) and float(w[i, j]) > cd.room:
            j += 1
        br.active.append(i)
        br.los.append(0.0)
        br.hs.append(float(cand[j]))
        br.best_v.append(float(v[i, j]))
        br.best_g.append(float(g[i, j]))
        br.best_l.append(float(cand[j]))
    return values, used, br


def _bisect(cd: _CaseDual, mu_arr: np.ndarray, br: _Brackets) -> None:
    """40 bisection steps on lambda for every open search, keeping the smallest value:
    each round evaluates every midpoint the next ``depth`` steps could visit, then
    follows the path the steps take."""
    steps = 40
    while br.active and steps:
        depth = min(lookahead_depth(cd.per_point, len(br.active)), steps)
        mids = midpoints(br.los, br.hs, depth)
        n_pts = len(mids[0])
        vs, ws, gs = (
            x.reshape(len(br.active), n_pts).tolist()
            for x in cd.duals(np.array(mids).ravel(), np.repeat(mu_arr[br.active], n_pts))
        )
        for a in range(len(br.active)):
            node = 0
            va, wa, ga, ma = vs[a], ws[a], gs[a], mids[a]
            for _ in range(depth):
                mid_v = ma[node]
                if va[node] < br.best_v[a]:
                    br.best_v[a], br.best_g[a] = va[node], ga[node]
                    br.best_l[a] = mid_v
                if wa[node] > cd.room:
                    br.los[a] = mid_v
                    node = 2 * node + 2
                else:
                    br.hs[a] = mid_v
                    node = 2 * node + 1
        steps -= depth


def _inner_many(
    cd: _CaseDual, mus: list[float]
) -> tuple[list[float], list[float], list[float], list[float]]:
    """min over lambda of the dual at each ``mu``; the GPUs used there; the lambdas;
    and the GPUs used at ``lambda = 0`` for ``mus[0]`` (one entry).

    The same steps as a search per ``mu`` (the dual at ``lambda = 0``;
    doubling ``lambda`` by 4 from 1e-12 until the power fits or past
    1e12; 40 bisection steps keeping the smallest value), run for all
    ``mu`` at once (:func:`_doubling`, :func:`_bisect`).
    """
    mu_arr = np.array(mus, dtype=float)
    values, used, br = _doubling(cd, mu_arr)
    at_zero = used[:1]  # lambda = mu = 0 when mus[0] == 0
    lams = [0.0] * len(mus)
    _bisect(cd, mu_arr, br)
    for a, i in enumerate(br.active):
        values[i], used[i], lams[i] = br.best_v[a], br.best_g[a], br.best_l[a]
    return values, used, lams, at_zero


def _ternary_points(lo: float, up: float, depth: int) -> list[float]:
    """Every ``(m1, m2)`` the next ``depth`` ternary steps on ``[lo, up]`` could visit,
    heap order."""
    nodes = [(lo, up)]
    points: list[float] = []
    for _ in range(depth):
        nxt = []
        for a, b in nodes:
            m1, m2 = a + (b - a) / 3, b - (b - a) / 3
            points += [m1, m2]
            nxt += [(a, m2), (m1, b)]
        nodes = nxt
    return points


def _mu_search(
    cd: _CaseDual, up: float, best: float, point: tuple[float, float]
) -> tuple[float, tuple[float, float]]:
    """Ternary search on ``D(mu) = min over lambda`` (convex in ``mu``) over
    ``[0, up]``, on its values (not on a subgradient, which ties between domain
    classes make unreliable): the smallest value seen and its ``(lambda, mu)``."""
    lo = 0.0
    steps = 24
    while steps:
        # each mu's lambda search takes about 7 batches
        depth = min(lookahead_depth(cd.per_point * 7, 2, most=3), steps)
        points = _ternary_points(lo, up, depth)
        vals, _, lams, _ = _inner_many(cd, points)
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
    return best, point


def case_bound(
    job: Job,
    degrees: tuple[int, ...],
    table: ClassTable,
    refine: bool = True,
    at: tuple[float, float] | None = None,
    found: list[tuple[float, float]] | None = None,
    shared: dict[str, float] | None = None,
) -> float:
    """Lagrangian bound on the sum of replica speeds using only ``degrees``.

    Parameters
    ----------
    job
        The job.
    degrees
        The case's TP degrees.
    table
        The domain classes (``hi`` caps the multiplier, per class) and the
        site's power room.
    refine
        ``False`` skips the search over the GPU-count multiplier (a valid,
        possibly weaker bound).
    at
        No search: the dual at these multipliers ``(lambda, mu)`` (valid for
        any; :func:`~ntp_opt.planners.bounds.stage.stage_bound_at`).
    found
        Receives the multipliers of the value returned.
    shared
        The search at ``mu = 0``, kept by the quick call (``refine=False``) and
        taken by the refining one (the same numbers, computed once).

    Returns
    -------
    float
        Upper bound on the sum of replica speeds (sequences per second).
    """
    cd = _case_dual(job, degrees, table)
    if cd is None:
        return 0.0
    if at is not None:
        return cd.dual(*at)[0]
    if shared is not None and "value0" in shared:
        value, lam0, gpus0 = shared["value0"], shared["lam0"], shared["gpus0"]
    else:
        values0, _, lams0, at_zero = _inner_many(cd, [0.0])
        value, lam0, gpus0 = values0[0], lams0[0], at_zero[0]
        if shared is not None:
            shared.update(value0=value, lam0=lam0, gpus0=gpus0)
    point = (lam0, 0.0)
    if refine and gpus0 > cd.cap_gpus:
        # Beyond mu_hi every option's gain is negative, so the minimum is below it.
        per_gpu = [cd.val_s.max(initial=0.0) / min(degrees), cd.gv.max(initial=0.0)]
        up = max(per_gpu) * float(table.hi.max()) ** job.power_exponent * 1.01
        value, point = _mu_search(cd, up, value, point)
    # (else the GPU count can never bind, mu = 0 is optimal)
    if found is not None:
        found.append(point)
    return value
