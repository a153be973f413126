"""Goodput of a plan and the exact batch split (docs/model.md, spec section 3).

Replica speed, in sequences per second::

    v_r = t_r eta(t_r) / (T eta(T)) * min_k [ pi_k^alpha * min_{g in k} speed_g ] / c

Step time and goodput::

    theta = max_r (b_r / v_r) * (1 + rho * [some t_r < T])
    goodput = sum_r b_r / theta
    relative goodput = goodput * c / R

The functions here work on plain numbers so that planners, the validator and
the simulation share one definition of the formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.job import Job
from ntp_opt.rules.tolerances import FLOAT_NOISE, SPLIT_TOL

#: Largest number of ``(step time, replica)`` candidates :func:`split_batch`
#: holds in memory (about 40 bytes each). Larger batch splits are refused
#: with :class:`SizeLimitError` instead of exhausting memory.
MAX_BATCH_CANDIDATES = 4_000_000


#: Below this many candidates every replica's ``min(M, B)`` are listed.
_FULL_BELOW = 4096


class SizeLimitError(ValueError):
    """An instance whose arrays would exceed a planner's memory budget."""


def batch_candidates(job: Job, n_replicas: int | None = None) -> int:
    """Upper bound on the candidates :func:`split_batch` needs for ``n_replicas``.

    Parameters
    ----------
    job
        The job.
    n_replicas
        Number of replicas (default ``dp_max``).

    Returns
    -------
    int
        ``min(B, n * min(M, B))``: a split never needs more than ``B`` candidates
        in all (plus ties), nor more than ``min(M, B)`` per replica.
    """
    n = job.replicas_max if n_replicas is None else n_replicas
    return min(job.global_batch, n * min(job.local_batch_max, job.global_batch))


def check_batch_size(job: Job, n_replicas: int | None = None) -> None:
    """Refuse a job whose batch split would exceed :data:`MAX_BATCH_CANDIDATES`.

    Raises
    ------
    SizeLimitError
        Naming ``job.global_batch`` and ``job.max_local_batch``.
    """
    need = batch_candidates(job, n_replicas)
    if need > MAX_BATCH_CANDIDATES:
        raise SizeLimitError(
            f"job.global_batch: {job.global_batch} sequences with max_local_batch "
            f"{job.local_batch_max} need {need} batch-split candidates, more than the "
            f"memory budget of {MAX_BATCH_CANDIDATES}; scale the batch down (goodput is "
            "relative to it)"
        )


def replica_speed(
    job: Job, tp: int, stage_speeds: Sequence[float], powers: Sequence[float]
) -> float:
    """Speed ``v_r`` of one replica in sequences per second.

    Parameters
    ----------
    job
        The job (``T``, ``eta``, ``alpha``, ``c``).
    tp
        The replica's TP degree ``t_r``.
    stage_speeds
        For each stage, the speed of its slowest GPU.
    powers
        For each stage, its power multiplier ``pi_k``.

    Returns
    -------
    float
        ``v_r``; 0 for a replica with no stages.
    """
    if len(stage_speeds) == 0:
        return 0.0
    alpha = job.power_exponent
    slowest = min(float(p) ** alpha * float(s) for s, p in zip(stage_speeds, powers, strict=True))
    return job.tp_factor(tp) * slowest / job.seq_time_s


def overhead_factor(job: Job, tps: Sequence[int]) -> float:
    """``1 + rho`` when some replica runs below ``T``, else 1."""
    return 1.0 + job.reshard_overhead if len(tps) and min(tps) < job.tp else 1.0


def step_time(
    job: Job, tps: Sequence[int], batches: Sequence[int], speeds: Sequence[float]
) -> float:
    """Step time ``theta`` of a plan; ``inf`` when a replica has speed 0."""
    if len(batches) == 0:
        return float("inf")
    worst = 0.0
    for b, v in zip(batches, speeds, strict=True):
        if v <= 0:
            return float("inf")
        worst = max(worst, b / v)
    return worst * overhead_factor(job, tps)


def goodput(job: Job, tps: Sequence[int], batches: Sequence[int], speeds: Sequence[float]) -> float:
    """Goodput ``sum_r b_r / theta`` in sequences per second (0 for no replica)."""
    return goodput_at(batches, step_time(job, tps, batches, speeds))


def goodput_at(batches: Sequence[int], theta: float) -> float:
    """:func:`goodput` at the step time ``theta`` (:func:`step_time`) of ``batches``."""
    if not np.isfinite(theta) or theta <= 0:
        return 0.0
    return float(sum(batches)) / theta


def relative_goodput(job: Job, value: float) -> float:
    """Goodput relative to the same job with no failures (``goodput * c / R``)."""
    return value * job.seq_time_s / job.dp


@dataclass(frozen=True)
class BatchSplit:
    """Result of :func:`split_batch`.

    Attributes
    ----------
    batches
        Local batch of each replica, in the order of the speeds given.
    step_time
        ``theta`` including the resharding overhead factor.
    goodput
        ``sum(batches) / step_time``.
    """

    batches: tuple[int, ...]
    step_time: float
    goodput: float


