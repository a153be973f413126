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

Statuses
--------
``"optimal"`` is reported only when the backend proved optimality (within
``gap`` when ``gap > 0``); a backend stopped by its time limit with a
solution reports ``"feasible"``, without one ``"unknown"``; both set
``time_limit_hit`` (or ``interrupted`` when the ``cancel`` event stopped it).
If the program carries a feasible ``hint`` and the backend returns nothing
better (or nothing at all), the hint is returned instead, so a feasible hint
is never lost.

Time limits
-----------
``time_limit`` is handed to the backend's own limit (CP-SAT
``max_time_in_seconds``, HiGHS ``time_limit``, CBC ``-sec`` in wall-clock
mode) and nothing else is added: there is no watchdog.  Building the model
and reading the answer are not covered by the limit, but are included in
``IntSolution.runtime_s`` (``time.perf_counter`` around the whole call).

Determinism
-----------
With ``threads=1``, a fixed ``seed`` and no time limit stopping the search,
every backend is deterministic for a fixed program and solver version:

* CP-SAT: deterministic with one worker (``num_workers=1``) on one OR-Tools
  version.  With several workers the answer may change from run to run.
* HiGHS: deterministic with ``threads=1``.
* CBC: deterministic single-threaded.  ``seed=0`` keeps CBC's own fixed
  default seeds (CBC reads a seed of 0 as "use the time of day", so it is
  never passed); other seeds are passed as ``randomSeed`` and
  ``randomCbcSeed``.  With ``threads > 1`` CBC is run in its "repeatable"
  parallel mode (``-threads 100+n``).

A time limit breaks determinism for every backend: the search stops after a
wall-clock time, so where it stops, and so the solution, the bound and even
the status, depend on machine speed and load.  Runs that finish (proved
``"optimal"`` or ``"infeasible"``) before the limit are unaffected.

Cancel and Ctrl-C
-----------------
``cancel`` (a :class:`threading.Event`) stops a running solve: CP-SAT through
``CpSolver.stop_search`` from a watcher thread, HiGHS through its interrupt
callbacks, CBC (a separate process) not at all: the caller checks ``cancel``
between programs.  CP-SAT is told not to catch SIGINT itself
(``catch_sigint_signal = False``: OR-Tools would reset SIGINT to the default
action afterwards, so a second Ctrl-C would kill the process), and the Python
SIGINT handler is reinstalled after every CP-SAT solve all the same.

Logs
----
With ``log=True`` the backend log is captured into ``IntSolution.log`` and
nothing is printed: CP-SAT through ``log_callback``, HiGHS and CBC through a
temporary log file.  HiGHS prints a two-line banner to the process's standard
output the first time a ``highspy.Highs`` object is created; this module
creates the first one with file descriptor 1 pointed at ``os.devnull`` so the
banner does not leak into the caller's output.

CBC limitations
---------------
* CBC checks its time limit only once branch-and-bound runs: the root LP
  relaxation is solved to the end whatever the limit (a random program with
  2,000 rows, 20,000 columns and 10^5 terms took 70 s under a 1 s limit).
* The CBC solution file, which PuLP reads, prints values with 8 significant
  digits, so variables of magnitude 10^8 or more come back inexact; the
  feasibility check then raises :class:`RuntimeError`.
* The bound is read from CBC's log ("Upper bound:"), printed with 3 decimals.

HiGHS threads
-------------
HiGHS keeps one global thread scheduler per process, sized by the first run;
a later run asking for another ``threads`` value fails.  This module resets
the scheduler (``Highs.resetGlobalScheduler``) when the requested thread
count changes, so do not run HiGHS concurrently from several Python threads
with different ``threads`` values.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import numpy as np

from ntp_opt.planners.exact.backends import cbc, cpsat, highs
from ntp_opt.planners.exact.backends.common import (
    BACKENDS,
    MAX_SEED,
    BackendUnavailable,
    Options,
    Raw,
    check_backend,
    finish,
    int_param,
    prepare,
)
from ntp_opt.planners.exact.program import IntProgram, IntSolution

__all__ = ["BACKENDS", "BackendUnavailable", "available_backends", "load_backend", "solve_program"]

logger = logging.getLogger(__name__)


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
    check_backend(backend)
    if backend == "cpsat":
        return cpsat.load()
    if backend == "highs":
        return highs.load()
    return cbc.load()


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
    found = []
    for backend in BACKENDS:
        try:
            load_backend(backend)
        except BackendUnavailable:
            continue
        found.append(backend)
    return found


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
    check_backend(backend)
    if time_limit is not None and not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit must be a positive number of seconds, not {time_limit!r}")
    threads = int_param("threads", threads, 1, 10_000)
    seed = int_param("seed", seed, 0, MAX_SEED)
    if not (0.0 <= gap < 1.0):
        raise ValueError(f"gap must be in [0, 1), not {gap!r}")
    opts = Options(
        time_limit=None if time_limit is None else float(time_limit),
        threads=threads,
        seed=seed,
        log=log,
        gap=float(gap),
        cancel=cancel,
    )

    solver = load_backend(backend)
    t0 = time.perf_counter()
    data, broken = prepare(program)
    if broken:
        raw = Raw("infeasible", log=f"infeasible before solving: {', '.join(broken)}")
    elif program.n_vars == 0:
        raw = Raw("optimal", values=np.zeros(0), bound=0.0, log="empty program")
    elif backend == "cpsat":
        raw = cpsat.solve_cpsat(solver, program, data, opts)
    elif backend == "highs":
        raw = highs.solve_highs(solver, data, opts)
    else:
        pulp, cbc_class = solver
        raw = cbc.solve_cbc(pulp, cbc_class, data, opts)
    solution = finish(program, data, backend, raw, opts, time.perf_counter() - t0)
    logger.debug(
        "%s: %d variables, %d rows: %s, objective %s, bound %s, %.3f s%s",
        backend,
        program.n_vars,
        data.count,
        solution.status,
        solution.objective,
        solution.bound,
        solution.runtime_s,
        " (interrupted)" if solution.interrupted else "",
    )
    return solution
