"""The one planner contract: ``planner(instance, options) -> Outcome``.

Every planner is a function ``name(instance: Instance, options: RunOptions =
RunOptions(), *, <its knobs>) -> Outcome`` (a :class:`Planner` once its knobs
are bound); the plan in the :class:`Outcome` is not yet checked: only
:func:`ntp_opt.solve.solve` checks it (a workflow may call
:func:`ntp_opt.rules.validate.certified` itself). Each is listed with its
properties (:class:`PlannerSpec`, :class:`PlannerKind`) in
:data:`ntp_opt.planners.registry.REGISTRY`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from ntp_opt.model.control import Control
from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan


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
    UNSETTLED = "unsettled"
    """An exact planner stopped before its time limit without a proof: a program
    its search needs could not be settled (a capacity program left with
    ``lower < upper``, a case too large to model) or its model is not exact for
    the instance; the log says which. Never paired with status ``optimal``
    unless the bound closes the gap anyway."""


def stop_limit(*, interrupted: bool, timed_out: bool, proven: bool) -> Limit:
    """The :class:`Limit` an exact planner reports: a cancel first, then the time
    limit; without either, ``NONE`` only with a proof, else ``UNSETTLED``.

    Parameters
    ----------
    interrupted
        A cancel (Ctrl-C) stopped the search.
    timed_out
        The time limit stopped it.
    proven
        The plan is proven optimal (or the instance infeasible).

    Returns
    -------
    Limit
    """
    if interrupted:
        return Limit.INTERRUPTED
    if timed_out:
        return Limit.TIME
    return Limit.NONE if proven else Limit.UNSETTLED


@dataclass(frozen=True)
class Outcome:
    """What a :class:`Planner` found (not yet checked by the validator).

    Attributes
    ----------
    plan
        The best plan found, or ``None`` when there is none (stopped before
        any plan, or proven infeasible).
    bound
        Upper bound on goodput proven by the planner, or ``None``.
    proven
        ``plan`` is proven optimal (or, without a plan, the instance proven
        infeasible).
    limit
        :class:`Limit` that stopped the planner (``NONE``: ran to the end; an
        exact planner without a proof reports ``UNSETTLED``, :func:`stop_limit`).
    log
        Lines of the planner's log (empty unless asked for).
    stats
        Extra counters the planner reports (e.g. ``evaluations``).
    layout
        ``plan`` in index space (``Layout.from_plan(instance, plan)``), when the
        planner provides it (the exact planner does for every plan it returns);
        ``None`` otherwise (and without a plan).
    """

    plan: Plan | None
    bound: float | None = None
    proven: bool = False
    limit: Limit = Limit.NONE
    log: tuple[str, ...] = ()
    stats: Mapping[str, float] = field(default_factory=dict)
    layout: Layout | None = None

    def require_plan(self) -> Plan:
        """:attr:`plan`, from a planner that always returns one (a heuristic, ``fast``).

        Raises
        ------
        ValueError
            There is no plan.
        """
        if self.plan is None:
            raise ValueError(f"no plan (limit {self.limit}, proven {self.proven})")
        return self.plan

    @property
    def time_limit_hit(self) -> bool:
        """The time limit stopped the planner."""
        return self.limit == Limit.TIME

    @property
    def interrupted(self) -> bool:
        """A cancel (or SIGINT) stopped the planner."""
        return self.limit == Limit.INTERRUPTED


@dataclass(frozen=True)
class RunOptions:
    """What :func:`ntp_opt.solve.solve` passes every planner besides the instance.

    Attributes
    ----------
    time_limit
        Seconds, or ``None`` for no limit (heuristics ignore it).
    seed, threads
        The backend's random seed and worker threads.
    initial_plan
        A warm start for exact planners.
    log
        Keep the search log in :attr:`Outcome.log`.
    control
        Progress reports and the cancel token.

    Notes
    -----
    A planner's default ``options=RunOptions()`` is one object, made when its
    module is imported and shared by every call that leaves ``options`` out:
    its control has no callback and a cancel token nobody sets, and its
    monotone progress record (which only the INFO log reads) carries over from
    one such call to the next. A caller that wants progress, a cancel token or
    a per-call clock passes its own ``RunOptions`` (as :func:`ntp_opt.solve.solve`
    does on every call).
    """

    time_limit: float | None = None
    seed: int = 0
    threads: int = 1
    initial_plan: Plan | None = None
    log: bool = False
    control: Control = field(default_factory=lambda: Control("", None, None))


class PlannerKind(StrEnum):
    """What :func:`ntp_opt.solve.solve` may rely on in a planner's :class:`Outcome`."""

    HEURISTIC = "heuristic"
    """Runs to the end, no bound."""
    BOUNDED = "bounded"
    """A heuristic with a proven bound: the plan is optimal when its checked
    goodput reaches the bound."""
    EXACT = "exact"
    """An exact search: a proof, or a plan and a bound when a limit stops it."""
    SEARCH = "search"
    """Maximises another objective (``stats["expected_objective"]``), which
    its bound bounds."""


class Planner(Protocol):
    """A planner as :func:`ntp_opt.solve.solve` calls it."""

    def __call__(self, instance: Instance, options: RunOptions) -> Outcome:
        """Plan ``instance`` under ``options``."""
        ...


@dataclass(frozen=True)
class PlannerSpec:
    """A registered planner and what :func:`ntp_opt.solve.solve` may rely on.

    Attributes
    ----------
    run
        The planner.
    description
        One line for listings.
    instance_bound
        Its bound (if any) holds for the instance as it is (not for a
        restricted problem such as no power boost).
    uses_time_limit
        It uses the time limit, seed and threads (heuristics do not).
    kind
        :class:`PlannerKind` (a string is converted).
    backend
        Integer-programming backend of an exact planner, else ``None``.
    """

    run: Planner
    description: str
    instance_bound: bool = False
    uses_time_limit: bool = False
    kind: PlannerKind = PlannerKind.HEURISTIC
    backend: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", PlannerKind(self.kind))
