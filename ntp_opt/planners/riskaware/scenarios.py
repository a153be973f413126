"""Failure scenarios of risk-aware planning and the goodput of a plan in them.

The training scenarios (:func:`training_scenarios`: every scenario when the
instance has few failure units, else a seeded sample), a disjoint fresh
sample for the reported estimate (:func:`fresh_scenarios`), the goodput after
recourse per scenario (:func:`scenario_goodputs`), the planner's objective
(:func:`objective`) and each GPU's failure probability (:func:`gpu_risk`).
See ``docs/risk.md``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.failures import enumerate_scenarios, failure_units, sample_failure_events
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.rules.expected import Scorer
from ntp_opt.rules.tolerances import PROB_CLIP

__all__ = [
    "SAA_SAMPLES",
    "Scenarios",
    "fresh_scenarios",
    "gpu_risk",
    "objective",
    "scenario_goodputs",
    "training_scenarios",
]


#: Default SAA sample size. On ``mixed`` 300 let the SAA optimum pick a risky
#: rack by sampling noise, where 1,000 does not; but within 60 s on a 1,024-GPU
#: cluster 1,000 leave the bound no time (docs/risk.md, the statistical side).
SAA_SAMPLES = 300


@dataclass(frozen=True)
class Scenarios:
    """Distinct failure scenarios with weights summing to 1.

    Attributes
    ----------
    gpus
        Failed GPU indices (``instance.arrays`` order) of each distinct scenario.
    weights
        Probability (``exact``) or sample frequency (``saa``, ``mc``) of each.
    method
        ``"exact"`` (every scenario), ``"saa"`` or ``"mc"`` (sampled).
    samples
        Scenarios sampled, or distinct scenarios enumerated.
    """

    gpus: tuple[np.ndarray, ...]
    weights: np.ndarray
    method: str
    samples: int


def _sampled(
    instance: Instance, n: int, rng: np.random.Generator, **kw: object
) -> list[np.ndarray]:
    """``n`` sampled scenarios as failed-GPU index arrays (one per scenario)."""
    rows, gpus = sample_failure_events(instance, n, seed=rng, **kw)  # type: ignore[arg-type]
    out = [np.empty(0, dtype=np.int64)] * n
    if len(rows):
        cuts = np.flatnonzero(np.diff(rows)) + 1
        starts = np.concatenate([[0], cuts])
        stops = np.concatenate([cuts, [len(rows)]])
        for s, e in zip(starts, stops, strict=True):
            out[int(rows[s])] = gpus[s:e]
    return out


def _merge(items: list[tuple[np.ndarray, float]], method: str, samples: int) -> Scenarios:
    merged: dict[bytes, float] = {}
    arrays: dict[bytes, np.ndarray] = {}
    for g, w in items:
        key = np.sort(g).astype(np.int64).tobytes()
        merged[key] = merged.get(key, 0.0) + w
        arrays.setdefault(key, np.sort(g).astype(np.int64))
    keys = list(merged)
    weights = np.array([merged[k] for k in keys], dtype=float)
    return Scenarios(tuple(arrays[k] for k in keys), weights / weights.sum(), method, samples)


def training_scenarios(
    instance: Instance,
    *,
    samples: int = SAA_SAMPLES,
    seed: int = 0,
    exact_units: int = 10,
    blast_radius: str = "gpu",
    scale: float = 1.0,
) -> Scenarios:
    """The scenarios the planner optimises over.

    Parameters
    ----------
    instance
        The instance.
    samples
        SAA sample size when the scenarios are not enumerated.
    seed
        Seed of the SAA sample.
    exact_units
        Enumerate every scenario (exact objective) when the instance has at
        most this many independent failure units (at most 20).
    blast_radius, scale
        As in :func:`ntp_opt.model.failures.sample_failures`.

    Returns
    -------
    Scenarios
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not 0 <= exact_units <= 20:
        raise ValueError(f"exact_units must be in [0, 20], got {exact_units}")
    if failure_units(instance, blast_radius, scale) <= exact_units:
        items = [
            (np.flatnonzero(mask), p)
            for mask, p in enumerate_scenarios(instance, blast_radius, scale)
        ]
        return _merge(items, "exact", len(items))
    rng = np.random.default_rng([seed, 0])
    drawn = _sampled(instance, samples, rng, blast_radius=blast_radius, scale=scale)
    return _merge([(g, 1.0 / samples) for g in drawn], "saa", samples)


