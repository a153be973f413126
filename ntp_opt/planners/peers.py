"""Peer baselines: Megatron-LM's nonuniform TP defaults and a Malleus-style batch ILP.

Two public systems are the closest to what this package does; both are
re-implemented here from their published behaviour (see ``docs/peers.md``
for the sources and every decision):

* ``megatron-ntp`` -- what Megatron-LM's nonuniform tensor parallelism
  (``megatron/core/distributed/nonuniform_tp.py``) does out of the box. Every
  DP replica that contains failed GPUs runs at one common reduced degree
  ``tp_base - tp_spares``, where ``tp_spares`` is the largest number of failed
  local ranks in any of them; replicas with fewer failures deactivate extra
  healthy ranks, highest local ranks first ("parity"). Every other replica
  keeps ``tp_base``. Every replica keeps the same local batch (the runtime
  does not rebalance batches), and nothing is boosted. :func:`megatron_ntp`
  keeps the rank layout the job was launched with (failures fall wherever
  they fall); :func:`megatron_ntp_reordered` models a launcher that knows the
  failures and packs the failed domains into the first replicas, as the NTP
  paper's launcher does.
* ``malleus-ilp`` -- the min-max integer program Malleus solves with
  PuLP + CBC to spread micro-batches over pipelines of different speeds:
  minimise ``max_i o_i m_i`` subject to ``sum_i m_i = N``.
  :func:`malleus_split` is a *corrected* re-implementation (``m_i >= 1``, a
  time limit, the solution read per pipeline, proven only when CBC proves
  it); :func:`malleus_split_as_shipped` reproduces what the released code
  does (``m_i >=`` the pipeline's stage count, no time limit by default, the
  solution read in variable-name order, any ``Optimal`` status accepted);
  :func:`our_split` solves the same input with this package's exact batch
  split (:func:`ntp_opt.rules.goodput.split_batch`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.planners.base import Outcome, RunOptions
from ntp_opt.planners.packing import fits_at_power_one
from ntp_opt.rules.goodput import split_batch

#: Rank orders of the launcher: ``"tp-dp-pp"`` is Megatron-LM's default
#: (``order="tp-cp-ep-dp-pp"`` with no context or expert parallelism: TP ranks
#: vary fastest, then DP, then PP); ``"tp-pp-dp"`` puts a replica's stages on
#: consecutive TP groups.
RankOrder = Literal["tp-dp-pp", "tp-pp-dp"]

# ---------------------------------------------------------------------------
# Megatron-LM nonuniform TP
# ---------------------------------------------------------------------------


def tp_spares_with_parity(
    failed_ranks: Mapping[int, Sequence[int]], tp_base: int, spares: int | None = None
) -> tuple[int, dict[int, list[int]]]:
    """Uniform spare count and the deactivated local ranks of every faulty group.

    The behaviour of Megatron-LM's ``compute_uniform_tp_spares_with_parity``:
    the spare count is the largest number of failed local ranks in any group;
    a group with fewer failures also deactivates its highest healthy local
    ranks until it has that many inactive ranks.

    Parameters
    ----------
    failed_ranks
        For every group (DP rank, or DP rank and stage) with failures, its
        failed local TP ranks in ``range(tp_base)``.
    tp_base
        Nominal TP degree.
    spares
        Deactivate this many ranks per group instead of the largest failure
        count (it must not be smaller); used when the reduced degree has to be
        rounded down to an allowed one.

    Returns
    -------
    tuple of (int, dict)
        The spare count and, per group, its sorted inactive local ranks.

    Examples
    --------
    >>> tp_spares_with_parity({0: [2, 5], 1: [1]}, 8)
    (2, {0: [2, 5], 1: [1, 7]})
    """
    if not failed_ranks:
        return (0 if spares is None else spares), {}
    most = max(len(set(r)) for r in failed_ranks.values())
    count = most if spares is None else spares
    if count < most:
        raise ValueError(f"spares={count} is fewer than the {most} failed ranks of a group")
    if count > tp_base:
        raise ValueError(f"spares={count} exceeds tp_base={tp_base}")
    inactive: dict[int, list[int]] = {}
    for group, ranks in failed_ranks.items():
        failed = set(ranks)
        bad = [r for r in failed if not 0 <= r < tp_base]
        if bad:
            raise ValueError(f"group {group}: local ranks {bad} outside range({tp_base})")
        healthy = [r for r in range(tp_base) if r not in failed]
        extra = count - len(failed)
        pad = healthy[len(healthy) - extra :] if extra > 0 else []
        inactive[group] = sorted(failed | set(pad))
    return count, inactive


@dataclass(frozen=True)
class Layout:
    """Where a Megatron job's TP groups sit, replica by replica.

    Attributes
    ----------
    groups
        For replica ``r``, its ``pp`` TP groups in stage order; a group is the
        array of GPU indices of local ranks ``0 .. T-1`` (``None`` for a
        replica the cluster has no room for).
    domains
        The domain index of every group, in the same shape.
    """

    groups: tuple[tuple[np.ndarray, ...] | None, ...]
    domains: tuple[tuple[int, ...] | None, ...]


def _domain_slots(instance: Instance, healthy_first: bool) -> list[tuple[int, np.ndarray]]:
    """Cut every domain, in graph order, into ``size // T`` groups of ``T`` GPUs."""
    a = instance.arrays
    big_t = instance.job.tp
    slots: list[tuple[int, np.ndarray]] = []
    for d, members in enumerate(a.domain_gpus):
        if healthy_first:  # a launcher that knows the failures maps ranks to healthy GPUs first
            members = np.concatenate([members[a.healthy[members]], members[~a.healthy[members]]])
        for j in range(len(members) // big_t):
            slots.append((d, members[j * big_t : (j + 1) * big_t]))
    return slots


def megatron_layout(
    instance: Instance, *, reordered: bool = False, rank_order: RankOrder = "tp-dp-pp"
) -> Layout:
    """Place the job's ``dp x pp`` TP groups the way a Megatron launcher does.

    Every domain (graph order) holds ``size // T`` TP groups, each on ``T``
    consecutive GPUs of the domain; GPUs beyond them are outside the job.

    * As launched (``reordered=False``): the ``g``-th TP group in rank order
      takes the ``g``-th slot, local ranks on the slot's GPUs in graph order.
      Under ``"tp-dp-pp"`` (Megatron's default) replica ``r``'s stage ``k`` is
      TP group ``k * dp + r``; under ``"tp-pp-dp"`` it is ``r * pp + k``.
    * Re-ordered (``reordered=True``): the launcher knows the failures. It maps
      each domain's local ranks to its healthy GPUs first, keeps the
      ``dp x pp`` slots with the fewest failures, and fills replicas slot by
      slot in order of decreasing failures (ties in graph order), so partially
      failed domains are packed into as few replicas as possible and come
      first in rank order, as Megatron's ``num_reduced_tp_dp_ranks`` assumes.

    Parameters
    ----------
    instance
        The instance.
    reordered
        Re-ordered launcher instead of the launch-time layout.
    rank_order
        Rank order of the as-launched layout (ignored when ``reordered``).

    Returns
    -------
    Layout
    """
    job = instance.job
    healthy = instance.arrays.healthy
    n_rep, n_stage = job.dp, job.pp
    slots = _domain_slots(instance, healthy_first=reordered)
    if reordered:
        fails = [int((~healthy[g]).sum()) for _, g in slots]
        keep = sorted(range(len(slots)), key=lambda i: (fails[i], i))[: n_rep * n_stage]
        keep.sort(key=lambda i: (-fails[i], i))
        order = [slots[i] for i in keep]
        stage_major = False  # replica r's stages on consecutive slots
    else:
        order = slots
        if rank_order not in ("tp-dp-pp", "tp-pp-dp"):
            raise ValueError(f"unknown rank_order {rank_order!r}")
        stage_major = rank_order == "tp-dp-pp"
    groups: list[tuple[np.ndarray, ...] | None] = []
    domains: list[tuple[int, ...] | None] = []
    for r in range(n_rep):
        idx = [k * n_rep + r if stage_major else r * n_stage + k for k in range(n_stage)]
        if max(idx) >= len(order):
            groups.append(None)  # the cluster has no room for this replica
            domains.append(None)
            continue
        groups.append(tuple(order[i][1] for i in idx))
        domains.append(tuple(order[i][0] for i in idx))
    return Layout(tuple(groups), tuple(domains))


def megatron_plan(
    instance: Instance,
    *,
    reordered: bool = False,
    rank_order: RankOrder = "tp-dp-pp",
) -> Plan:
    """Megatron-LM's nonuniform TP, out of the box.

    1. Lay the job out with :func:`megatron_layout`.
    2. A stage's failures are the failed GPUs among its ``T`` local ranks; a
       replica's failure count is the largest over its stages.
    3. A replica that cannot run at any allowed degree even on its own
       (``T - failures`` below every degree in ``job.tp_allowed``: its shards
       do not fit in memory) is dropped.
    4. The remaining replicas with failures run at one common degree: the
       largest allowed degree ``<= T - max failures`` (Megatron's
       ``tp_base - tp_spares``, with ``tp_spares`` raised to reach an allowed
       degree); in every stage the lowest healthy local ranks stay active,
       the others are padded out. The other replicas run at ``T``.
    5. Every replica takes the nominal local batch ``b = min(max_local_batch,
       B // R)`` (at least 1). Under the ``fixed`` policy a plan whose batches
       do not sum to ``B`` (a dropped replica) pauses: no replicas, goodput 0.
    6. Power stays at 1. If racks or the site cannot feed the replicas even
       so, the last replicas are dropped until they can.

    Parameters
    ----------
    instance
        The instance.
    reordered
        Use the re-ordering launcher (see :func:`megatron_layout`).
    rank_order
        Rank order of the as-launched layout.

    Returns
    -------
    Plan
        The plan, not validated (:func:`ntp_opt.solve.solve` checks it; a direct
        caller may call :func:`ntp_opt.rules.validate.certified`); its metrics
        add ``tp_spares`` (``T`` minus the common reduced degree, 0 if no
        replica is reduced) and ``dropped_replicas``.
    """
    job = instance.job
    big_t = job.tp
    layout = megatron_layout(instance, reordered=reordered, rank_order=rank_order)
    failures = _replica_failures(instance, layout)
    kept = sorted(failures)[: job.replicas_max]
    worst = max((failures[r] for r in kept), default=0)
    reduced = job.largest_allowed(big_t - worst)
    assert reduced is not None  # every kept replica runs at some allowed degree
    degree = {r: big_t if failures[r] == 0 else reduced for r in kept}
    _drop_over_budget(instance, layout, kept, degree)
    replicas = _nominal_replicas(instance, layout, kept, degree)
    spares = big_t - reduced if any(r.tp < big_t for r in replicas) else 0
    policy = "megatron-ntp-reordered" if reordered else "megatron-ntp"
    plan = Plan(
        instance.name,
        replicas,
        {
            "policy": policy,
            "paused": not replicas,
            "tp_spares": spares,
            "dropped_replicas": job.dp - len(replicas),
        },
    )
    return plan


def _replica_failures(instance: Instance, layout: Layout) -> dict[int, int]:
    """Per replica that can run at an allowed degree, its largest stage failure count."""
    healthy = instance.arrays.healthy
    job = instance.job
    failures: dict[int, int] = {}
    for r, groups in enumerate(layout.groups):
        if groups is None:
            continue
        f = max(int((~healthy[g]).sum()) for g in groups)
        if job.largest_allowed(job.tp - f) is not None:
            failures[r] = f
    return failures


def _active(instance: Instance, layout: Layout, r: int, degree: int) -> list[np.ndarray]:
    """Replica ``r``'s stages' active GPUs: each one's lowest ``degree`` healthy local ranks."""
    healthy = instance.arrays.healthy
    return [g[healthy[g]][:degree] for g in layout.groups[r] or ()]


def _drop_over_budget(
    instance: Instance, layout: Layout, kept: list[int], degree: dict[int, int]
) -> None:
    """Step 6: drop the last replicas of ``kept`` (in place) until the racks and the
    site can feed the others at power 1."""
    used = np.zeros(instance.arrays.n_gpus, dtype=bool)
    for r in kept:
        for g in _active(instance, layout, r, degree[r]):
            used[g] = True
    while kept and not fits_at_power_one(instance, used):
        r = kept.pop()  # a budget below the GPUs' TDP: drop the last replicas
        for g in _active(instance, layout, r, degree[r]):
            used[g] = False


def _nominal_replicas(
    instance: Instance, layout: Layout, kept: list[int], degree: dict[int, int]
) -> tuple[Replica, ...]:
    """Step 5: the kept replicas at the nominal local batch, power 1; none when their
    batches exceed ``B`` or, under the ``fixed`` policy, miss it."""
    a = instance.arrays
    job = instance.job
    local = max(1, min(job.local_batch_max, job.global_batch // job.dp))
    total = local * len(kept)
    feasible = total <= job.global_batch and (
        job.batch_policy != "fixed" or total == job.global_batch
    )
    if not (feasible and kept):
        return ()
    return tuple(
        Replica(
            tp=degree[r],
            local_batch=local,
            stages=tuple(
                Stage(
                    domain=a.domain_ids[d],
                    gpus=tuple(a.gpu_ids[i] for i in g),
                    power=1.0,
                )
                for d, g in zip(
                    layout.domains[r] or (), _active(instance, layout, r, degree[r]), strict=True
                )
            ),
        )
        for r in kept
    )


def megatron_ntp(instance: Instance, options: RunOptions = RunOptions()) -> Outcome:
    """Megatron-LM's nonuniform TP on the launch-time rank layout.

    Parameters
    ----------
    instance
        The instance.
    options
        Not read (the planner runs to the end).

    Returns
    -------
    Outcome
        Its plan (empty when the job pauses; see :func:`megatron_plan`), not
        yet checked: :func:`ntp_opt.solve.solve` checks it.
    """
    return Outcome(megatron_plan(instance, reordered=False))


def megatron_ntp_reordered(instance: Instance, options: RunOptions = RunOptions()) -> Outcome:
    """Megatron-LM's nonuniform TP after a launcher packs failed domains first.

    Parameters and result as :func:`megatron_ntp`.
    """
    return Outcome(megatron_plan(instance, reordered=True))


# ---------------------------------------------------------------------------
# Malleus-style batch split
# ---------------------------------------------------------------------------


class SplitOutcome(NamedTuple):
    """A micro-batch split and how it was found.

    Attributes
    ----------
    m
        Micro-batches per replica, in the order of the times given (empty when
        no split was found).
    objective
        ``max_i o_i m_i`` (``inf`` without a split).
    proven
        The solver proved the split optimal.
    seconds
        Wall-clock seconds, model building included.
    """

    m: list[int]
    objective: float
    proven: bool
    seconds: float


def split_objective(times: Sequence[float], m: Sequence[int]) -> float:
    """``max_i o_i m_i``: the step time of a split (``inf`` for an empty one)."""
    if len(m) == 0:
        return math.inf
    return max(float(o) * int(k) for o, k in zip(times, m, strict=True))


def _check_split_input(times: Sequence[float], n_micro_total: int) -> None:
    if len(times) == 0:
        raise ValueError("times must not be empty")
    if not all(math.isfinite(o) and o > 0 for o in times):
        raise ValueError("times must be positive and finite")
    if n_micro_total < len(times):
        raise ValueError(
            f"n_micro_total={n_micro_total} is fewer than one micro-batch per replica "
            f"({len(times)} replicas)"
        )


def malleus_split(
    times: Sequence[float],
    n_micro_total: int,
    *,
    time_limit: float | None = 30.0,
    msg: bool = False,
) -> SplitOutcome:
    """Malleus's batch split: the min-max integer program, solved with PuLP + CBC
    (:func:`~ntp_opt.planners.exact.backends.malleus.malleus_min_max`).

    ``minimise z`` subject to ``o_i m_i <= z``, ``sum_i m_i = N``, ``m_i >= 1``
    integer.

    Parameters
    ----------
    times
        ``o_i``: seconds replica ``i`` spends per micro-batch.
    n_micro_total
        ``N = B / b``: micro-batches per step.
    time_limit
        CBC's time limit in seconds (``None``: none).
    msg
        Show CBC's log.

    Returns
    -------
    SplitOutcome
        ``proven`` only when CBC reports both an optimal status and an optimal
        solution: a time-limited CBC reports ``status`` Optimal with
        ``sol_status`` "integer feasible" for the best point it found (PuLP
        issue #711). Without any integer point, ``m`` is empty and the
        objective ``inf``.

    Raises
    ------
    ValueError
        On empty or non-positive times, or ``N`` below the replica count.
    BackendUnavailable
        Without PuLP (an ``ImportError`` naming ``pip install 'ntp-opt[cbc]'``).
    """
    _check_split_input(times, n_micro_total)
    # imported here: the fast path (which imports this module) loads no backend
    from ntp_opt.planners.exact.backends.malleus import malleus_min_max

    start = time.perf_counter()
    answer = malleus_min_max(times, n_micro_total, time_limit, msg)
    seconds = time.perf_counter() - start
    values = answer.values
    if not values or any(v is None for v in values):
        return SplitOutcome([], math.inf, False, seconds)
    counts = [round(float(v)) for v in values if v is not None]
    if sum(counts) != n_micro_total or min(counts) < 1:  # never trust a solver's point
        return SplitOutcome([], math.inf, False, seconds)
    proven = answer.status_optimal and answer.solution_optimal
    return SplitOutcome(counts, split_objective(times, counts), proven, seconds)


class ShippedOutcome(NamedTuple):
    """What the released Malleus ILP returns and what it then applies.

    Attributes
    ----------
    m
        Micro-batches per pipeline as applied: the solver's values read in
        variable-name order (``m_0, m_1, m_10, m_11, ..., m_2, ...``) and
        assigned to pipelines ``0, 1, 2, ...`` (empty without a point).
    reported
        The objective CBC reports (``inf`` without a point).
    applied
        ``max_i o_i m_i`` of the applied counts: the step time the job gets.
    accepted
        ``status`` is Optimal, the only check the released code makes.
    proven
        ``status`` and ``sol_status`` both optimal.
    seconds
        Wall-clock seconds, model building included.
    """

    m: list[int]
    reported: float
    applied: float
    accepted: bool
    proven: bool
    seconds: float


def malleus_split_as_shipped(
    times: Sequence[float],
    n_micro_total: int,
    stages: int | Sequence[int],
    *,
    time_limit: float | None = None,
    msg: bool = False,
) -> ShippedOutcome:
    """The batch split as the released Malleus code solves and applies it.

    Facts of PKU-DAIR/Hetu ``python/hetu/engine/strategy.py``,
    ``solve_pp_arrangement`` (second program), re-implemented here (our code):
    ``minimise z`` s.t. ``z >= o_i m_i``, ``sum_i m_i = N``, ``m_i >= S_i``
    (the pipeline's number of stages, not 1), solved by PuLP's default CBC
    with no time limit; the point is accepted when ``status`` is Optimal; the
    counts are read from ``problem.variables()`` -- which PuLP sorts by name
    -- and appended in that order, so from 11 pipelines on ``m_10`` lands on
    pipeline 2 and so on.

    Parameters
    ----------
    times
        ``o_i``: seconds pipeline ``i`` spends per micro-batch.
    n_micro_total
        ``N``: micro-batches per step.
    stages
        ``S_i``: stages per pipeline (one number for all, or one per pipeline).
    time_limit
        CBC's time limit (``None``, the released behaviour: none).
    msg
        Show CBC's log.

    Returns
    -------
    ShippedOutcome
        Counts as applied, the reported and the applied step time.

    Raises
    ------
    ValueError
        On empty or non-positive times, or ``N`` below the sum of the lower bounds.
    BackendUnavailable
        Without PuLP (an ``ImportError`` naming ``pip install 'ntp-opt[cbc]'``).
    """
    _check_split_input(times, n_micro_total)
    n = len(times)
    lows = [int(stages)] * n if isinstance(stages, int) else [int(x) for x in stages]
    if len(lows) != n or min(lows) < 1 or sum(lows) > n_micro_total:
        raise ValueError("stages: one count >= 1 per pipeline, summing to at most N")
    from ntp_opt.planners.exact.backends.malleus import malleus_shipped

    start = time.perf_counter()
    answer = malleus_shipped(times, n_micro_total, lows, time_limit, msg)
    accepted = answer.status_optimal
    proven = accepted and answer.solution_optimal
    values, reported = answer.values, answer.objective
    seconds = time.perf_counter() - start
    if not accepted or any(v is None for v in values) or reported is None:
        return ShippedOutcome([], math.inf, math.inf, accepted, proven, seconds)
    counts = [round(float(v)) for v in values if v is not None]
    return ShippedOutcome(
        counts, float(reported), split_objective(times, counts), accepted, proven, seconds
    )


def our_split(times: Sequence[float], n_micro_total: int) -> SplitOutcome:
    """The same program solved by this package's exact batch split.

    Runs :func:`ntp_opt.rules.goodput.split_batch` under the ``fixed`` policy with
    speeds ``v_i = 1 / o_i``, ``B = N`` and every replica at the nominal
    degree (no resharding overhead). ``max_local_batch`` is set to
    ``ceil(N / n) * ceil(max o / min o)``, which no optimal split exceeds:
    the even split has step time at most ``max o * ceil(N / n)``, so an
    optimal ``m_i`` is at most that divided by ``o_i``.

    Parameters
    ----------
    times
        ``o_i``: seconds replica ``i`` spends per micro-batch.
    n_micro_total
        ``N``: micro-batches per step.

    Returns
    -------
    SplitOutcome
        Always ``proven`` (the split is exact).

    Raises
    ------
    ValueError
        On empty or non-positive times, or ``N`` below the replica count.
    """
    _check_split_input(times, n_micro_total)
    start = time.perf_counter()
    n = len(times)
    o = np.asarray(times, dtype=float)
    even = -(-n_micro_total // n)
    cap = min(n_micro_total - n + 1, even * math.ceil(float(o.max() / o.min())))
    cap = max(cap, even)
    job = Job(
        tp=1,
        pp=1,
        dp=n,
        global_batch=n_micro_total,
        max_local_batch=cap,
        batch_policy="fixed",
        reshard_overhead=0.0,
    )
    split = split_batch(job, list(1.0 / o), [1] * n, policy="fixed")
    seconds = time.perf_counter() - start
    if split is None:  # cannot happen for valid input; kept for safety
        return SplitOutcome([], math.inf, False, seconds)
    counts = list(split.batches)
    return SplitOutcome(counts, split_objective(times, counts), True, seconds)