def split_batch(
    job: Job, speeds: Sequence[float], tps: Sequence[int], policy: str | None = None
) -> BatchSplit | None:
    """Choose integer local batches that maximise goodput for fixed replicas.

    Exact: the best step time is a breakpoint ``b / v_r`` (docs/model.md,
    "Exact batch split"). Every candidate ``(b / v_r)`` for
    ``b = 1 .. max_local_batch`` is sorted once;
    a step time admitting the first ``k`` candidates gives ``sum b_r = k``.

    * ``fixed``: the smallest step time admitting ``B`` sequences, with every
      replica taking at least one.
    * ``elastic``: maximise ``min(B, k) / theta_k`` over the prefixes ``k``
      that give every replica at least one sequence.

    Parameters
    ----------
    job
        The job (``B``, ``max_local_batch``, policy, overhead).
    speeds
        Replica speeds ``v_r`` (sequences per second), all positive.
    tps
        Replica TP degrees (for the resharding overhead).
    policy
        ``"fixed"`` or ``"elastic"``; defaults to ``job.batch_policy``.

    Returns
    -------
    BatchSplit or None
        ``None`` when no split is feasible (more replicas than ``B``, a replica
        with speed 0, or, for ``fixed``, capacity below ``B``). An empty list
        of replicas gives the paused split (goodput 0).
    """
    policy = policy or job.batch_policy
    n = len(speeds)
    if n == 0:
        return BatchSplit((), float("inf"), 0.0)
    v = np.asarray(speeds, dtype=float)
    cap = job.local_batch_max
    big_b = job.global_batch
    if n > big_b or np.any(v <= 0) or not np.all(np.isfinite(v)):
        return None
    if policy == "fixed" and n * cap < big_b:
        return None
    factor = overhead_factor(job, tps)
    if policy == "fixed" and n * cap == big_b:
        # every candidate is taken: each replica carries its cap (what the
        # general steps below give, without sorting them)
        full = (int(cap),) * n
        theta = max(bb / vv for bb, vv in zip(full, v, strict=True)) * factor
        return BatchSplit(full, float(theta), float(sum(full)) / float(theta))
    times, owner, first = _sorted_candidates(job, v, min(cap, big_b))
    k = _prefix_length(policy, times, first, big_b)
    # Take the first k candidates (every replica's first one included), then
    # drop the latest optional ones until at most B remain.
    chosen = np.zeros(len(times), dtype=bool)
    chosen[:k] = True
    excess = k - big_b
    if excess > 0:
        chosen[np.flatnonzero(chosen & ~first)[::-1][:excess]] = False
    batches = np.bincount(owner[chosen], minlength=n)
    batches_t = tuple(batches.tolist())
    # the largest b_r / v_r, each quotient as in Python (int over float64)
    theta = float((batches / v).max()) * factor
    return BatchSplit(batches_t, float(theta), float(sum(batches_t)) / float(theta))


def _sorted_candidates(job: Job, v: np.ndarray, per: int) -> tuple[np.ndarray, ...]:
    """The candidate (time ``b / v_r``, replica) pairs by time (ties by replica), and
    which are a replica's first; only the first ``per`` of a replica can matter."""
    n = len(v)
    counts = _candidate_counts(v, per, job.global_batch, n)
    if int(counts.sum()) > MAX_BATCH_CANDIDATES:
        check_batch_size(job, n)  # names the fields
        raise SizeLimitError(f"{int(counts.sum())} batch-split candidates exceed the budget")
    owner = np.repeat(np.arange(n), counts)
    starts = np.cumsum(counts) - counts
    b = (np.arange(len(owner)) - starts[owner] + 1).astype(float)
    times = b / v[owner]
    first = b == 1.0
    # by time, ties by replica (then b): a stable sort of the times, which come
    # replica by replica; positive floats sort as their bits read as integers
    order = np.argsort(times.view(np.int64), kind="stable")
    return times[order], owner[order], first[order]


def _prefix_length(policy: str, times: np.ndarray, first: np.ndarray, big_b: int) -> int:
    """How many of the sorted candidates the split admits (see :func:`split_batch`)."""
    # Position (1-based count) by which every replica has its first sequence.
    k_min = int(np.flatnonzero(first)[-1]) + 1
    if policy == "fixed":
        return max(big_b, k_min)
    ks = np.arange(k_min, len(times) + 1)
    values = np.minimum(ks, big_b) / times[ks - 1]
    # Among equal goodputs prefer the largest batch (closest to B).
    best = np.flatnonzero(values >= values.max() * (1 - FLOAT_NOISE))
    return int(ks[best[-1]])


def _candidate_counts(v: np.ndarray, per: int, big_b: int, n: int) -> np.ndarray:
    """How many of each replica's candidates ``b / v_r`` (``b = 1 .. per``) can matter.

    The split takes a prefix of the sorted candidates ending no later than the
    first step time ``theta_K`` at which ``B`` candidates are admitted and every
    replica has its first one
    (the ``elastic`` value ``min(k, B) / theta_k`` only falls after it). Every
    candidate up to ``theta_K (1 + 1e-9)`` is kept, so the split is the same as
    with all ``per`` candidates of every replica, and memory grows with ``B``
    rather than with ``n * per``.
    """
    full = np.full(n, per, dtype=np.int64)
    target = max(big_b, n)
    if n * per <= target or n * per <= _FULL_BELOW:
        return full
    v_min = float(v.min())
    lo, hi = 0.0, per / v_min  # count(hi) = n * per >= target
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if int(np.minimum(per, np.floor(mid * v)).sum()) >= target:
            hi = mid
        else:
            lo = mid
    hi = max(hi, 1.0 / v_min)  # every replica's first candidate (k_min) is admitted
    # floor(hi v) is within one of the exact count of candidates b / v <= hi
    keep = np.floor(np.minimum(per, hi * (1 + SPLIT_TOL) * v)).astype(np.int64) + 2
    return np.minimum(full, np.maximum(keep, 1))
