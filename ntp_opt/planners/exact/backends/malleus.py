"""Malleus's batch-split programs, built with PuLP and solved with CBC.

The two programs of :mod:`ntp_opt.planners.peers` (Malleus's min-max split
and the released code's own formulation) have a continuous step time ``z``
and real coefficients ``o_i``, and the released code's answer depends on how
PuLP orders and reports variables, so they are built with PuLP here, in the
backends, rather than as an :class:`~ntp_opt.planners.exact.program.IntProgram`.
Both run the CBC executable bundled with PuLP (``PULP_CBC_CMD``), as Malleus does.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

from ntp_opt.planners.exact.backends.common import BackendUnavailable

__all__ = ["CbcAnswer", "malleus_min_max", "malleus_shipped"]


class CbcAnswer(NamedTuple):
    """What CBC returned for a batch-split program.

    Attributes
    ----------
    values
        ``m_i`` as CBC reported them (None: no value), in the order of the
        function that returned them; empty without an integer point.
    status_optimal
        PuLP's ``status`` is Optimal.
    solution_optimal
        PuLP's ``sol_status`` is Optimal (a time-limited CBC can report an
        Optimal ``status`` for a merely integer-feasible point, PuLP issue #711).
    objective
        The objective PuLP reads (None: none).
    """

    values: list[float | None]
    status_optimal: bool
    solution_optimal: bool
    objective: float | None


def _pulp() -> Any:
    try:
        import pulp
    except ImportError as exc:
        raise BackendUnavailable("cbc", "pulp") from exc
    return pulp


def malleus_min_max(
    times: Sequence[float], n_micro_total: int, time_limit: float | None, msg: bool
) -> CbcAnswer:
    """``minimise z`` s.t. ``o_i m_i <= z``, ``sum_i m_i = N``, ``1 <= m_i <= N - n + 1`` integer.

    Parameters
    ----------
    times
        ``o_i``.
    n_micro_total
        ``N``.
    time_limit
        CBC's time limit in seconds (``None``: none).
    msg
        Show CBC's log.

    Returns
    -------
    CbcAnswer
        ``values`` in replica order, empty when CBC has no integer point.

    Raises
    ------
    BackendUnavailable
        ``pulp`` is missing (the message names the extra ``cbc``).
    """
    pulp = _pulp()
    n = len(times)
    with warnings.catch_warnings():
        # PuLP 3.x announces API changes for 4.0; this spelling works from 2.8 on.
        warnings.simplefilter("ignore", DeprecationWarning)
        prob = pulp.LpProblem("malleus_batch_split", pulp.LpMinimize)
        z = pulp.LpVariable("z", lowBound=0)
        m = [
            pulp.LpVariable(f"m_{i}", lowBound=1, upBound=n_micro_total - n + 1, cat="Integer")
            for i in range(n)
        ]
        prob += z
        for i, o in enumerate(times):
            prob += float(o) * m[i] <= z, f"time_{i}"
        prob += pulp.lpSum(m) == n_micro_total, "all_micro_batches"
        prob.solve(pulp.PULP_CBC_CMD(timeLimit=time_limit, msg=msg))
        has_point = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        return CbcAnswer(
            [v.varValue for v in m] if has_point else [],
            prob.status == pulp.LpStatusOptimal,
            prob.sol_status == pulp.LpSolutionOptimal,
            pulp.value(prob.objective) if has_point else None,
        )


def malleus_shipped(
    times: Sequence[float],
    n_micro_total: int,
    lows: Sequence[int],
    time_limit: float | None,
    msg: bool,
) -> CbcAnswer:
    """The released Malleus program: ``minimise z`` s.t. ``z >= o_i m_i``,
    ``sum_i m_i = N``, ``m_i >= S_i`` integer.

    Parameters
    ----------
    times
        ``o_i``.
    n_micro_total
        ``N``.
    lows
        ``S_i``.
    time_limit
        CBC's time limit in seconds (``None``: none, as released).
    msg
        Show CBC's log.

    Returns
    -------
    CbcAnswer
        ``values`` in the order of ``problem.variables()``, which PuLP sorts by
        name (``m_0, m_1, m_10, ..., m_2, ...``), as the released code reads them.

    Raises
    ------
    BackendUnavailable
        ``pulp`` is missing (the message names the extra ``cbc``).
    """
    pulp = _pulp()
    n = len(times)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        prob = pulp.LpProblem("malleus_as_shipped", pulp.LpMinimize)
        z = pulp.LpVariable("z", lowBound=0)
        m = [pulp.LpVariable(f"m_{i}", lowBound=0, cat="Integer") for i in range(n)]
        prob += z
        prob += pulp.lpSum(m) == n_micro_total
        for i, o in enumerate(times):
            prob += z >= float(o) * m[i]
            prob += m[i] >= lows[i]
        prob.solve(pulp.PULP_CBC_CMD(timeLimit=time_limit, msg=msg))
        by_name = [v for v in prob.variables() if "m_" in v.name]
        return CbcAnswer(
            [v.varValue for v in by_name],
            prob.status == pulp.LpStatusOptimal,
            prob.sol_status == pulp.LpSolutionOptimal,
            pulp.value(prob.objective),
        )