def fresh_scenarios(
    instance: Instance,
    samples: int,
    *,
    seed: int = 0,
    blast_radius: str = "gpu",
    scale: float = 1.0,
) -> list[np.ndarray]:
    """``samples`` scenarios from a stream disjoint from :func:`training_scenarios`'.

    Returns
    -------
    list of numpy.ndarray
        Failed GPU indices of each scenario, in sample order (not merged, so
        that two plans can be compared scenario by scenario).
    """
    rng = np.random.default_rng([seed, 1])
    return _sampled(instance, samples, rng, blast_radius=blast_radius, scale=scale)


def scenario_goodputs(
    instance: Instance,
    plan: Plan,
    scenarios: list[np.ndarray] | tuple[np.ndarray, ...],
    *,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
) -> np.ndarray:
    """Goodput after recourse of ``plan`` in each scenario.

    Parameters
    ----------
    instance, plan
        The instance and a feasible plan for it.
    scenarios
        Failed GPU indices per scenario.
    deadline
        ``time.perf_counter()`` value after which scoring stops; the result
        is then shorter than ``scenarios`` (at least one scenario is scored).
    cancel
        Once set, scoring stops as at the deadline.

    Returns
    -------
    numpy.ndarray
        Goodput (sequences per second) per scored scenario.
    """
    scorer = Scorer(instance, plan)
    out = np.empty(len(scenarios))
    for i, g in enumerate(scenarios):
        if i > 0 and (
            (deadline is not None and time.perf_counter() > deadline)
            or (cancel is not None and cancel.is_set())
        ):
            return out[:i]
        out[i] = scorer.score_indices(g)
    return out


def objective(instance: Instance, plan: Plan, scenarios: Scenarios) -> float:
    """Weighted mean goodput after recourse over ``scenarios`` (the planner's objective)."""
    return float(np.dot(scenario_goodputs(instance, plan, scenarios.gpus), scenarios.weights))


def gpu_risk(instance: Instance, blast_radius: str = "gpu", scale: float = 1.0) -> np.ndarray:
    """Probability that each GPU fails within the horizon (its own and its tray's units).

    With ``blast_radius="tray"`` a GPU also fails with any GPU of its tray, and with
    ``"domain"`` with any unit of its domain; GPUs already failed have risk 0.
    """
    a = instance.arrays
    p_gpu = np.minimum(a.p_fail * scale, 1.0) * a.healthy
    p_tray = np.minimum(a.tray_p_fail * scale, 1.0)
    log_ok_gpu = np.log1p(-np.minimum(p_gpu, PROB_CLIP))
    log_ok_tray = np.log1p(-np.minimum(p_tray, PROB_CLIP))
    if blast_radius == "gpu":
        log_ok = log_ok_gpu + log_ok_tray[a.gpu_tray]
    elif blast_radius == "tray":
        per_tray = np.bincount(a.gpu_tray, weights=log_ok_gpu, minlength=len(a.tray_ids))
        log_ok = (per_tray + log_ok_tray)[a.gpu_tray]
    else:
        per_dom = np.bincount(a.gpu_domain, weights=log_ok_gpu, minlength=a.n_domains)
        tray_dom = np.zeros(len(a.tray_ids), dtype=np.int64)
        tray_dom[a.gpu_tray] = a.gpu_domain
        per_dom = per_dom + np.bincount(tray_dom, weights=log_ok_tray, minlength=a.n_domains)
        log_ok = per_dom[a.gpu_domain]
    return np.where(a.healthy, -np.expm1(log_ok), 0.0)
