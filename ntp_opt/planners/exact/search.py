"""The exact planner: a search over the step time with the capacity program.

``C(theta')`` (:mod:`ntp_opt.planners.exact.model`) is the largest total batch any plan
carries at pre-overhead step time ``theta'``; it is a non-decreasing step
function. Two cases are searched: only the nominal degree ``T`` (no resharding
overhead), and every allowed degree (step time ``theta' (1 + rho)``).

* ``fixed``: the goodput is ``B / theta``, so the search wants the smallest
  ``theta'`` with ``C(theta') >= B``: bisection. Without power boost
  (``max_boost == 0``, ``alpha == 0``, or no board accepting more than its
  ``tdp_w``) every jump of ``C`` lies in the finite
  set ``{b c / (f(t) s)}`` and the bisection over that set is exact; with
  boost it runs on the continuous axis until the bracket is within the
  tolerance, and the lower end is a proven bound.
* ``elastic``: the goodput is ``min(B, C(theta')) / theta'``, maximal at a
  jump of ``C`` no later than where ``C`` first reaches ``min(B, C_max)``.
  Branch and bound over ``theta'`` intervals ``[a, b]``: ``C(b) / a`` bounds
  every point inside; an interval whose ends have equal ``C`` is settled.

Every plan found is checked by the validator; the best one (or the warm
start, if better) is returned with the best proven bound. The capacity oracle
is :mod:`ntp_opt.planners.exact.oracle`, the searches over the step time
:mod:`ntp_opt.planners.exact.steptime`; this module holds the planner,
:func:`solve_exact`.
"""

from __future__ import annotations

import dataclasses
import math
import time

from ntp_opt.model.control import Control
from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan
from ntp_opt.planners import heuristics as baselines
from ntp_opt.planners.base import Limit, Outcome, RunOptions, stop_limit
from ntp_opt.planners.bounds import capacity_bound
from ntp_opt.planners.exact.capacity import build_capacity
from ntp_opt.planners.exact.colgen import column_generation_for
from ntp_opt.planners.exact.model import (
    DeadlineReached,
    ModelTooLarge,
    NoClusterGraph,
    prepare,
    rack_relaxed,
)
from ntp_opt.planners.exact.oracle import (
    CapacitySearch,
    SearchDeadline,
    SearchInterrupted,
    Unresolved,
    crowded_class,
    many_rack_domains,
    small_full_program,
    theta_range,
)
from ntp_opt.planners.exact.steptime import Case, case_fixed, drop_bounded_cases, elastic
from ntp_opt.planners.fast import plan_fast
from ntp_opt.rules.power import can_boost
from ntp_opt.rules.tolerances import REL_TOL
from ntp_opt.rules.validate import certified, evaluate

#: GPUs from which ``fast``'s plan is always a warm start (below: only where a case
#: needs generated configurations or none can be searched).
FAST_WARM_GPUS = 4096


def _fast_plan(instance: Instance) -> Plan:
    """``fast``'s plan (not validated: the caller evaluates it)."""
    return plan_fast(instance, bound=False).require_plan()


