"""Solve an :class:`~ntp_opt.planners.exact.program.IntProgram` with CP-SAT, HiGHS or CBC.

:func:`solve_program` is the single entry point; ``backend`` picks the solver:

``"cpsat"``
    OR-Tools CP-SAT (package ``ortools``), built through ``cp_model.CpModel``.
``"highs"``
    HiGHS through its own Python binding ``highspy`` (the model is passed as
    row-wise sparse arrays in one ``passModel`` call; PuLP is not involved).
``"cbc"``
    COIN-OR CBC through PuLP: the executable bundled with PuLP
    (``PULP_CBC_CMD``) or, failing that, a ``cbc`` found on ``PATH``
    (``COIN_CMD``).

The solver packages are imported lazily, inside the functions, so importing
this module costs nothing and a missing package only matters for the backend
that needs it (:class:`BackendUnavailable`).

Every solution returned is rounded to integers and checked against the
program with :meth:`IntProgram.violated`; a backend answer that breaks a row
raises :class:`RuntimeError` instead of being returned.

Statuses, time limits, determinism, cancelling and logs are common to every
backend: see :mod:`ntp_opt.planners.exact.backends.common`. Limits of one
backend are documented in its module (:mod:`~ntp_opt.planners.exact.backends.cbc`,
:mod:`~ntp_opt.planners.exact.backends.highs`). Each backend is a
:class:`Backend` registered in :mod:`~ntp_opt.planners.exact.backends.base`;
this module only looks them up by name.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from ntp_opt.planners.exact.backends.base import (
    Backend,
    RelaxingBackend,
    backend_names,
    get_backend,
    register,
    registered,
)
from ntp_opt.planners.exact.backends.cbc import CbcBackend
from ntp_opt.planners.exact.backends.common import BackendUnavailable, options
from ntp_opt.planners.exact.backends.cpsat import CpSatBackend
from ntp_opt.planners.exact.backends.highs import HighsBackend
from ntp_opt.planners.exact.program import IntProgram, IntSolution

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailable",
    "RelaxingBackend",
    "available_backends",
    "get_backend",
    "load_backend",
    "register",
    "solve_or_highs",
    "solve_program",
]

# in order of preference
register(CpSatBackend())
register(HighsBackend())
register(CbcBackend())

BACKENDS: tuple[str, ...] = backend_names()
"""Backend names accepted by :func:`solve_program`, in order of preference."""


def load_backend(backend: str) -> Any:
    """Import what ``backend`` needs and return it.

    Parameters
    ----------
    backend
        One of :data:`BACKENDS`.

    Returns
    -------
    Any
        ``cp_model`` for ``"cpsat"``, the ``highspy`` module for ``"highs"``,
        a ``(pulp, solver_class)`` pair for ``"cbc"``.

    Raises
    ------
    ValueError
        Unknown backend.
    BackendUnavailable
        The package, or the CBC executable, is missing.
    """
    return get_backend(backend).load()


def available_backends() -> list[str]:
    """Backends whose solver can be imported (and, for CBC, executed) here.

    Returns
    -------
    list[str]
        A sub-sequence of :data:`BACKENDS`, in that order.

    Notes
    -----
    This imports the solver packages (the module import itself does not).
    """
    return [backend.name for backend in registered() if backend.available()]


def solve_program(
    program: IntProgram,
    backend: str = "cpsat",
    *,
    time_limit: float | None = None,
    threads: int = 1,
    seed: int = 0,
    log: bool = False,
    gap: float = 0.0,
    cancel: threading.Event | None = None,
    work_limit: float | None = None,
) -> IntSolution:
    """Maximise ``program`` with one backend.

    Parameters
    ----------
    program
        The integer program.
    backend
        One of :data:`BACKENDS`.
    time_limit
        Wall-clock seconds for the backend's own time limit; None for none.
    threads
        Worker threads (CP-SAT ``num_workers``, HiGHS ``threads``, CBC
        ``-threads``).  ``threads=1`` with a fixed ``seed`` is deterministic
        unless the time limit stops the search (see the module docstring).
    seed
        Random seed, ``0 <= seed < 2**31``.
    log
        Capture the backend log into ``IntSolution.log`` (nothing is printed).
    gap
        Relative optimality gap at which to stop; the result is then reported
        ``"optimal"`` although it is only proved within ``gap`` of the bound.
    cancel
        Once set, the backend stops as soon as it can (CBC: only at the end)
        and the solution says ``interrupted``.
    work_limit
        CP-SAT only: its deterministic time limit (``max_deterministic_time``,
        about seconds of one core, but the same on any load); reaching it is
        reported like the time limit (``time_limit_hit``). Ignored by the
        other backends.

    Returns
    -------
    IntSolution
        ``x`` is an ``int64`` array, checked feasible, when ``status`` is
        ``"optimal"`` or ``"feasible"``; ``bound`` is a proven upper bound on
        the optimum, rounded down to an integer since the objective is one.

    Raises
    ------
    ValueError
        Unknown backend, bad parameters, or a malformed program.
    BackendUnavailable
        The backend's package is not installed.
    RuntimeError
        The backend failed, rejected the model, or returned a solution that
        violates the program.
    """
    chosen = get_backend(backend)
    opts = options(
        time_limit=time_limit,
        threads=threads,
        seed=seed,
        log=log,
        gap=gap,
        cancel=cancel,
        work_limit=work_limit,
    )
    return chosen.solve(program, opts)


def solve_or_highs(
    program: IntProgram,
    backend: str,
    *,
    deadline: float | None,
    threads: int = 1,
    seed: int = 0,
    cancel: threading.Event | None = None,
    work: float | None = None,
) -> IntSolution:
    """``program`` by ``backend``; with CP-SAT and ``work``, past that deterministic
    work limit HiGHS goes on from CP-SAT's solution with the time left.

    CP-SAT proves most capacity programs fast, but not all, and HiGHS proves
    some of those in a fraction of the time; the hand-over is at a deterministic
    work limit, the same on any load.

    Parameters
    ----------
    program
        The integer program.
    backend
        One of :data:`BACKENDS`.
    deadline
        :func:`time.perf_counter` value the backends stop at (``None``: none).
    threads, seed, cancel
        As in :func:`solve_program`.
    work
        CP-SAT's work limit (:func:`solve_program`'s ``work_limit``); ``None``
        or another backend: no hand-over.

    Returns
    -------
    IntSolution
        The better answer; ``time_limit_hit`` only where the deadline, not the
        work limit, stopped the search.
    """
    # a deadline that passed since the caller looked (a loaded machine): the
    # shortest limit, so that the backend stops at once and says the time did
    remaining = None if deadline is None else max(0.01, deadline - time.perf_counter())
    work = work if get_backend(backend).has_work_limit else None
    sol = solve_program(
        program, backend, time_limit=remaining, threads=threads, seed=seed,
        cancel=cancel, work_limit=work,
    )  # fmt: skip
    if work is None or sol.status in ("optimal", "infeasible") or sol.interrupted:
        return sol
    if deadline is not None:
        remaining = deadline - time.perf_counter()
        if remaining <= 0.01:
            return sol  # the time limit, not the work limit, stopped it
    if sol.x is not None:  # CP-SAT's solution as HiGHS' start
        p = program
        program = IntProgram(p.lb, p.ub, p.obj, p.rows, p.names, sol.x)
    alt = solve_program(
        program, "highs", time_limit=remaining, threads=threads, seed=seed, cancel=cancel
    )
    if alt.status == "optimal" or (alt.objective or -1) > (sol.objective or -1):
        return alt
    if alt.time_limit_hit or alt.interrupted:
        return sol  # the time limit (or a cancel) stopped HiGHS: say so
    # the work limit stopped CP-SAT, not the time limit
    return dataclasses.replace(sol, time_limit_hit=False)
