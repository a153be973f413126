"""A tighter upper bound on goodput: the stage structure of each domain and the
resharding overhead (:func:`stage_bound`), its multipliers
(:func:`stage_bound_point`) and re-planning's incremental form
(:func:`stage_bound_at`).

Each case (only the nominal degree, or reduced replicas allowed) is bounded
by :func:`~ntp_opt.planners.bounds.case.case_bound`; under the ``fixed``
batch policy, also by :func:`~ntp_opt.planners.bounds.fixed.fixed_case_bound`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.planners.bounds.case import case_bound
from ntp_opt.planners.bounds.fixed import fixed_case_bound
from ntp_opt.planners.bounds.rows import ClassTable, DomainRows, domain_rows
from ntp_opt.rules.power import budget_slack, idle_draw

__all__ = [
    "DualPoints",
    "FixedSpeeds",
    "stage_bound",
    "stage_bound_at",
    "stage_bound_point",
]


def stage_bound(instance: Instance, only: tuple[int, ...] | None = None) -> float:
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
    only
        Bound only the plans of one case: ``(job.tp,)`` (case A) or
        ``job.allowed`` (case B); ``None``: every plan.

    Returns
    -------
    float
        Upper bound on goodput (sequences per second).
    """
    return _stage_bound(instance, only=only)


DualPoints = dict[tuple[int, ...], tuple[float, float]]
"""Per case of :func:`stage_bound` (its degrees), multipliers ``(lambda, mu)``."""

FixedSpeeds = dict[tuple[int, ...], dict[int, float]]
"""Per case of :func:`stage_bound` (its degrees), the ``fixed`` refinement's speed
bounds ``u_k`` by rank ``k`` (a speed at which ``k`` replicas cannot all run:
valid for any later instance that it still does not fit)."""


def stage_bound_point(
    instance: Instance, rows: DomainRows | None = None, fixed: FixedSpeeds | None = None
) -> tuple[float, DualPoints]:
    """:func:`stage_bound`, and per case the multipliers whose dual gave its value.

    ``rows``: ``domain_rows(instance)``, when known. ``fixed``: receives, for
    a ``fixed`` job, the speed bounds of the refinement per case where it
    was computed (:func:`stage_bound_at` starts from them); the value is the
    same with or without it.

    Returns
    -------
    tuple of (float, DualPoints)
        The bound (the same number as :func:`stage_bound`) and the points
        :func:`stage_bound_at` takes.
    """
    points: DualPoints = {}
    return _stage_bound(instance, record=points, rows_in=rows, fixed_out=fixed), points


def stage_bound_at(
    instance: Instance,
    points: DualPoints,
    rows: DomainRows | None = None,
    fixed: FixedSpeeds | None = None,
    fixed_out: FixedSpeeds | None = None,
) -> float:
    """A valid upper bound from given multipliers: no search (re-planning's incremental bound).

    Every ``(lambda, mu) >= 0`` gives a bound (:func:`stage_bound`), so the
    dual of ``instance`` at the multipliers another instance's
    :func:`stage_bound_point` found (an instance a few events ago) bounds
    every plan of ``instance``. It is close to ``stage_bound(instance)``
    when the instances differ little (above it as a rule; below only by the
    search's resolution, where the given point beats the searched one; the
    ``fixed`` refinement is left out); a case with no point is searched as
    usual.

    Parameters
    ----------
    instance
        The instance.
    points
        Multipliers per case (:func:`stage_bound_point`).
    rows
        ``domain_rows(instance)``, when known (re-planning keeps them up to
        date with :func:`~ntp_opt.planners.bounds.rows.domain_rows_after`).
    fixed
        For a ``fixed`` job, speed bounds of the ``fixed`` refinement kept
        from an earlier instance (:func:`stage_bound_point`, or ``fixed_out``
        of an earlier call): with them the refinement is added without its
        search. Each kept ``u_k`` is re-checked on ``instance`` at a few
        speeds around it (``u_k (1 +- 1e-6 .. 1e-3)``, all at once); where
        one fits and the next does not, the latter is this instance's bound
        for rank ``k`` (the fit only gets harder as the speed grows); a rank
        the steps do not bracket is bisected as usual. ``None``: the
        refinement is left out, as before.
    fixed_out
        Receives the speed bounds used (to pass as ``fixed`` next time).

    Returns
    -------
    float
    """
    return _stage_bound(instance, at=points, rows_in=rows, fixed_in=fixed, fixed_out=fixed_out)


