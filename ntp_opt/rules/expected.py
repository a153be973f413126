"""Expected goodput of a plan over failure scenarios (docs/model.md, spec section 4).

``E[goodput after recourse]``, where recourse is :func:`ntp_opt.rules.recourse.adapt`
and scenarios come from :mod:`ntp_opt.model.failures`:

* ``method="exact"`` enumerates every scenario of the independent failure
  units (at most :data:`ntp_opt.model.failures.MAX_EXACT_UNITS`); the interval is
  the point itself.
* ``method="mc"`` samples ``samples`` scenarios; the interval is the normal
  approximation ``mean +- z * sd / sqrt(n)`` (``z = 1.96``, 95 %).

Scenarios that fail no GPU in a domain the plan uses all score the
no-new-failure goodput (failures elsewhere only lower the power draw, and the
plan is unchanged); the others are adapted once per distinct set of failed
GPUs inside the plan's domains (cached), unless the recourse had to lower
power, in which case that scenario is adapted with its full mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.failures import enumerate_scenarios, sample_failure_events
from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan
from ntp_opt.rules.recourse import adapt_indices

#: Normal quantile of the two-sided 95 % interval.
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Estimate:
    """An expected goodput (sequences per second) and how it was obtained.

    Attributes
    ----------
    mean
        The estimate (exact value for ``method="exact"``).
    ci_low, ci_high
        95 % confidence interval (equal to ``mean`` for ``exact``).
    method
        ``"mc"`` or ``"exact"``.
    samples
        Scenarios sampled (``mc``) or distinct scenarios enumerated (``exact``).
    std_error
        Standard error of the mean (0 for ``exact``).
    relative_mean
        ``mean * c / R``, as ``relative_goodput``.
    """

    mean: float
    ci_low: float
    ci_high: float
    method: str
    samples: int
    std_error: float = 0.0
    relative_mean: float = 0.0


class Scorer:
    """Goodput of ``plan`` after recourse, cached by the failed GPUs inside the plan's domains.

    Scores scenarios with :func:`ntp_opt.rules.recourse.adapt_indices` (the
    recourse kernel itself); a scenario failing no GPU of a domain the plan
    uses scores :attr:`base` without running recourse.

    Parameters
    ----------
    instance
        The instance.
    plan
        A feasible plan for ``instance``.
    """

    def __init__(self, instance: Instance, plan: Plan) -> None:
        a = instance.arrays
        self.instance = instance
        self.plan = plan
        doms = {a.domain_index[st.domain] for rep in plan.replicas for st in rep.stages}
        self.relevant = np.zeros(a.n_gpus, dtype=bool)
        for d in doms:
            self.relevant[a.domain_gpus[d]] = True
        self.cache: dict[bytes, float] = {}
        self.layout = Layout.from_plan(instance, plan)
        self.adapted = 0
        self.base = self._score(np.zeros(a.n_gpus, dtype=bool))

    def _score(self, mask: np.ndarray) -> float:
        self.adapted += 1
        out = adapt_indices(self.instance, self.plan, mask, self.layout)
        value = float(out.metrics["goodput"])
        if not out.metrics["reduced_power"]:
            self.cache[(mask & self.relevant).tobytes()] = value
        return value

    def score_indices(self, gpus: np.ndarray) -> float:
        """Goodput when exactly the GPUs ``gpus`` fail."""
        inside = gpus[self.relevant[gpus]]
        if len(inside) == 0:
            return self.base
        mask = np.zeros(len(self.relevant), dtype=bool)
        mask[inside] = True
        hit = self.cache.get(mask.tobytes())
        if hit is not None:
            return hit
        mask[gpus] = True
        return self._score(mask)


def expected_goodput(
    instance: Instance,
    plan: Plan,
    *,
    method: str = "mc",
    samples: int = 1000,
    seed: int = 0,
    blast_radius: str = "gpu",
    scale: float = 1.0,
) -> Estimate:
    """Expected goodput of ``plan`` after recourse, over failure scenarios.

    Parameters
    ----------
    instance
        The instance (``p_fail`` of GPUs and trays).
    plan
        A feasible plan for ``instance``.
    method
        ``"mc"`` (Monte Carlo) or ``"exact"`` (enumeration; small instances).
    samples
        Monte Carlo scenarios.
    seed
        Monte Carlo seed.
    blast_radius, scale
        As in :func:`ntp_opt.model.failures.sample_failures`.

    Returns
    -------
    Estimate
    """
    job = instance.job
    scorer = Scorer(instance, plan)
    if method == "exact":
        total = 0.0
        count = 0
        for mask, prob in enumerate_scenarios(instance, blast_radius, scale):
            total += prob * scorer.score_indices(np.flatnonzero(mask))
            count += 1
        return Estimate(total, total, total, "exact", count, 0.0, total * job.seq_time_s / job.dp)
    if method != "mc":
        raise ValueError(f"method must be 'mc' or 'exact', got {method!r}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    rows, gpus = sample_failure_events(
        instance, samples, seed=seed, blast_radius=blast_radius, scale=scale
    )
    values = np.full(samples, scorer.base)
    if len(rows):
        cuts = np.flatnonzero(np.diff(rows)) + 1
        starts = np.concatenate([[0], cuts])
        stops = np.concatenate([cuts, [len(rows)]])
        for s, e in zip(starts, stops, strict=True):
            values[rows[s]] = scorer.score_indices(gpus[s:e])
    mean = float(values.mean())
    se = float(values.std(ddof=1) / math.sqrt(samples)) if samples > 1 else math.inf
    half = Z95 * se
    return Estimate(
        mean, mean - half, mean + half, "mc", samples, se, mean * job.seq_time_s / job.dp
    )
