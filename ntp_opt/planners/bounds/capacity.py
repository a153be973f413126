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

:func:`~ntp_opt.planners.bounds.stage.stage_bound` adds the stage structure of
each domain and the resharding overhead (see its docstring); :func:`capacity_bound`
takes the smaller of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.planners.bounds.stage import stage_bound
from ntp_opt.rules.power import budget_slack, extra_draw
from ntp_opt.rules.tolerances import POWER_TOL

__all__ = ["capacity_bound", "gpu_bound"]


def capacity_bound(instance: Instance) -> float:
    """Upper bound on the goodput (sequences per second) of any plan.

    The smaller of :func:`gpu_bound` and :func:`~ntp_opt.planners.bounds.stage.stage_bound`.

    Parameters
    ----------
    instance
        The instance.

    Returns
    -------
    float
    """
    return min(gpu_bound(instance), stage_bound(instance))


@dataclass(frozen=True)
class _GpuGroups:
    """Groups of interchangeable healthy GPUs (speed ``s``, TDP ``w``, cap ``hi``,
    count ``n``) and the job's power model: the Lagrangian dual of the site budget."""

    s: np.ndarray
    w: np.ndarray
    n: np.ndarray
    hi: np.ndarray
    alpha: float
    idle: float
    max_boost: float
    room: float

    def best_pi(self, lam: float) -> np.ndarray:
        """The best multiplier per group at ``lam``."""
        alpha, s, w, hi = self.alpha, self.s, self.w, self.hi
        if alpha <= 0 or self.max_boost <= 0 or lam <= 0:
            return hi.copy() if lam <= 0 and alpha > 0 else np.ones(len(s))
        if alpha >= 1:  # convex or linear in pi: the best is an end point
            return np.where(s * hi**alpha - lam * w * hi > s - lam * w, hi, 1.0)
        pi = (alpha * s / (lam * w)) ** (1.0 / (1.0 - alpha))
        return np.clip(pi, 1.0, hi)

    def dual(self, lam: float) -> tuple[float, float]:
        """The dual value at ``lam`` and its slope (``room - used watts``)."""
        pi = self.best_pi(lam)
        gain = self.s * pi**self.alpha - extra_draw(lam * self.w, pi, self.idle)
        on = gain > 0
        used = float(extra_draw(self.n * self.w, pi, self.idle)[on].sum())
        return lam * self.room + float((self.n * gain)[on].sum()), self.room - used

    def minimum(self) -> float:
        """The smallest dual value (bisection on its slope)."""
        # D is convex in lambda; its slope is `room - used watts`, increasing in lambda
        value, slope = self.dual(0.0)
        if slope >= 0:
            return value
        lo, hi_lam = 0.0, 1.0
        while self.dual(hi_lam)[1] < 0:
            hi_lam *= 2
        for _ in range(100):
            mid = 0.5 * (lo + hi_lam)
            if self.dual(mid)[1] < 0:
                lo = mid
            else:
                hi_lam = mid
        return min(self.dual(lo)[0], self.dual(hi_lam)[0])


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
    best = _GpuGroups(s, w, n, hi, alpha, idle, job.max_boost, room).minimum()
    speed_sum = best * phi / (job.pp * job.seq_time_s)
    return float(min(speed_sum, replicas_cap))
