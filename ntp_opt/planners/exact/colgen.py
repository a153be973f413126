"""The capacity program ``C(theta')`` with configurations generated on demand.

:func:`ntp_opt.planners.exact.capacity.build_capacity` lists every configuration
of every domain class, which is impossible when a domain hosts many stages
(TP8 on a 72-GPU domain: nine stages, each with its own degree and batch
level). This module solves the same program by column generation:

* the *restricted master LP* holds the configurations generated so far (at
  the start: the configurations that repeat one stage kind as often as it
  fits, and the configurations that were useful at earlier step times). Its
  rows are the ones of :func:`~ntp_opt.planners.exact.capacity.build_capacity`:
  one convexity row per domain class (or domain of a multi-domain unit), a
  row per replica class ``(t, b)`` (stages = ``pp * n[t, b]``), ``dp_max``,
  ``global_batch``, the site budget and the racks of multi-domain units;
* *pricing*: for every owner (domain class, or domain of a multi-domain
  unit) an exact search over the configurations the full program would list
  (stages on consecutive blocks of the domain's GPUs in stage order, kinds
  in non-increasing speed requirement, fitting the unit's rack budgets), for
  the largest ``sum dual(t, b) - dual_site * site_mW - sum dual_rack * rack_mW``:
  a depth-first search bounded by an unbounded knapsack over the positive
  duals. Configurations with a positive reduced cost join the master;
* the *bound*: for any duals (signs as the rows require), the Lagrangian
  value ``sum rhs * dual + sum_owner size * max(0, best price) +
  sum_(t, b) dp_max * max(0, reduced cost of n[t, b])`` bounds ``C(theta')``
  from above, because the pricing is exact over *all* configurations. It is
  evaluated at every round's duals, and the smallest is kept (rounded down:
  ``C`` is an integer). At the LP optimum it equals the LP value;
* the *integer master*: the same integer program as the full model, over the
  generated columns only, solved by one of the exact backends
  (:func:`~ntp_opt.planners.exact.backends.solve_program`): a feasible lower
  bound, with its stages readable by
  :func:`~ntp_opt.planners.exact.capacity.iter_stages`. When it meets the bound,
  ``C(theta')`` is proven (price-and-branch).

The pricing is :mod:`ntp_opt.planners.exact.colgen_pricing`, the master LP and
the integer master :mod:`ntp_opt.planners.exact.colgen_master`; this module holds
:class:`ColumnGeneration`, which runs them across step times. The LP is solved
with HiGHS (``highspy``, extra ``ntp-opt[highs]``) through
:class:`~ntp_opt.planners.exact.backends.highs.HighsLP`, imported lazily.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.planners.exact.backends import get_backend, load_backend
from ntp_opt.planners.exact.capacity import Capacity, CapacityBuilder
from ntp_opt.planners.exact.colgen_master import TARGET_NODES, IntOptions, Master, MasterNode
from ntp_opt.planners.exact.colgen_pricing import (
    check_deadline,
    owner_domain,
    owners,
    stage_options,
)
from ntp_opt.planners.exact.model import Config, ModelTooLarge, Prepared
from ntp_opt.planners.exact.program import IntSolution

__all__ = [
    "ColumnGeneration",
    "MasterResult",
    "column_generation_available",
    "column_generation_for",
]

#: Patterns kept per owner between step times.
POOL_SIZE = 400


@dataclass(frozen=True)
class MasterResult:
    """What :meth:`ColumnGeneration.solve` found at one step time.

    Attributes
    ----------
    capacity
        The integer master over the generated columns, readable by
        :func:`~ntp_opt.planners.exact.capacity.iter_stages`.
    solution
        The backend's answer for it.
    upper
        Proven upper bound on ``C(theta')`` (the Lagrangian bound of the LP, rounded down).
    lp_value
        Value of the last restricted master LP.
    rounds
        Pricing rounds.
    columns
        Configuration columns generated.
    """

    capacity: Capacity
    solution: IntSolution
    upper: int
    lp_value: float
    rounds: int
    columns: int

    @property
    def lower(self) -> int:
        """Value of the integer solution found (0 when none)."""
        return int(self.solution.objective) if self.solution.objective is not None else 0


def column_generation_for(
    prep: Prepared, degrees: tuple[int, ...], theta_max: float
) -> ColumnGeneration | None:
    """A :class:`ColumnGeneration` for these degrees, or ``None`` when it cannot help:
    ``highspy`` is missing, or a domain has more than :data:`MAX_KINDS` stage kinds at
    ``theta_max`` (the largest step time searched, where the most kinds fit).

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    degrees
        TP degrees replicas may use.
    theta_max
        The largest step time the search will ask about.

    Returns
    -------
    ColumnGeneration or None
    """
    if not column_generation_available():
        return None
    try:
        for ow in owners(prep, group_units=True):
            stage_options(prep, owner_domain(prep, ow), theta_max, degrees)
    except ModelTooLarge:
        return None
    return ColumnGeneration(prep, degrees)


def column_generation_available() -> bool:
    """Whether the master LP's solver (HiGHS, ``highspy``) can be imported."""
    return get_backend("highs").available()


@dataclass
class ColumnGeneration:
    """``C(theta')`` by column generation for one set of degrees, across step times.

    Patterns (the stage kinds of a configuration) that were used at one step
    time seed the master at the next.

    Parameters
    ----------
    prep
        From :func:`~ntp_opt.planners.exact.model.prepare`.
    degrees
        TP degrees replicas may use.
    """

    prep: Prepared
    degrees: tuple[int, ...]
    pool: dict[int, dict[tuple[tuple[int, int], ...], None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.owners = owners(self.prep, group_units=True)

    # -- the master LP ---------------------------------------------------------

    def solve(
        self,
        theta: float,
        backend: str = "cpsat",
        *,
        deadline: float | None = None,
        threads: int = 1,
        seed: int = 0,
        cancel: threading.Event | None = None,
        target: int | None = None,
        bound: Callable[[], int] | None = None,
    ) -> MasterResult:
        """Bounds on ``C(theta')``: the LP bound and an integer solution over the columns.

        Parameters
        ----------
        theta
            Step time before the resharding factor.
        backend
            Backend of the integer master (:data:`~ntp_opt.planners.exact.backends.BACKENDS`).
        deadline
            :func:`time.perf_counter` value: :class:`DeadlineReached` once it passes
            during column generation; the integer master gets the time left.
        threads, seed, cancel
            Passed to the backend.
        target
            The caller only asks whether ``C(theta') >= target``: when the LP bound
            is already below it, no integer master is solved (the result has no
            solution, ``lower`` 0 and the LP bound as ``upper``). When the integer
            master and the branching leave ``C`` open with ``lower < target <= upper``,
            a longer branch and bound (:data:`TARGET_NODES` nodes) prunes every node
            bounded below ``target``: ``upper`` drops below ``target`` when it closes.
        bound
            Called where the first integer master leaves a gap: an upper bound on
            ``C(theta')`` from elsewhere (the merged program,
            :func:`~ntp_opt.planners.exact.merged.merged_capacity`). Where it meets
            the integer master's value, ``C`` is proven without closing the gap here.

        Returns
        -------
        MasterResult

        Raises
        ------
        ModelTooLarge
            Too many stage kinds at this step time.
        DeadlineReached
            The deadline passed before the integer master.
        BackendUnavailable
            ``highspy`` (or the backend's package) is missing.
        """
        load_backend("highs")  # the master LP's solver, or BackendUnavailable at once
        master = Master(
            self.prep,
            self.owners,
            self.degrees,
            theta,
            IntOptions(backend, deadline, threads, seed, cancel),
        )
        if not master.kinds:  # no stage fits anywhere at this step time: C = 0
            return self._empty(theta, 0, 0.0, 0, 0)
        master.seed(self.pool)
        check_deadline(deadline)
        root = master.generate({})
        lp_value = root.lp_value
        self._remember(root.used)
        if target is not None and root.upper < target:
            return self._empty(
                theta, max(0, root.upper), lp_value, master.rounds, len(master.columns)
            )
        self._close(master, root, target, bound)
        return MasterResult(
            master.cap, master.sol, int(master.upper), lp_value, master.rounds, len(master.columns)
        )

    def _empty(
        self, theta: float, upper: int, lp_value: float, rounds: int, columns: int
    ) -> MasterResult:
        """A result without configurations (``C = 0`` proven, or the target out of reach)."""
        empty = CapacityBuilder(self.prep).finish(theta, self.degrees)
        sol = IntSolution("optimal", np.zeros(0, dtype=np.int64), 0, 0.0, False, 0.0)
        return MasterResult(empty, sol, upper, lp_value, rounds, columns)

    @staticmethod
    def _close(
        master: Master, root: MasterNode, target: int | None, bound: Callable[[], int] | None
    ) -> None:
        """The integer master, and the gap to the bound closed as far as it goes."""
        master.start_integer(root)
        if bound is not None and master.open():
            master.upper = max(master.lower, min(master.upper, bound()))
        master.close_gap(root)
        if target is not None and master.open() and master.lower <= target - 1 < master.upper:
            # the caller only asks whether C reaches `target`: prune the nodes below it
            open_bound = master.branch(root, target - 1, TARGET_NODES)
            master.upper = max(master.lower, min(master.upper, math.floor(open_bound)))

    def _remember(self, used: list[tuple[int, Config]]) -> None:
        """Keep the patterns of the configurations used at the root for later step times."""
        for oi, cfg in used:
            pool = self.pool.setdefault(oi, {})
            pool[tuple((st.t, st.b) for st in cfg.stages)] = None
            while len(pool) > POOL_SIZE:
                del pool[next(iter(pool))]