@dataclass(frozen=True, eq=False)
class _Setup:
    """What every case of :func:`_stage_bound` reads: the domain classes and the
    site's power room, the fastest speed, the largest cap and each domain's GPU count."""

    job: Job
    table: ClassTable
    s_max: float
    hi_max: float
    h_all: np.ndarray

    def replicas_of(self, degrees: tuple[int, ...]) -> int:
        """The most replicas of the case ``degrees``."""
        job = self.job
        if degrees == (job.tp,):
            slots = int((self.h_all // job.tp).sum())
            return min(job.replicas_max, slots // job.pp)
        return job.replicas_max

    def capped(self, degrees: tuple[int, ...], value: float, factor: float) -> float:
        """The case's bound: ``value`` capped by its replicas at the fastest speed."""
        job = self.job
        replicas = self.replicas_of(degrees)
        v_top = (
            max(job.tp_factor(t) for t in degrees)
            * self.s_max
            * self.hi_max**job.power_exponent
            / job.seq_time_s
        )
        return min(value, replicas * v_top) / factor


def _setup(instance: Instance, rows_in: DomainRows | None) -> _Setup | None:
    """The classes and power room of ``instance`` (``None``: no healthy GPU, or the
    idle draw alone is over the site budget)."""
    job = instance.job
    a = instance.arrays
    ok = a.healthy
    if not ok.any():
        return None
    room = a.site_budget - float(idle_draw(instance)[ok].sum()) + budget_slack(a.site_budget)
    if room < 0:
        return None
    if rows_in is None:
        rows_in = domain_rows(instance)
    width = rows_in.width
    rows, counts = rows_in.classes()
    h_cls = rows[:, 0].astype(np.int64)
    s_cls = rows[:, 1 : 1 + width]
    w_cls = rows[:, 1 + width : 1 + 2 * width]
    hi = rows[:, -1]  # per class
    cum_w = np.concatenate([np.zeros((len(rows), 1)), np.cumsum(w_cls, axis=1)], axis=1)
    table = ClassTable(h_cls, s_cls, w_cls, cum_w, counts, hi, room)
    s_max = float(a.speed[ok].max())
    h_all = rows_in.key[:, 0].astype(np.int64)
    return _Setup(job, table, s_max, float(hi.max()), h_all)


def _cases(job: Job, only: tuple[int, ...] | None) -> list[tuple[tuple[int, ...], float]]:
    """The cases (degrees, step-time factor): the nominal degree, then reduced replicas."""
    cases: list[tuple[tuple[int, ...], float]] = [((job.tp,), 1.0)]
    reduced = tuple(t for t in job.allowed if t < job.tp)
    if reduced:
        cases.append((job.allowed, 1.0 + job.reshard_overhead))
    if only is not None:
        cases = [case for case in cases if case[0] == only]
    return cases


def _searched_case(
    setup: _Setup,
    degrees: tuple[int, ...],
    factor: float,
    best: float,
    record: DualPoints | None,
    fixed_first: bool,
) -> tuple[float, float | None] | None:
    """A case's Lagrangian value (searched) and its ``fixed`` bound where computed;
    ``None`` when the case cannot beat ``best``."""
    job, table = setup.job, setup.table
    # a quick valid bound for the case first; refine only if it could matter
    found: list[tuple[float, float]] = []
    shared: dict[str, float] = {}  # the mu = 0 search, done once for both
    quick = case_bound(job, degrees, table, False, found=found, shared=shared)
    if record is not None and found:
        record[degrees] = (float(found[-1][0]), float(found[-1][1]))
    if quick / factor <= best:
        return None
    fixed: float | None = None
    if fixed_first and record is None:
        # the case is at most its fixed bound: when that cannot beat
        # ``best``, neither can the refined value (the same result)
        fixed = fixed_case_bound(job, degrees, factor, setup.replicas_of(degrees), table)
        if fixed <= best:
            return None
    value = case_bound(job, degrees, table, found=found, shared=shared)
    if record is not None and found:
        record[degrees] = (float(found[-1][0]), float(found[-1][1]))
    return value, fixed


def _stage_bound(
    instance: Instance,
    *,
    record: DualPoints | None = None,
    at: DualPoints | None = None,
    rows_in: DomainRows | None = None,
    only: tuple[int, ...] | None = None,
    fixed_in: FixedSpeeds | None = None,
    fixed_out: FixedSpeeds | None = None,
) -> float:
    """:func:`stage_bound`; ``record`` receives each case's multipliers, ``at`` gives
    them; ``rows_in``: the instance's :func:`~ntp_opt.planners.bounds.rows.domain_rows`,
    when known; ``only``: one case's degrees; ``fixed_in`` / ``fixed_out``: the
    ``fixed`` refinement's speed bounds kept / used (:func:`stage_bound_at`; with
    ``at``, ``fixed_in`` adds the refinement)."""
    setup = _setup(instance, rows_in)
    if setup is None:
        return 0.0
    job = instance.job
    best = 0.0
    for degrees, factor in reversed(_cases(job, only)):  # case B first: it usually decides
        fixed: float | None = None
        if at is not None and degrees in at:
            value = case_bound(job, degrees, setup.table, at=at[degrees])
        else:
            searched = _searched_case(
                setup, degrees, factor, best, record, job.batch_policy == "fixed" and at is None
            )
            if searched is None:
                continue
            value, fixed = searched
        case = setup.capped(degrees, value, factor)
        if job.batch_policy == "fixed" and case > best:
            case = _fixed_refined(setup, degrees, factor, case, fixed, at, fixed_in, fixed_out)
        best = max(best, case)
    return float(best)


def _fixed_refined(
    setup: _Setup,
    degrees: tuple[int, ...],
    factor: float,
    case: float,
    fixed: float | None,
    at: DualPoints | None,
    fixed_in: FixedSpeeds | None,
    fixed_out: FixedSpeeds | None,
) -> float:
    """A case's bound under the ``fixed`` policy: at most its ``fixed`` bound (searched,
    or, re-planning, from the kept speed bounds: valid either way)."""
    job = setup.job
    replicas = setup.replicas_of(degrees)
    if at is None:
        if fixed is None:
            out = None if fixed_out is None else fixed_out.setdefault(degrees, {})
            fixed = fixed_case_bound(job, degrees, factor, replicas, setup.table, out=out)
        return min(case, fixed)
    if fixed_in is not None:
        out = None if fixed_out is None else fixed_out.setdefault(degrees, {})
        kept = fixed_in.get(degrees, {})
        return min(
            case, fixed_case_bound(job, degrees, factor, replicas, setup.table, kept=kept, out=out)
        )
    return case
