"""The smallest step time at which a capacity solution's stages still fit
(:func:`tighten`), and their power multipliers there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ntp_opt.planners.exact.model import Prepared, StagePick
from ntp_opt.rules.power import exceeds, extra_draw, idle_draw
from ntp_opt.rules.power import fits as budget_fits
from ntp_opt.rules.tolerances import BISECT_TOL, BUDGET_SLACK, TIGHTEN_TOL

__all__ = ["tighten"]


def tighten(prep: Prepared, stages: Sequence[StagePick], theta: float) -> tuple[float, list[float]]:
    """Smallest step time at which the same stages still fit, and their powers there.

    Lowering the step time raises every stage's power need; the stages keep
    fitting while every multiplier stays within its stage's cap and every
    rack and the site stay within budget. That set of step times is an
    interval ending at ``theta``; its left end is found by bisection (to a
    relative ``BISECT_TOL``), or exactly when power cannot be boosted.

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    stages
        As from :func:`~ntp_opt.planners.exact.capacity.iter_stages`, feasible at ``theta``.
    theta
        The step time they were found at.

    Returns
    -------
    (float, list of float)
        The tightened step time and each stage's power multiplier there.
    """
    inst = prep.instance
    job = inst.job
    a = inst.arrays
    if not stages:
        return theta, []
    # the stages' GPUs, concatenated in stage order, and where each stage starts
    sizes = np.array([len(st.gpus) for st in stages], dtype=np.int64)
    gpus = np.fromiter(
        (g for st in stages for g in st.gpus), dtype=np.int64, count=int(sizes.sum())
    )
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    batch = np.array([st.batch for st in stages], dtype=float)
    factor = np.array([job.tp_factor(st.degree) for st in stages])
    slowest = np.minimum.reduceat(a.speed[gpus], starts)
    need = batch * job.seq_time_s / (factor * slowest)  # theta * (speed-up needed) per stage
    if job.max_boost <= 0 or job.power_exponent <= 0:
        return float(need.max()), [1.0] * len(stages)
    fit = _stage_fit(prep, stages, gpus, sizes, starts, need)
    lo = float((need / fit.hi_pi**fit.alpha).max())  # below this some stage needs too much power
    hi = theta
    if not fit.fits(hi):
        return theta, [float(p) for p in fit.powers(theta)]
    if fit.fits(lo):
        hi = lo
    else:
        while hi / lo - 1 > BISECT_TOL:
            mid = math.sqrt(lo * hi)
            if fit.fits(mid):
                hi = mid
            else:
                lo = mid
    return hi, [min(float(p), float(c)) for p, c in zip(fit.powers(hi), fit.hi_pi, strict=True)]


@dataclass(frozen=True, eq=False)
class _StageFit:
    """The stages' power needs and the budgets they draw from: whether they fit at a
    step time."""

    need: np.ndarray  # theta * (speed-up needed), per stage
    alpha: float
    idle: float
    hi_pi: np.ndarray  # per stage: its cap
    tdp: np.ndarray  # per stage GPU (stage order)
    stage_of: np.ndarray  # each stage GPU's stage
    stage_tdp: np.ndarray  # per stage: its GPUs' TDP sum
    base_rack: np.ndarray  # idle draw per rack
    rack_idx: np.ndarray  # every rack, then each stage GPU's rack
    rack_budget: np.ndarray
    site_budget: float

    def powers(self, th: float) -> np.ndarray:
        """Each stage's multiplier at step time ``th`` (not capped)."""
        return np.maximum(1.0, (self.need / th) ** (1.0 / self.alpha))

    def fits(self, th: float) -> bool:
        """Whether the stages fit their caps, racks and the site at step time ``th``."""
        pi = self.powers(th)
        if np.any(pi > self.hi_pi * (1 + BUDGET_SLACK)):
            return False
        base_rack = self.base_rack
        n_racks = len(base_rack)
        extra = extra_draw(self.tdp, pi[self.stage_of], self.idle)
        rack = np.bincount(
            self.rack_idx, weights=np.concatenate((base_rack, extra)), minlength=n_racks
        )
        if np.any(exceeds(rack, self.rack_budget, tol=TIGHTEN_TOL, slack=0.0)):
            return False
        site = float(base_rack.sum() + extra_draw(self.stage_tdp, pi, self.idle).sum())
        return bool(budget_fits(site, self.site_budget, tol=TIGHTEN_TOL, slack=0.0))


def _stage_fit(
    prep: Prepared,
    stages: Sequence[StagePick],
    gpus: np.ndarray,
    sizes: np.ndarray,
    starts: np.ndarray,
    need: np.ndarray,
) -> _StageFit:
    """What :meth:`_StageFit.fits` reads, for the stages on ``gpus`` (stage order)."""
    inst = prep.instance
    job = inst.job
    a = inst.arrays
    # per stage: 1 + max_boost, or less where a board accepts less
    hi_pi = np.minimum.reduceat(inst.max_multiplier[gpus], starts)
    tdp = a.tdp[gpus]
    stage_tdp = np.array([float(x.sum()) for x in np.split(tdp, starts[1:])])
    base_rack = np.bincount(a.gpu_rack, weights=idle_draw(inst), minlength=len(a.rack_ids))
    # one bincount adds the idle draw first, then every stage GPU's extra draw in
    # stage order: the same additions in the same order as one np.add.at per stage
    rack_idx = np.concatenate((np.arange(len(base_rack)), a.gpu_rack[gpus]))
    return _StageFit(
        need,
        job.power_exponent,
        job.idle_power_fraction,
        hi_pi,
        tdp,
        np.repeat(np.arange(len(stages)), sizes),
        stage_tdp,
        base_rack,
        rack_idx,
        a.rack_budget,
        a.site_budget,
    )