def solve_exact(
    instance: Instance,
    options: RunOptions = RunOptions(),
    *,
    backend: str = "cpsat",
    report_bounds: bool = True,
    theta_search: str = "descent",
    relax_racks: bool = True,
) -> Outcome:
    """Maximise goodput exactly (to :data:`~ntp_opt.rules.tolerances.REL_TOL`).

    Parameters
    ----------
    instance
        The instance.
    options
        ``time_limit`` (seconds for the whole search, ``None``: no limit),
        ``threads`` and ``seed`` (passed to the backend), ``initial_plan`` (warm
        start; the result is never worse; default: the best baseline), ``log``
        (keep one line per capacity program solved; they also go to the logger
        of :mod:`ntp_opt.planners.exact.oracle` at DEBUG level) and ``control``
        (progress reports and the cancel token: once it is set, the search stops
        at the next program, CP-SAT and HiGHS stop the running one, and returns
        its best plan, ``interrupted``).
    backend
        ``"cpsat"``, ``"highs"`` or ``"cbc"``.
    report_bounds
        Pass the search's bounds to ``options.control`` (False when they bound
        another problem than the caller's).
    theta_search
        How ``elastic`` searches the step time: ``"descent"`` (one program per
        level of the capacity, :func:`~ntp_opt.planners.exact.steptime.descend`) or
        ``"bnb"`` (the earlier best-first branch and bound over step-time
        intervals). Both prove the same optimum; ``fixed`` ignores it.
    relax_racks
        Where the model is not exact (:attr:`~ntp_opt.planners.exact.model.Prepared.inexact`,
        e.g. a domain spanning racks with too many rack splits to list) but the
        search proved its plan optimal within the model, prove it against every
        plan by the same search on the rack-merged relaxation
        (:func:`~ntp_opt.planners.exact.model.rack_relaxed`) in the time left.

    Returns
    -------
    Outcome
        Its plan is not validated; its ``stats`` hold the plan's ``goodput`` and
        the number of capacity-program ``evaluations``.
    """
    start = time.perf_counter()
    deadline = None if options.time_limit is None else start + options.time_limit
    prep = prepare(instance)
    starts, sub_evaluations, sub_interrupted = _warm_starts(
        instance, options, backend, theta_search
    )
    best_plan, best_value = _best(instance, starts)
    s = CapacitySearch(
        prep, backend, deadline, options.threads, options.seed, options.log, best_plan, best_value
    )
    s.control, s.report_bounds = options.control, report_bounds
    if theta_search not in ("descent", "bnb"):
        raise ValueError(f"theta_search must be 'descent' or 'bnb', not {theta_search!r}")
    s.theta_search = theta_search
    s.global_bound = capacity_bound(instance)
    s.report()
    s.evaluations = sub_evaluations
    if _cannot_run(instance):
        return _paused(s)
    cases, left_out, deadline_hit = _searchable_cases(s)
    if (left_out and not cases) or bool(s.colgen):
        _offer_fast(s)
    cases, dropped = drop_bounded_cases(s, cases)
    bound, timed_out, interrupted = _search_cases(s, cases, sub_interrupted)
    timed_out = timed_out or deadline_hit
    bound = max(bound, dropped)  # the cases left out by their bounds
    if left_out:
        bound = math.inf  # the search bounds cover the cases searched only
    return _outcome(s, _Ending(bound, timed_out, interrupted, left_out), relax_racks)


def _warm_starts(
    instance: Instance, options: RunOptions, backend: str, theta_search: str
) -> tuple[list[Plan], int, bool]:
    """The warm starts (best first where known), and the evaluations and interruption
    of the search without boost that gave the first of them."""
    starts = [
        certified(instance, baselines.ntp_pw(instance).require_plan()),
        certified(instance, baselines.ntp(instance).require_plan()),
        certified(instance, baselines.dp_drop(instance).require_plan()),
    ]
    if options.initial_plan is not None:
        starts.insert(0, options.initial_plan)
    if len(instance.arrays.speed) >= FAST_WARM_GPUS:
        # the sort-and-pack planner is scale-free (under a second at 131k GPUs)
        # and usually far better than the baselines on large clusters, where the
        # search may not finish: a warm start too
        starts.append(_fast_plan(instance))
    if not can_boost(instance):
        return starts, 0, False
    # warm start: the same search without boost has finitely many step
    # times to try and finds a good plan fast; it is valid here too
    job = instance.job
    plain = instance.with_job(job.model_copy(update={"max_boost": 0.0}))  # same arrays
    time_limit = options.time_limit
    sub = solve_exact(
        plain,
        dataclasses.replace(
            options, time_limit=None if time_limit is None else time_limit / 3, initial_plan=None
        ),
        backend=backend,
        report_bounds=False,  # a bound without boost is no bound with it
        theta_search=theta_search,
        relax_racks=False,  # only its plan is used
    )
    if sub.plan is not None:  # always: the search returns a plan
        starts.insert(0, sub.plan)
    return starts, int(sub.stats["evaluations"]), sub.interrupted


def _best(instance: Instance, starts: list[Plan]) -> tuple[Plan, float]:
    """The best feasible warm start with its metrics, and its goodput (-1: none)."""
    best_plan, best_value = starts[1], -1.0
    for p in starts:
        ev = evaluate(instance, p)
        if ev.feasible and ev.goodput > best_value:
            best_plan, best_value = p.with_metrics(**ev.as_metrics()), ev.goodput
    return best_plan, best_value


