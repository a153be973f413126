"""The ``fast`` planner: sort-and-pack candidates, the best one validated, with a bound.

Made for instances too large for the exact planner (32k–131k GPUs) and for
re-planning: it builds a few candidate plans in array form, scores each with
the exact batch split, turns only the best into a :class:`~ntp_opt.model.plan.Plan`
(checked by :func:`ntp_opt.solve.solve`) and reports
:func:`ntp_opt.planners.bounds.capacity.capacity_bound` next to it.

The candidates and their scoring are in
:mod:`ntp_opt.planners.fast_candidates`, the domains' cuts and the degree
fits they pack in :mod:`ntp_opt.planners.fast_cuts`.
The winner's multipliers are lowered to what its batch split uses
(:func:`ntp_opt.planners.packing.trim_packed`): the same goodput, no power
spent for nothing. Deterministic: no randomness, ties broken by index.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import Outcome, RunOptions
from ntp_opt.planners.bounds import capacity_bound
from ntp_opt.planners.fast_candidates import Candidate, candidates
from ntp_opt.planners.packing import Packing, packing_replicas, replica_speeds, trim_packed
from ntp_opt.rules.goodput import BatchSplit, goodput
from ntp_opt.rules.tolerances import FLOAT_NOISE

logger = logging.getLogger(__name__)


def _to_plan(instance: Instance, c: Candidate) -> Plan:
    powers = c.powers
    packing = c.packing
    if c.goodput > 0:
        theta = float(sum(c.batches)) / c.goodput
        split = BatchSplit(c.batches, theta, c.goodput)
        if not bool((powers == 1.0).all()):
            powers = trim_packed(instance, packing, powers, split)
        packing = trim_degrees(instance, packing, powers, split)
    replicas = packing_replicas(instance, packing, powers, c.batches)
    return Plan(instance.name, replicas, {"policy": "fast", "candidate": c.name})


def trim_degrees(
    instance: Instance, packing: Packing, powers: np.ndarray, split: BatchSplit
) -> Packing:
    """``packing`` with each replica at the smallest allowed degree that still carries
    its batch at the split's pace: the same goodput on fewer GPUs.

    Replica ``r`` needs the speed ``b_r (1 + rho) / theta`` only; one faster
    than that (a TP36 replica beside TP33 ones, all with the same batch)
    holds GPUs, and their watts, for nothing. Only where some replica with a
    batch already runs below ``T`` (so that ``1 + rho`` stays as it is), at
    the multipliers ``powers``; ``packing`` itself when nothing changes or the
    goodput would drop (rounding).
    """
    job = instance.job
    tp = packing.tp
    batches = np.array(split.batches, dtype=np.int64)
    if len(packing) == 0 or not np.isfinite(split.step_time) or split.step_time <= 0:
        return packing
    if not bool(((tp < job.tp) & (batches > 0)).any()):
        return packing
    need = batches * (1.0 + job.reshard_overhead) / split.step_time * (1.0 - FLOAT_NOISE)
    boost = powers**job.power_exponent
    new = tp.copy()
    for t in sorted(job.allowed, reverse=True):
        lower = t < new
        if not lower.any():
            continue
        speed = (packing.slots.prefix[packing.members, t - 1] * boost).min(axis=1)
        fast_enough = lower & (job.tp_factor(t) * speed / job.seq_time_s >= need)
        new[fast_enough] = t
    if np.array_equal(new, tp):
        return packing
    trimmed = packing.with_tp(new)
    kept = batches > 0  # the plan's replicas
    before = goodput(
        job,
        tp[kept].tolist(),
        batches[kept].tolist(),
        replica_speeds(instance, packing, powers)[kept].tolist(),
    )
    after = goodput(
        job,
        new[kept].tolist(),
        batches[kept].tolist(),
        replica_speeds(instance, trimmed, powers)[kept].tolist(),
    )
    return trimmed if after >= before * (1.0 - FLOAT_NOISE) else packing


def plan_fast(
    instance: Instance, options: RunOptions = RunOptions(), *, bound: bool = True
) -> Outcome:
    """The best candidate plan (not yet checked) and an upper bound on goodput.

    Parameters
    ----------
    instance
        The instance.
    options
        Only its cancel token is read (``options.control.cancel``): once set,
        packing stops (:func:`candidates`) and the plan is the best candidate
        scored so far.
    bound
        Compute the bound (default). ``False`` (a caller with a bound of its
        own: :func:`ntp_opt.workflows.replan.replan`) leaves it out.

    Returns
    -------
    Outcome
        Its plan (empty when every candidate pauses; with the bound as its
        ``bound`` metric) and its ``bound``:
        :func:`~ntp_opt.planners.bounds.capacity.capacity_bound`, or ``None``
        unless ``bound``. :func:`ntp_opt.solve.solve` checks the plan; a
        direct caller may call :func:`ntp_opt.rules.validate.certified`.
    """
    with gc_paused():
        found = candidates(instance, cancel=options.control.cancel)
        logger.debug(
            "fast: %d candidates%s", len(found), f", best {found[0].name}" if found else ""
        )
        if found:
            plan = _to_plan(instance, found[0])
        else:
            plan = Plan(instance.name, (), {"policy": "fast", "paused": True})
        if not bound:
            return Outcome(plan)
        value = capacity_bound(instance)
    return Outcome(plan.with_metrics(bound=value), bound=value)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (and back to its state after).

    ``fast`` creates one :class:`~ntp_opt.model.plan.Stage` per stage and
    lists of numbers, no reference cycles: collections triggered by those
    allocations would only scan the instance's long-lived objects again
    (tens of milliseconds at 131k GPUs). Reference counting still frees
    everything as usual.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
