"""One entry point for every planner: :func:`solve` returns a :class:`Result`.

Planners are registered by name and imported lazily, so that a missing
optional dependency only matters to the planner that needs it.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from ntp_opt.model.control import Callback, Control, sigint_sets
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.rules.goodput import check_batch_size
from ntp_opt.rules.validate import Evaluation, check, infeasibility, pause_reason

logger = logging.getLogger(__name__)


class Status(StrEnum):
    """What is known about the returned plan."""

    OPTIMAL = "optimal"
    """The plan is proven optimal (within the gap tolerance)."""
    FEASIBLE = "feasible"
    """A feasible plan, not proven optimal (every heuristic's status)."""
    INFEASIBLE = "infeasible"
    """Proven that no feasible plan exists."""
    NO_SOLUTION = "no_solution"
    """Stopped before any feasible plan was found."""


class Limit(StrEnum):
    """Which limit stopped the planner, if any."""

    NONE = "none"
    TIME = "time_limit"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class Result:
    """Outcome of :func:`solve`.

    Attributes
    ----------
    status
        :class:`Status`.
    limit
        :class:`Limit` that stopped the search (``NONE`` if it ran to the end).
    plan
        The validated plan, or ``None`` when there is none.
    objective
        Goodput of ``plan`` in sequences per second, recomputed by the
        validator (``None`` without a plan).
    relative_objective
        ``objective * c / R`` (1.0 = the job with no failures).
    bound
        Proven upper bound on goodput, or ``None`` when the planner has none.
    runtime_s
        Wall-clock seconds.
    solver
        Planner name.
    log
        Solver log when asked for, else ``None``.
    evaluation
        The validator's full :class:`~ntp_opt.validate.Evaluation` of ``plan``.
    reason
        Why there is no plan (status ``infeasible``) or why the plan is the
        paused job (no replicas); ``None`` otherwise.
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

    @property
    def gap(self) -> float | None:
        """Relative gap ``(bound - objective) / bound``, or ``None``."""
        if self.bound is None or self.objective is None:
            return None
        if self.bound <= 0:
            return 0.0
        return max(0.0, (self.bound - self.objective) / self.bound)


#: Heuristic planners: name -> "module:function" taking an Instance, returning a Plan.
HEURISTICS: dict[str, str] = {
    "dp-drop": "ntp_opt.planners.heuristics:dp_drop",
    "ntp": "ntp_opt.planners.heuristics:ntp",
    "ntp-pw": "ntp_opt.planners.heuristics:ntp_pw",
    "megatron-ntp": "ntp_opt.planners.peers:megatron_ntp",
    "megatron-ntp-reordered": "ntp_opt.planners.peers:megatron_ntp_reordered",
}

#: Heuristic planners that also prove an upper bound: name -> "module:function"
#: taking an Instance (and ``validate=False``), returning ``(Plan, bound)``.
BOUNDED: dict[str, str] = {
    "fast": "ntp_opt.planners.fast:plan_fast",
}

#: Exact planners: name -> (integer-programming backend, power boost allowed).
EXACT: dict[str, tuple[str, bool]] = {
    "optimal": ("cpsat", True),
    "optimal-nopower": ("cpsat", False),
    "cpsat": ("cpsat", True),
    "highs": ("highs", True),
    "cbc": ("cbc", True),
    "optimal-megatron": ("cpsat", True),
    "optimal-megatron-nopower": ("cpsat", False),
}

#: Exact planners restricted to plans Megatron-LM's NTP runtime can run
#: (one reduced degree, reduced replicas first): :func:`ntp_opt.megatron.solve_megatron`.
MEGATRON_RUNTIME: frozenset[str] = frozenset({"optimal-megatron", "optimal-megatron-nopower"})

#: Planners that use the time limit, seed and threads: name -> "module:function"
#: returning an object with ``plan``, ``bound`` and ``time_limit_hit``.
SEARCHES: dict[str, str] = {
    "risk-aware": "ntp_opt.planners.riskaware:plan_risk_aware",
}

#: Planners whose :attr:`Result.bound` holds for the instance as it is. The
#: others bound a restricted problem (``optimal-nopower``: no boost;
#: ``optimal-megatron``: one reduced degree) or have no bound.
INSTANCE_BOUNDS: frozenset[str] = frozenset({"optimal", "cpsat", "highs", "cbc", *BOUNDED})

#: Every planner name :func:`solve` accepts.
PLANNERS: tuple[str, ...] = (*HEURISTICS, *BOUNDED, *EXACT, *SEARCHES)

#: The policies of docs/model.md, spec section 5, as compared by ``ntp-opt compare``.
POLICIES: tuple[str, ...] = ("dp-drop", "ntp", "ntp-pw", "optimal-nopower", "optimal")


def _heuristic(name: str) -> Callable[[Instance], Plan]:
    module, func = HEURISTICS[name].split(":")
    planner: Callable[[Instance], Plan] = getattr(importlib.import_module(module), func)
    return planner


def without_power(instance: Instance) -> Instance:
    """The same instance with power boost disabled (``max_boost = 0``)."""
    job = instance.job.model_copy(update={"max_boost": 0.0})
    return Instance(instance.name, instance.cluster, job, instance.meta, copy_graph=False)


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
        plans Megatron-LM's NTP runtime can run: see :mod:`ntp_opt.megatron`),
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
        Called with a :class:`ntp_opt.control.SolveProgress` (planner,
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
        Its plan, if any, has passed :func:`ntp_opt.validate.check`.
    """
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be positive, got {time_limit!r}")
    if solver not in PLANNERS:
        raise ValueError(f"unknown solver {solver!r}; known: {', '.join(PLANNERS)}")
    check_batch_size(instance.job)  # SizeLimitError (a ValueError) before any array is built
    control = Control(solver, callback, cancel)
    with sigint_sets(control.cancel):
        logger.info("%s: solving %s", solver, instance.name)
        result = _solve(instance, solver, time_limit, seed, threads, initial_plan, log, control)
    if control.cancelled and result.plan is not None:
        result = dataclasses.replace(result, limit=Limit.INTERRUPTED)
    if result.status == Status.OPTIMAL and result.limit == Limit.INTERRUPTED:
        # proven before the cancel was seen: the proof stands
        result = dataclasses.replace(result, limit=Limit.NONE)
    control.report(result.objective, result.bound, final=True)
    logger.info("%s: %s, limit %s, %.2f s", solver, result.status, result.limit, result.runtime_s)
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
    if solver in HEURISTICS:  # at most seconds: run to the end
        plan = _heuristic(solver)(instance)
        status, limit, bound, text = Status.FEASIBLE, Limit.NONE, None, None
    elif solver in BOUNDED:
        module, func = BOUNDED[solver].split(":")
        # solve checks the plan below: the planner need not check it too
        plan, bound = getattr(importlib.import_module(module), func)(
            instance, validate=False, cancel=control.cancel
        )
        status = Status.FEASIBLE  # OPTIMAL below if the checked goodput reaches the bound
        limit, text = Limit.NONE, None
        plan = plan.with_metrics(bound=bound)
    elif solver in SEARCHES:
        module, func = SEARCHES[solver].split(":")
        search = getattr(importlib.import_module(module), func)
        found = search(
            instance, time_limit=time_limit, seed=seed, threads=threads, cancel=control.cancel
        )
        plan, bound, text = found.plan, found.bound, None
        status = Status.FEASIBLE
        limit = (
            Limit.INTERRUPTED
            if found.interrupted
            else Limit.TIME
            if found.time_limit_hit
            else Limit.NONE
        )
    else:
        backend, power = EXACT[solver]
        try:
            from ntp_opt.planners.exact.search import solve_exact
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(f"solver {solver!r} needs {err.name}") from err
        search = solve_exact
        if solver in MEGATRON_RUNTIME:
            from ntp_opt.planners.megatron import solve_megatron

            search = solve_megatron
        target = instance if power else without_power(instance)
        out = search(
            target,
            backend,
            time_limit=time_limit,
            threads=threads,
            seed=seed,
            initial_plan=initial_plan,
            log=log,
            control=control,
        )
        plan = out.plan.with_metrics(policy=solver)
        status = Status.OPTIMAL if out.proven else Status.FEASIBLE
        limit = (
            Limit.INTERRUPTED
            if out.interrupted
            else Limit.TIME
            if out.time_limit_hit
            else Limit.NONE
        )
        bound = out.bound
        text = "\n".join(out.log) if log else None
        if bound is not None:
            plan = plan.with_metrics(bound=bound)
    runtime = time.perf_counter() - start
    evaluation = check(instance, plan)  # never trust a planner
    if solver in BOUNDED and bound is not None:
        if evaluation.goodput > bound * (1 + 1e-9):  # a bug, never hidden
            raise RuntimeError(
                f"planner {solver!r}: goodput {evaluation.goodput} above its bound {bound}"
            )
        if bound <= evaluation.goodput * (1 + 1e-6):
            status = Status.OPTIMAL
        plan = plan.with_metrics(**evaluation.as_metrics())
    return Result(
        status=status,
        limit=limit,
        plan=plan,
        objective=evaluation.goodput,
        relative_objective=evaluation.relative_goodput,
        bound=bound,
        runtime_s=runtime,
        solver=solver,
        log=text,
        evaluation=evaluation,
        reason=None if plan.replicas else pause_reason(instance, status == Status.OPTIMAL),
    )
