"""The domain master of the risk-aware planner's bound, built and solved with CP-SAT.

:func:`domain_master` maximises ``sum_s w_s v_s(D ∩ A_s)`` over the sets ``D``
of ``k`` usable domains (the model is described in
:mod:`ntp_opt.planners.riskaware.nonanticipative`). Its logical constraints
(implications, enforced sums) are CP-SAT's own, so the program is built here,
in the backends, rather than as an :class:`~ntp_opt.planners.exact.program.IntProgram`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ntp_opt.planners.exact.backends.cpsat import load

__all__ = ["MasterOption", "domain_master"]


class MasterOption(Protocol):
    """One option ``(T, c)`` or ``(T, g)`` of a scenario, as the master reads it."""

    @property
    def domains(self) -> tuple[int, ...]:
        """``T``: the scenario's affected domains in ``D``."""
        ...

    @property
    def key(self) -> object:
        """None for an uncoupled option (value ``U_s``, no constraint)."""
        ...

    @property
    def dead(self) -> tuple[int, ...]:
        """The domains of ``T`` left without a stage's worth of GPUs."""
        ...

    @property
    def lost(self) -> int:
        """Replicas the dead domains take down at least (classes of ``dead``)."""
        ...

    @property
    def degraded(self) -> tuple[int, ...]:
        """No dead domain: the live domains of ``T``."""
        ...

    @property
    def groups(self) -> int:
        """Replicas the degraded domains lie in at least."""
        ...


def domain_master(
    options: Sequence[MasterOption],
    per_scenario: list[list[int]],
    affected: list[tuple[int, ...]],
    usable: list[int],
    k: int,
    pp: int,
    weights: np.ndarray,
    values: list[float],
    time_limit: float | None,
    seed: int,
    scale: float,
) -> tuple[float, tuple[int, ...], list[int]]:
    """``max sum_s w_s v_s(D ∩ A_s)`` over ``|D| = k``: its proven bound, its ``D`` and options.

    Parameters
    ----------
    options
        Every scenario's options.
    per_scenario
        Indices into ``options`` of each scenario's options.
    affected
        The usable domains each scenario fails GPUs in.
    usable
        The domains ``D`` is chosen from.
    k
        ``|D|``.
    pp
        Stages per replica (at most ``pp`` dead-able domains share one replica).
    weights
        ``w_s``.
    values
        The value of each option.
    time_limit
        CP-SAT's time limit in seconds (at least 0.01; None: none).
    seed
        CP-SAT's random seed (one worker).
    scale
        Factor making the objective's coefficients integers (rounded up).

    Returns
    -------
    tuple[float, tuple[int, ...], list[int]]
        The proven bound, the chosen domains and the chosen options; ``inf``,
        ``()`` and ``[]`` without a solution.

    Raises
    ------
    BackendUnavailable
        ``ortools`` is missing (the message names the extra ``cpsat``).
    """
    cp_model = load()
    m = cp_model.CpModel()
    z = {d: m.new_bool_var(f"z{d}") for d in usable}
    m.add(sum(z.values()) == k)
    u = _pair_vars(m, options, z, pp)
    y = [m.new_bool_var(f"y{i}") for i in range(len(options))]
    constant, terms = _scenario_rows(
        m, _Model(options, y, z, u), per_scenario, affected, weights, values, scale
    )
    m.maximize(sum(c * y[i] for i, c in terms))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    # the LP of every constraint: proves the grouped masters (pairs of
    # degraded domains) in about a second where level 1 was cut at 10 s
    solver.parameters.linearization_level = 2
    if time_limit is not None:
        solver.parameters.max_time_in_seconds = max(time_limit, 0.01)
    status = solver.solve(m)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        bound = solver.best_objective_bound / scale + constant
        chosen = tuple(d for d in usable if solver.value(z[d]))
        picked = [i for i in range(len(options)) if solver.value(y[i])]
        return bound, chosen, picked
    return math.inf, (), []


@dataclass
class _Model:
    """The options and the variables of the domain master."""

    options: Sequence[MasterOption]
    y: list[Any]
    z: dict[int, Any]
    u: dict[tuple[int, int], Any]


def _scenario_rows(
    m: Any,
    mod: _Model,
    per_scenario: list[list[int]],
    affected: list[tuple[int, ...]],
    weights: np.ndarray,
    values: list[float],
    scale: float,
) -> tuple[float, list[tuple[int, int]]]:
    """Each scenario's choice of one option; the objective's constant and terms."""
    options, y = mod.options, mod.y
    constant = 0.0
    terms = []
    for s, mine in enumerate(per_scenario):
        if len(mine) == 1 and options[mine[0]].key is None:
            constant += float(weights[s]) * values[mine[0]]
            m.add(y[mine[0]] == 1)
            continue
        m.add_exactly_one(y[i] for i in mine)
        for i in mine:
            _option_rows(m, options[i], y[i], affected[s], mod.z, mod.u)
        for i in mine:
            terms.append((i, math.ceil(float(weights[s]) * values[i] * scale)))
    return constant, terms


def _pair_vars(
    m: Any, options: Sequence[MasterOption], z: dict[int, Any], pp: int
) -> dict[tuple[int, int], Any]:
    """``u[d, e]``: dead-able domains ``d`` and ``e`` in one replica (at most ``pp``
    per replica), for the pairs some option counts only (a pair no option reads can be 0)."""
    u = {}
    for o in options:
        for group in (o.dead, o.degraded):
            for j, d in enumerate(group):
                for e in group[j + 1 :]:
                    if (d, e) not in u:
                        u[d, e] = m.new_bool_var(f"u{d}_{e}")
                        m.add_implication(u[d, e], z[d])
                        m.add_implication(u[d, e], z[e])
    groupable = sorted({d for pair in u for d in pair})
    for d in groupable:
        m.add(sum(v for (x, y_), v in u.items() if d in (x, y_)) <= pp - 1)
    return u


def _option_rows(
    m: Any,
    o: MasterOption,
    y_i: Any,
    affected: tuple[int, ...],
    z: dict[int, Any],
    u: dict[tuple[int, int], Any],
) -> None:
    """What choosing option ``o`` (``y_i``) of a scenario implies for ``D`` and the pairs."""
    t = set(o.domains)
    for d in affected:
        m.add_implication(y_i, z[d] if d in t else z[d].negated())
    # the dead domains form at most `lost` classes, the degraded ones
    # at most `groups`: at least (members - classes) pairs among them
    for group, classes in ((o.dead, o.lost), (o.degraded, o.groups)):
        if classes < len(group):
            pairs = [u[d, e] for j, d in enumerate(group) for e in group[j + 1 :]]
            need = len(group) - classes
            if need == len(pairs):
                for v in pairs:
                    m.add_implication(y_i, v)
            elif need == 1:
                m.add_bool_or(pairs).only_enforce_if(y_i)
            else:
                m.add(sum(pairs) >= need).only_enforce_if(y_i)
