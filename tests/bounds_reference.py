"""The bounds of :mod:`ntp_opt.planners.bounds` as first written (issue 15).

A reference for ``tests/property/test_bounds_reference.py``: the same mathematics,
one ``(lambda, mu)`` point at a time with one numpy call per step, and
``np.unique(axis=0)`` for the domain classes. The fast module must give the
same floats, bit for bit. Do not optimise this file.
"""

from __future__ import annotations

import math

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.rules.tolerances import BUDGET_SLACK, WATT_SLACK
from ntp_opt.rules.validate import POWER_TOL


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
    room = a.site_budget - float((w * n * idle).sum()) + _slack(a.site_budget)
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
        gain = s * pi**alpha - lam * w * (pi - idle)
        on = gain > 0
        used = float((n * w * (pi - idle))[on].sum())
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


def _slack(site_budget: float) -> float:
    """Watts over the site budget the validator forgives (its power tolerance).

    The bounds must hold for every plan the validator accepts, so they give
    the site budget and the largest multiplier the same slack.
    """
    return site_budget * POWER_TOL + WATT_SLACK


def _usable(h: int, degrees: tuple[int, ...]) -> int:
    """Most GPUs ``h`` healthy GPUs can give to stages of the given degrees."""
    reach = np.zeros(h + 1, dtype=bool)
    reach[0] = True
    for n in range(1, h + 1):
        reach[n] = any(t <= n and reach[n - t] for t in degrees)
    return int(np.flatnonzero(reach).max())