def _cannot_run(instance: Instance) -> bool:
    """The job cannot run at all: too few stages of degree >= tp_min, or (fixed)
    too little batch capacity. Proven without any program."""
    job = instance.job
    stages = int((instance.arrays.healthy_in_domain() // job.min_tp).sum())
    no_batch = job.batch_policy == "fixed" and job.replicas_max * job.local_batch_max < (
        job.global_batch
    )
    return stages < job.pp or no_batch or job.replicas_max == 0


def _paused(s: CapacitySearch) -> Outcome:
    """The outcome where the job cannot run: the incumbent (paused), proven."""
    s.note("the job cannot run: paused, proven without a program")
    return Outcome(
        plan=s.best_plan,
        bound=s.best_value,
        proven=True,
        log=tuple(s.log),
        stats={"goodput": s.best_value, "evaluations": s.evaluations},
    )


def _searchable_cases(s: CapacitySearch) -> tuple[list[Case], bool, bool]:
    """The cases searched (the nominal degree; every allowed one), each by the full
    program or generated configurations (:attr:`CapacitySearch.colgen`), and whether
    one was left out (too large at its largest step time, where every configuration
    fits: the result is then not proven) and whether by the deadline."""
    prep = s.prep
    job = prep.instance.job
    cases: list[Case] = [((job.tp,), 1.0)]
    if len(job.allowed) > 1:
        cases.append((job.allowed, 1.0 + job.reshard_overhead))
    kept = []
    left_out = deadline_hit = False
    for degrees, factor in cases:
        try:
            if many_rack_domains(prep):
                raise ModelTooLarge(
                    f"{sum(len(prep.units[u].domains) for u in prep.multi)} domains share racks"
                )
            top = build_capacity(prep, theta_range(prep, degrees)[1], degrees, s.deadline)
            crowded = crowded_class(top)
            if crowded:
                raise ModelTooLarge(f"{crowded} configurations of one domain class")
            kept.append((degrees, factor))
        except ModelTooLarge as err:
            if _generated(s, degrees, err):
                kept.append((degrees, factor))
                continue
            s.unproven = left_out = True
            s.note(f"left out degrees {list(degrees)}: {err}")
        except DeadlineReached:
            s.unproven = left_out = deadline_hit = True
            s.note(f"left out degrees {list(degrees)}: time limit reached")
    return kept, left_out, deadline_hit


def _generated(s: CapacitySearch, degrees: tuple[int, ...], err: ModelTooLarge) -> bool:
    """Whether a case too large for the full program is searched with generated
    configurations (where column generation can help)."""
    prep = s.prep
    generated = column_generation_for(prep, degrees, theta_range(prep, degrees)[1])
    if generated is None:
        return False
    s.colgen[degrees] = generated  # configurations generated on demand
    if small_full_program(prep, degrees, s.deadline):
        # racks shared by many domains, but few configurations: the full
        # program by HiGHS (column generation stays the fallback)
        s.full_highs.add(degrees)
        s.note(f"degrees {list(degrees)}: full program by HiGHS ({err})")
    else:
        s.note(f"degrees {list(degrees)}: column generation ({err})")
    return True


def _offer_fast(s: CapacitySearch) -> None:
    """``fast``'s plan as the incumbent where it is better: where no case can be
    searched (huge batch levels, many stages per domain), or some only with generated
    configurations (slower), it is a better warm start than the baselines (from
    :data:`FAST_WARM_GPUS` it is one already)."""
    instance = s.prep.instance
    if len(instance.arrays.speed) >= FAST_WARM_GPUS:
        return
    if s.deadline is not None and time.perf_counter() >= s.deadline:
        return
    fast_plan = _fast_plan(instance)
    ev = evaluate(instance, fast_plan)
    if ev.feasible and ev.goodput > s.best_value:
        s.best_plan = fast_plan.with_metrics(**ev.as_metrics())
        s.best_layout = None
        s.best_value = ev.goodput


def _search_cases(
    s: CapacitySearch, cases: list[Case], sub_interrupted: bool
) -> tuple[float, bool, bool]:
    """Search the cases: ``(bound, timed out, interrupted)``."""
    bound = 0.0
    timed_out = interrupted = False
    try:
        if sub_interrupted:
            raise SearchInterrupted  # Ctrl-C or cancel during the warm start: stop here too
        if s.prep.instance.job.batch_policy == "fixed":
            for degrees, factor in cases:
                bound = max(bound, case_fixed(s, degrees, factor))
        else:
            bound = elastic(s, cases)
    except SearchDeadline:
        timed_out = True
        bound = math.inf
    except Unresolved:  # not a time limit: the search cannot go on without C there
        s.unproven = True
        bound = math.inf
        s.note(
            "stopped: a capacity program was left with lower < upper where the search "
            "needs C (limit unsettled)"
        )
    except (KeyboardInterrupt, SearchInterrupted):  # Ctrl-C or cancel: the best plan so far
        interrupted = True
        bound = math.inf
    except ModelTooLarge as err:  # should not happen after the check above
        s.unproven = True
        bound = math.inf
        s.note(f"exact model too large: {err}")
    return bound, timed_out, interrupted


@dataclasses.dataclass
class _Ending:
    """How the search over the cases ended."""

    bound: float
    timed_out: bool
    interrupted: bool
    left_out: bool


def _outcome(s: CapacitySearch, end: _Ending, relax_racks: bool) -> Outcome:
    """The planner's outcome: the bound (relaxed where the model is not exact),
    whether it proves the incumbent, and the limit that stopped the search."""
    prep = s.prep
    bound, timed_out, interrupted = end.bound, end.timed_out, end.interrupted
    exact_model = not prep.inexact
    if prep.inexact:
        settled = not (timed_out or interrupted or s.unproven or end.left_out)
        model_bound = max(min(bound, s.global_bound), s.best_value)
        bound = math.inf  # the search bounds hold for fastest-first placements only
        if settled and relax_racks and model_bound <= s.best_value * (1 + 2 * REL_TOL):
            relaxed = _relaxed_bound(s, s.deadline, s.theta_search)
            if relaxed is not None:
                bound, exact_model, limit = relaxed
                timed_out = limit is Limit.TIME
                interrupted = limit is Limit.INTERRUPTED
        if not exact_model:
            s.note(f"not proven optimal: {prep.inexact}", keep=s.keep_log)
    bound = max(min(bound, s.global_bound), s.best_value)
    proven = (
        exact_model
        and not timed_out
        and not s.unproven
        and bound <= s.best_value * (1 + 2 * REL_TOL)
    )
    if s.best_value <= 0 and not timed_out and not s.unproven and bound <= 0:
        proven = True
    return Outcome(
        plan=s.best_plan,
        bound=None if math.isinf(bound) else bound,
        proven=proven,
        # stopped without a proof before any limit: say so (never `none` with no proof)
        limit=stop_limit(interrupted=interrupted, timed_out=timed_out, proven=proven),
        log=tuple(s.log),
        stats={"goodput": s.best_value, "evaluations": s.evaluations},
        layout=_plan_layout(prep.instance, s.best_plan, s.best_layout),
    )


def _relaxed_bound(
    s: CapacitySearch, deadline: float | None, theta_search: str
) -> tuple[float, bool, Limit] | None:
    """A bound on every plan from the rack-merged relaxation
    (:func:`~ntp_opt.planners.exact.model.rack_relaxed`), searched with the time left
    and the incumbent as its warm start: ``(bound, proven, limit)``, where ``proven``
    says the relaxation's own model was exact and its search finished (then ``bound``
    is its proven optimum), or ``None`` (no relaxation, or it is not exact either)."""
    relaxed = rack_relaxed(s.prep)
    if relaxed is None:
        return None
    if prepare(relaxed).inexact:
        return None
    remaining = None if deadline is None else deadline - time.perf_counter()
    if remaining is not None and remaining <= 0.01:
        return math.inf, False, Limit.TIME
    # the relaxation's incumbents are not plans of the instance: no reports, the
    # caller's cancel token only
    control = Control("relaxed", cancel=None if s.control is None else s.control.cancel)
    try:
        out = solve_exact(
            relaxed,
            RunOptions(remaining, s.seed, s.threads, s.best_plan, s.keep_log, control),
            backend=s.backend,
            report_bounds=False,
            theta_search=theta_search,
            relax_racks=False,
        )
    except NoClusterGraph:  # a warm start that reads the graph: no proof, no failure
        s.note("racks merged per power unit: a warm start needs the cluster graph")
        return None
    s.evaluations += int(out.stats["evaluations"])
    value = float(out.stats["goodput"])
    bound = math.inf if out.bound is None else float(out.bound)
    s.note(
        f"racks merged per power unit (a relaxation): optimum {value:.9g}"
        f"{'' if out.proven else ' not proven'}, bound {bound:.9g}, limit {out.limit.value}"
    )
    return bound, out.proven, out.limit


def _plan_layout(instance: Instance, plan: Plan, layout: Layout | None) -> Layout | None:
    """``layout`` when the search built the plan, else the warm start's, read from it."""
    if layout is not None or not plan.replicas:
        return layout
    try:
        return Layout.from_plan(instance, plan)
    except KeyError:  # a warm start naming unknown nodes (it was not feasible, then)
        return None
