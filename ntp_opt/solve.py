"""One entry point for every planner: :func:`solve` returns a :class:`Result`.

Planners are registered by name and imported lazily, so that a missing
optional dependency only matters to the planner that needs it.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from .instance import Instance
from .plan import Plan
from .validate import Evaluation, check


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

    @property
    def gap(self) -> float | None:
        """Relative gap ``(bound - objective) / bound``, or ``None``."""
        if self.bound is None or self.objective is None:
            return None
        if self.bound <= 0:
            return 0.0
        return max(0.0, (self.bound - self.objective) / self.bound)


#: Planner name -> "module:function"; each takes an Instance, returns a Plan.
PLANNERS: dict[str, str] = {
    "dp-drop": "ntp_opt.baselines:dp_drop",
    "ntp": "ntp_opt.baselines:ntp",
    "ntp-pw": "ntp_opt.baselines:ntp_pw",
}

#: Optional dependency (pip extra) each planner module needs, for error messages.
EXTRAS: dict[str, str] = {}


def _load(name: str) -> Callable[[Instance], Plan]:
    try:
        target = PLANNERS[name]
    except KeyError:
        known = ", ".join(PLANNERS)
        raise ValueError(f"unknown solver {name!r}; known: {known}") from None
    module, func = target.split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as err:  # pragma: no cover - depends on the environment
        extra = EXTRAS.get(name, "")
        hint = f" (pip install 'ntp-opt[{extra}]')" if extra else ""
        raise ImportError(f"solver {name!r} needs {err.name}{hint}") from err
    planner: Callable[[Instance], Plan] = getattr(mod, func)
    return planner


def solve(
    instance: Instance,
    solver: str = "ntp-pw",
    *,
    time_limit: float | None = None,
    seed: int = 0,
    threads: int = 1,
    initial_plan: Plan | None = None,
    log: bool = False,
) -> Result:
    """Plan ``instance`` with the named planner.

    Parameters
    ----------
    instance
        The instance.
    solver
        A key of :data:`PLANNERS` (``"dp-drop"``, ``"ntp"``, ``"ntp-pw"``).
    time_limit
        Seconds; heuristics ignore it (they run in well under a second).
    seed
        Random seed (the baselines are deterministic and ignore it).
    threads
        Worker threads for solvers that use them.
    initial_plan
        Warm start for solvers that take one.
    log
        Keep the solver log in :attr:`Result.log`.

    Returns
    -------
    Result
        Its plan, if any, has passed :func:`ntp_opt.validate.check`.
    """
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be positive, got {time_limit!r}")
    planner = _load(solver)
    start = time.perf_counter()
    plan = planner(instance)
    runtime = time.perf_counter() - start
    evaluation = check(instance, plan)  # never trust a planner
    return Result(
        status=Status.FEASIBLE,
        limit=Limit.NONE,
        plan=plan,
        objective=evaluation.goodput,
        relative_objective=evaluation.relative_goodput,
        bound=None,
        runtime_s=runtime,
        solver=solver,
        log=None,
        evaluation=evaluation,
    )
