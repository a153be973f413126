"""A solver-neutral integer program, the interface between the planning
model (:mod:`ntp_opt.planners.exact.model`) and the backends
(:mod:`ntp_opt.planners.exact.backends`).

All data are integers: CP-SAT needs integer coefficients, and the planning
model rounds watts conservatively (draws up, budgets down) before it builds
a program, so every integer solution is feasible for the real model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Row:
    """One linear constraint ``lo <= sum(coef[i] * x[var[i]]) <= hi``.

    ``lo`` or ``hi`` may be ``None`` (unbounded on that side).
    """

    var: tuple[int, ...]
    coef: tuple[int, ...]
    lo: int | None = None
    hi: int | None = None
    name: str = ""


@dataclass(frozen=True)
class IntProgram:
    """Maximise ``sum(obj[j] * x[j])`` over integers ``lb <= x <= ub`` subject to ``rows``.

    Attributes
    ----------
    lb, ub
        Integer bounds of every variable (``int64`` arrays of equal length).
    obj
        Integer objective coefficients (maximised).
    rows
        Linear constraints.
    names
        Optional variable names (for logs and debugging).
    hint
        Optional feasible solution used as a warm start.
    """

    lb: np.ndarray
    ub: np.ndarray
    obj: np.ndarray
    rows: tuple[Row, ...]
    names: tuple[str, ...] = ()
    hint: np.ndarray | None = field(default=None)

    @classmethod
    def from_lists(
        cls,
        lb: list[int],
        ub: list[int],
        obj: list[int],
        rows: list[Row],
        names: list[str],
    ) -> IntProgram:
        """A program from per-variable lists (as a model builder collects them)."""
        return cls(
            lb=np.array(lb, dtype=np.int64),
            ub=np.array(ub, dtype=np.int64),
            obj=np.array(obj, dtype=np.int64),
            rows=tuple(rows),
            names=tuple(names),
        )

    @property
    def n_vars(self) -> int:
        """Number of variables."""
        return len(self.lb)

    def value(self, x: np.ndarray) -> int:
        """Objective value of ``x``."""
        return int(np.dot(self.obj, x))

    def violated(self, x: np.ndarray) -> list[str]:
        """Names (or indices) of bounds and rows that ``x`` breaks; empty if feasible."""
        bad = [f"bound x{j}" for j in np.flatnonzero((x < self.lb) | (x > self.ub))]
        for i, row in enumerate(self.rows):
            s = int(sum(c * int(x[v]) for v, c in zip(row.var, row.coef, strict=True)))
            if (row.lo is not None and s < row.lo) or (row.hi is not None and s > row.hi):
                bad.append(row.name or f"row {i}")
        return bad


@dataclass(frozen=True)
class IntSolution:
    """What a backend found.

    Attributes
    ----------
    status
        ``"optimal"`` (proven), ``"feasible"`` (a solution, not proven optimal),
        ``"infeasible"`` (proven: no solution), ``"unknown"`` (stopped with none).
    x
        The solution (``int64`` array) when status is optimal or feasible.
    objective
        Its objective value.
    bound
        Proven upper bound on the optimum (maximisation), when the backend has one.
    time_limit_hit
        The backend stopped at its time limit.
    runtime_s
        Wall-clock seconds spent in the backend.
    log
        Backend log when asked for.
    interrupted
        The ``cancel`` event stopped the backend.
    """

    status: str
    x: np.ndarray | None
    objective: int | None
    bound: float | None
    time_limit_hit: bool
    runtime_s: float
    log: str | None = None
    interrupted: bool = False