def stage_bound(instance: Instance) -> float:
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

    Returns
    -------
    float
        Upper bound on goodput (sequences per second).
    """
    job = instance.job
    a = instance.arrays
    alpha = job.power_exponent
    idle = job.idle_power_fraction
    c = job.seq_time_s
    ok = a.healthy
    if not ok.any():
        return 0.0
    room = a.site_budget - float((a.tdp[ok] * idle).sum()) + _slack(a.site_budget)
    if room < 0:
        return 0.0
    # per domain: the largest cap of its healthy GPUs bounds every stage's multiplier
    dom_cap = np.ones(a.n_domains)
    if alpha > 0:
        np.maximum.at(dom_cap, a.gpu_domain[ok], instance.max_multiplier[ok])
    dom_hi = dom_cap * (1 + POWER_TOL)
    # per domain: healthy speeds descending and TDPs ascending, zero-padded
    dom = a.gpu_domain[ok]
    spd = a.speed[ok]
    tdp = a.tdp[ok]
    h = np.bincount(dom, minlength=a.n_domains)
    width = max(int(h.max()), job.tp)  # every degree indexes a column
    starts = np.concatenate(([0], np.cumsum(h)[:-1]))
    by_speed = np.lexsort((-spd, dom))
    pos = np.arange(len(dom)) - starts[dom[by_speed]]
    speeds = np.zeros((a.n_domains, width))
    speeds[dom[by_speed], pos] = spd[by_speed]
    by_tdp = np.lexsort((tdp, dom))
    tdps = np.zeros((a.n_domains, width))
    tdps[dom[by_tdp], np.arange(len(dom)) - starts[dom[by_tdp]]] = tdp[by_tdp]
    key = np.hstack([h[:, None].astype(float), speeds, tdps, dom_hi[:, None]])
    rows, counts = np.unique(key, axis=0, return_counts=True)
    h_cls = rows[:, 0].astype(np.int64)
    s_cls = rows[:, 1 : 1 + width]
    w_cls = rows[:, 1 + width : 1 + 2 * width]
    hi = rows[:, -1]  # per class
    cum_w = np.concatenate([np.zeros((len(rows), 1)), np.cumsum(w_cls, axis=1)], axis=1)
    cases: list[tuple[tuple[int, ...], float]] = [((job.tp,), 1.0)]
    reduced = tuple(t for t in job.allowed if t < job.tp)
    if reduced:
        cases.append((job.allowed, 1.0 + job.reshard_overhead))
    best = 0.0
    s_max = float(a.speed[ok].max())
    hi_max = float(hi.max())
    for degrees, factor in reversed(cases):  # case B first: it usually decides
        # a quick valid bound for the case first; refine only if it could matter
        quick = _case_bound(
            job, degrees, h_cls, s_cls, w_cls, cum_w, counts, room, hi, idle, refine=False
        )
        if quick / factor <= best:
            continue
        value = _case_bound(job, degrees, h_cls, s_cls, w_cls, cum_w, counts, room, hi, idle)
        if degrees == (job.tp,):
            slots = int((h // job.tp).sum())
            replicas = min(job.replicas_max, slots // job.pp)
        else:
            replicas = job.replicas_max
        v_top = max(job.tp_factor(t) for t in degrees) * s_max * hi_max**alpha / c
        case = min(value, replicas * v_top) / factor
        if job.batch_policy == "fixed" and case > best:
            case = min(
                case,
                _fixed_case_bound(
                    job, degrees, factor, replicas, h_cls, s_cls, w_cls, cum_w, counts, room, hi
                ),
            )
        best = max(best, case)
    return float(best)


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

    def cost(v: np.ndarray, w: np.ndarray, tau: float, hi: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            if alpha > 0:
                pi = np.maximum(1.0, (tau / v) ** (1.0 / alpha))
            else:
                pi = np.where(v >= tau, 1.0, np.inf)
        pi = np.where(v > 0, pi, np.inf)
        return np.where(pi <= hi * (1 + BUDGET_SLACK), w * (np.minimum(pi, hi) - idle), np.inf)

    def feasible(tau: float, n: int) -> bool:
        c1 = cost(val, watts, tau, hi[:, None]).min(axis=1)
        c2 = cost(m_val, m_w, tau, hi)
        c = np.concatenate([c1[single], c2[multi]])
        k = np.concatenate([counts[single], m_cnt[multi]]).astype(float)
        fin = np.isfinite(c)
        c, k = c[fin], k[fin]
        if k.sum() < n:
            return False
        order = np.argsort(c, kind="stable")
        c, k = c[order], k[order]
        before = np.concatenate(([0.0], np.cumsum(k)[:-1]))
        take = np.clip(n - before, 0.0, k)
        return float((c * take).sum()) <= room * (1 + BUDGET_SLACK)

    def u(k: int) -> float:
        n = k * job.pp
        if not feasible(0.0, n):
            return 0.0
        lo, up = 0.0, top
        for _ in range(50):
            mid = 0.5 * (lo + up)
            if feasible(mid, n):
                lo = mid
            else:
                up = mid
        return up  # feasible below up: a valid upper bound on the speed

    if replicas <= 0:
        return 0.0
    grid = sorted(
        {2**i for i in range(replicas.bit_length())}
        | set(range(max(1, replicas - 16), replicas + 1))
    )
    u_grid = {k: u(k) for k in grid}
    ranks = np.arange(1, replicas + 1)
    at = np.array([max(g for g in grid if g <= k) for k in ranks])
    u_rank = np.array([u_grid[int(k)] for k in at]) / job.seq_time_s  # sequences per second
    b_max = min(job.local_batch_max, job.global_batch)
    big_b = job.global_batch
    if b_max * int((u_rank > 0).sum()) < big_b:
        return 0.0  # no replica set can carry B: the job pauses

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
) -> float:
    """Lagrangian bound on the sum of replica speeds using only ``degrees``.

    ``refine=False`` skips the search over the GPU-count multiplier (a valid,
    possibly weaker bound). ``hi`` caps the multiplier, per domain class.
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

    def best_pi(v: np.ndarray, w: np.ndarray, lam: float, hi: np.ndarray) -> np.ndarray:
        hi = np.broadcast_to(hi, v.shape)
        if alpha <= 0 or bool(np.all(hi <= 1.0)):
            return np.ones_like(v)
        if lam <= 0:
            return np.array(hi, dtype=float)
        if alpha >= 1:  # convex or linear in pi: the best is an end point
            at_hi = v * hi**alpha - lam * w * hi
            at_one = v - lam * w
            return np.where(at_hi > at_one, hi, 1.0)
        # w > 0 (TDPs are positive); v = 0 gives pi = 0, clipped to 1
        return np.clip((alpha * v / (lam * w)) ** (1.0 / (1.0 - alpha)), 1.0, hi)

    def dual(lam: float, mu: float) -> tuple[float, float, float]:
        """Dual value and the used watts and GPUs of its maximiser."""
        total = lam * room + mu * cap_gpus
        watts = 0.0
        gpus = 0.0
        if val_s.size:
            pi = best_pi(val_s, w_s, lam, hi_s)
            gain = val_s * pi**alpha - lam * w_s * (pi - idle) - mu * n_s[None, :]
            gain = np.where(val_s > 0, gain, -np.inf)
            k = np.argmax(gain, axis=1)
            g = gain[np.arange(len(k)), k]
            on = single & (g > 0)
            total += float((g[on] * counts[on]).sum())
            rows = np.flatnonzero(on)
            watts += float((w_s[rows, k[rows]] * (pi[rows, k[rows]] - idle) * counts[rows]).sum())
            gpus += float((n_s[k[rows]] * counts[rows]).sum())
        if gv.size:
            pi = best_pi(gv, gw, lam, ghi)
            gain = gv * pi**alpha - lam * gw * (pi - idle) - mu
            on = gain > 0
            total += float((gain[on] * gc[on]).sum())
            watts += float((gw[on] * (pi[on] - idle) * gc[on]).sum())
            gpus += float(gc[on].sum())
        return total, watts, gpus

    def inner(mu: float) -> tuple[float, float]:
        """min over lambda of the dual at ``mu``; and the GPUs used there."""
        value, watts, gpus = dual(0.0, mu)
        if watts <= room:
            return value, gpus
        lo, up = 0.0, 1e-12
        while dual(up, mu)[1] > room:
            up *= 4.0
            if up > 1e12:
                break
        best_v, best_g = dual(up, mu)[0], dual(up, mu)[2]
        for _ in range(40):
            mid = 0.5 * (lo + up)
            v, w, g = dual(mid, mu)
            if v < best_v:
                best_v, best_g = v, g
            if w > room:
                lo = mid
            else:
                up = mid
        return best_v, best_g

    value, _ = inner(0.0)
    if not refine or dual(0.0, 0.0)[2] <= cap_gpus:
        return value  # (the second: the GPU count can never bind, mu = 0 is optimal)
    # D(mu) = min over lambda is convex in mu: ternary search on its values
    # (not on a subgradient, which ties between domain classes make unreliable).
    # Beyond mu_hi every option's gain is negative, so the minimum is below it.
    per_gpu = [val_s.max(initial=0.0) / min(degrees), gv.max(initial=0.0)]
    lo, up = 0.0, max(per_gpu) * float(hi.max()) ** alpha * 1.01
    best = value
    for _ in range(24):
        m1, m2 = lo + (up - lo) / 3, up - (up - lo) / 3
        v1, v2 = inner(m1)[0], inner(m2)[0]
        best = min(best, v1, v2)
        if v1 <= v2:
            up = m2
        else:
            lo = m1
    return best
