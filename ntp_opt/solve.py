"""One entry point for every planner: :func:`solve` returns a :class:`Result`.

Planners are registered by name in :data:`REGISTRY`
(:mod:`ntp_opt.planners.registry`); each is a
:class:`~ntp_opt.planners.base.Planner` returning an
:class:`~ntp_opt.planners.base.Outcome`, which :func:`solve` checks once with
the validator. The optional integer-programming backends are imported only
when used, so a missing extra only matters to the planner that needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from ntp_opt.model.control import Callback, Control, sigint_sets
from ntp_opt.model.hosts import pack_plan_hosts
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import (
    Limit,
    Outcome,
    Planner,
    PlannerKind,
    PlannerSpec,
    RunOptions,
    Status,
)
from ntp_opt.planners.registry import REGISTRY, without_power
from ntp_opt.rules.goodput import check_batch_size
from ntp_opt.rules.tolerances import BOUND_TOL, REL_TOL
from ntp_opt.rules.validate import Evaluation, check, infeasibility, pause_reason

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """Outcome of :func:`solve`.

    Attributes
    ----------
    status
        :class:`Status`.
    limit
        :class:`Limit` that stopped the search (``NONE`` if it ran to the end;
        ``UNSETTLED``: an exact planner stopped before any limit without a proof,
        its log says why; an exact planner's ``feasible`` never has ``NONE``).
    plan
        The validated plan, or ``None`` when there is none.
    objective
        Goodput of ``plan`` in sequences per second, recomputed by the
        validator (``None`` without a plan).
    relative_objective
        ``objective * c / R`` (1.0 = the job with no failures).
    bound
        Proven upper bound on goodput, or ``None`` when the planner has none.
        For a planner that maximises expected goodput (``risk-aware``), a
        bound on :attr:`expected_objective` instead (the smaller of its
        wait-and-see and domain bounds, ``docs/risk.md``).
    runtime_s
        Wall-clock seconds.
    solver
        Planner name.
    log
        Solver log when asked for, else ``None``.
    evaluation
        The validator's full :class:`~ntp_opt.rules.validate.Evaluation` of ``plan``.
    reason
        Why there is no plan (status ``infeasible``) or why the plan is the
        paused job (no replicas); ``None`` otherwise.
    expected_objective
        The planner's objective when it is not the plan's goodput: the
        expected goodput after recourse over the training scenarios of
        ``risk-aware`` (sequences per second); ``None`` for the others.
        :attr:`bound`, :attr:`gap` and status ``optimal`` then refer to it.

    Notes
    -----
    Without a plan the status is ``infeasible`` only when infeasibility is
    proven (not even the paused job fits, or the planner proved it), and
    ``no_solution`` when the planner stopped (time limit or interrupt, see
    :attr:`limit`) before finding any plan.
    """

    status: Status
    limit: Limit
    plan: Plan | None
    objective: float | None
    relative_objective: float | None
    bound: float | None
    runtime_s: float
    solver: str
    log: str | None = None
    evaluation: Evaluation | None = None
    reason: str | None = None
    expected_objective: float | None = None

    @property
    def gap(self) -> float | None:
        """Relative gap ``(bound - objective) / bound``, or ``None``.

        With an :attr:`expected_objective`, the gap of that objective.
        """
        value = self.objective if self.expected_objective is None else self.expected_objective
        if self.bound is None or value is None:
            return None
        if self.bound <= 0:
            return 0.0
        return max(0.0, (self.bound - value) / self.bound)


#: Planners by kind (names only; the planners are in :data:`REGISTRY`).
HEURISTICS: tuple[str, ...] = tuple(
    n for n, p in REGISTRY.items() if p.kind == PlannerKind.HEURISTIC
)
BOUNDED: tuple[str, ...] = tuple(n for n, p in REGISTRY.items() if p.kind == PlannerKind.BOUNDED)
SEARCHES: tuple[str, ...] = tuple(n for n, p in REGISTRY.items() if p.kind == PlannerKind.SEARCH)

#: Exact planners: name -> (integer-programming backend, power boost allowed).
EXACT: dict[str, tuple[str, bool]] = {
    n: (p.backend or "", not n.endswith("-nopower"))
    for n, p in REGISTRY.items()
    if p.kind == PlannerKind.EXACT
}

#: Planners whose :attr:`Result.bound` holds for the instance as it is. The
#: others bound a restricted problem (``optimal-nopower``: no boost;
#: ``optimal-megatron``: one reduced degree) or have no bound.
INSTANCE_BOUNDS: frozenset[str] = frozenset(n for n, p in REGISTRY.items() if p.instance_bound)

#: Every planner name :func:`solve` accepts.
PLANNERS: tuple[str, ...] = tuple(REGISTRY)

#: The policies of docs/model.md, spec section 5, as compared by ``ntp-opt compare``.
POLICIES: tuple[str, ...] = ("dp-drop", "ntp", "ntp-pw", "optimal-nopower", "optimal")


def solve(
    instance: Instance,
    solver: str = "optimal",
    *,
    time_limit: float | None = 60.0,
    seed: int = 0,
    threads: int = 1,
    initial_plan: Plan | None = None,
    log: bool = False,
    callback: Callback | None = None,
    cancel: threading.Event | None = None,
) -> Result:
    """Plan ``instance`` with the named planner.

    Parameters
    ----------
    instance
        The instance.
    solver
        ``"optimal"`` (exact, CP-SAT), ``"optimal-nopower"`` (exact, no power
        boost), ``"cpsat"``, ``"highs"``, ``"cbc"`` (exact with that backend),
        ``"optimal-megatron"`` / ``"optimal-megatron-nopower"`` (exact, restricted to
        plans Megatron-LM's NTP runtime can run: see :mod:`ntp_opt.planners.megatron`),
        a heuristic: ``"dp-drop"``, ``"ntp"``, ``"ntp-pw"``, ``"fast"``
        (the best of several sort-and-pack candidates, with a proven bound;
        for 32k-131k GPUs and re-planning), or ``"risk-aware"`` (maximises
        expected goodput after recourse; see ``docs/risk.md``).
    time_limit
        Seconds for exact planners (default 60; ``None``: run until proven
        optimal, which under the ``elastic`` policy with power boost can take
        long). A planner that stops at the limit returns its best plan with
        status ``feasible``, limit ``time_limit`` and its bound. Heuristics
        ignore it.
    seed
        Random seed of the backend (heuristics are deterministic).
    threads
        Backend worker threads. With 1 (the default) every planner is
        deterministic; CP-SAT with several workers is not.
    initial_plan
        Warm start for exact planners; the result is never worse.
    log
        Keep the search log in :attr:`Result.log`.
    callback
        Called with a :class:`ntp_opt.model.control.SolveProgress` (planner,
        elapsed, incumbent goodput, bound, gap) whenever the incumbent or the
        bound improves (exact planners: every better plan of the step-time
        search; heuristics: once, at the end) and once more with
        ``final=True`` for the result. Incumbents only rise, bounds only fall.
    cancel
        A :class:`threading.Event`; once set (from any thread), the planner
        stops at its next check (CP-SAT and HiGHS inside a program, CBC and
        the other planners between steps) and the best plan so far is
        returned with limit ``interrupted``. While ``solve`` runs in the main
        thread, SIGINT (Ctrl-C) sets it too, instead of raising
        :class:`KeyboardInterrupt`; the previous handler is restored after.

    Returns
    -------
    Result
        Its plan, if any, has passed :func:`ntp_opt.rules.validate.check`. Before the
        check, the GPUs of each stage are re-dealt among interchangeable GPUs
        of its domain, whole hosts first (:func:`ntp_opt.model.hosts.pack_hosts`:
        goodput, power and expected goodput unchanged), so that launchers
        that number each host's ranks contiguously (torchrun) can run it.
    """
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be positive, got {time_limit!r}")
    if solver not in REGISTRY:
        raise ValueError(f"unknown solver {solver!r}; known: {', '.join(REGISTRY)}")
    check_batch_size(instance.job)  # SizeLimitError (a ValueError) before any array is built
    control = Control(solver, callback, cancel)
    with sigint_sets(control.cancel):
        logger.info("%s: solving %s", solver, instance.name)
        result = _solve(instance, solver, time_limit, seed, threads, initial_plan, log, control)
    return _settled(result, control)


def _settled(result: Result, control: Control) -> Result:
    """``result`` with the limit a cancel or a proof sets; the final report sent."""
    if control.cancelled and result.plan is not None:
        result = dataclasses.replace(result, limit=Limit.INTERRUPTED)
    if result.status == Status.OPTIMAL and result.limit in (Limit.INTERRUPTED, Limit.UNSETTLED):
        # proven before the cancel was seen, or the bound closed the gap: the proof stands
        result = dataclasses.replace(result, limit=Limit.NONE)
    value = result.objective if result.expected_objective is None else result.expected_objective
    control.report(value, result.bound, final=True)
    logger.info(
        "%s: %s, limit %s, %.2f s", result.solver, result.status, result.limit, result.runtime_s
    )
    return result


def _solve(
    instance: Instance,
    solver: str,
    time_limit: float | None,
    seed: int,
    threads: int,
    initial_plan: Plan | None,
    log: bool,
    control: Control,
) -> Result:
    """:func:`solve` without the checks of its arguments, SIGINT and the final report."""
    start = time.perf_counter()
    why = infeasibility(instance)
    if why is not None:  # not even the paused job fits: no planner can return a plan
        return Result(
            status=Status.INFEASIBLE,
            limit=Limit.NONE,
            plan=None,
            objective=None,
            relative_objective=None,
            bound=None,
            runtime_s=time.perf_counter() - start,
            solver=solver,
            log=why if log else None,
            reason=why,
        )
    spec = REGISTRY[solver]
    options = RunOptions(time_limit, seed, threads, initial_plan, log, control)
    out = spec.run(instance, options)
    runtime = time.perf_counter() - start
    plan, bound = out.plan, out.bound
    text = "\n".join(out.log) if log and spec.kind == PlannerKind.EXACT else None
    if plan is None:  # stopped before any plan, or proven infeasible
        return Result(
            status=Status.INFEASIBLE if out.proven else Status.NO_SOLUTION,
            limit=out.limit,
            plan=None,
            objective=None,
            relative_objective=None,
            bound=bound,
            runtime_s=runtime,
            solver=solver,
            log=text,
        )
    status = Status.OPTIMAL if out.proven else Status.FEASIBLE
    # interchangeable GPUs re-dealt host by host (goodput unchanged): torchrun-friendly
    plan = pack_plan_hosts(instance, plan)
    evaluation = check(instance, plan)  # the one check: never trust a planner
    if spec.kind == PlannerKind.BOUNDED and bound is not None:
        if evaluation.goodput > bound * (1 + BOUND_TOL):  # a bug, never hidden
            raise RuntimeError(
                f"planner {solver!r}: goodput {evaluation.goodput} above its bound {bound}"
            )
    if spec.kind in (PlannerKind.BOUNDED, PlannerKind.EXACT) and bound is not None:
        # the status follows the gap: a closed gap is a proof, whichever limit stopped
        # the planner (a bound of 0 met by the paused plan included)
        if bound <= evaluation.goodput * (1 + REL_TOL):
            status = Status.OPTIMAL
    if spec.kind != PlannerKind.EXACT:  # unchecked: attach the checked figures
        plan = plan.with_metrics(**evaluation.as_metrics())
    return Result(
        status=status,
        limit=out.limit,
        plan=plan,
        objective=evaluation.goodput,
        relative_objective=evaluation.relative_goodput,
        bound=bound,
        runtime_s=runtime,
        solver=solver,
        log=text,
        evaluation=evaluation,
        reason=None if plan.replicas else pause_reason(instance, status == Status.OPTIMAL),
        expected_objective=(
            out.stats.get("expected_objective") if spec.kind == PlannerKind.SEARCH else None
        ),
    )


__all__ = [
    "BOUNDED",
    "EXACT",
    "HEURISTICS",
    "INSTANCE_BOUNDS",
    "PLANNERS",
    "POLICIES",
    "REGISTRY",
    "SEARCHES",
    "Limit",
    "Outcome",
    "Planner",
    "PlannerKind",
    "PlannerSpec",
    "Result",
    "Status",
    "solve",
    "without_power",
]
