"""A cheap upper bound on goodput: every healthy GPU at its best power.

A replica's speed is at most the average over its ``t pp`` GPUs of
``pi^alpha s`` times ``f(t) / (t pp c)``, so the total speed of any plan is at
most ``phi / (pp c) * sum_g pi_g^alpha s_g`` over the GPUs it uses, with
``phi = max_t f(t) / t``. The site budget limits ``sum_g tdp_g (pi_g - idle)``.
Lagrangian duality on that budget gives a bound for every multiplier; the
best one is found by bisection. Goodput never exceeds total speed (each
replica's batch is at most ``theta v_r``), nor ``dp_max`` replicas at the
fastest possible speed. Rack budgets are left out, which keeps it valid.
"""

from __future__ import annotations

import numpy as np

from ..instance import Instance


def capacity_bound(instance: Instance) -> float:
    """Upper bound on the goodput (sequences per second) of any plan.

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
    s = a.speed[a.healthy]
    w = a.tdp[a.healthy]
    if len(s) == 0:
        return 0.0
    alpha = job.power_exponent
    hi = 1.0 + job.max_boost
    idle = job.idle_power_fraction
    room = a.site_budget - float((w * idle).sum())
    phi = max(job.tp_factor(t) / t for t in job.allowed)
    v_max = max(job.tp_factor(t) for t in job.allowed) * float(s.max()) * hi**alpha
    replicas_cap = job.replicas_max * v_max / job.seq_time_s

    def best_pi(lam: float) -> np.ndarray:
        if alpha <= 0 or job.max_boost <= 0 or lam <= 0:
            return np.full(len(s), hi if lam <= 0 and alpha > 0 else 1.0)
        pi = (alpha * s / (lam * w)) ** (1.0 / (1.0 - alpha)) if alpha < 1 else np.full(len(s), hi)
        return np.clip(pi, 1.0, hi)

    def dual(lam: float) -> tuple[float, float]:
        pi = best_pi(lam)
        gain = s * pi**alpha - lam * w * (pi - idle)
        on = gain > 0
        return lam * room + float(gain[on].sum()), room - float((w * (pi - idle))[on].sum())

    # D is convex in lambda; its slope is `room - used watts`, increasing in lambda
    value, slope = dual(0.0)
    if slope >= 0:
        best = value
    else:
        lo, hi_lam = 0.0, 1.0
        while dual(hi_lam)[1] < 0:
            hi_lam *= 2
        for _ in range(200):
            mid = 0.5 * (lo + hi_lam)
            if dual(mid)[1] < 0:
                lo = mid
            else:
                hi_lam = mid
        best = min(dual(lo)[0], dual(hi_lam)[0])
    speed_sum = best * phi / (job.pp * job.seq_time_s)
    return float(min(speed_sum, replicas_cap))
