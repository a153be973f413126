"""Solve an :class:`~ntp_opt.milp.program.IntProgram` with CP-SAT, HiGHS or CBC.

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

import contextlib
import logging
import math
import operator
import os
import re
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from ntp_opt.model.control import restore_sigint
from ntp_opt.planners.exact.program import IntProgram, IntSolution

__all__ = ["BACKENDS", "BackendUnavailable", "available_backends", "solve_program"]

logger = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("cpsat", "highs", "cbc")
"""Backend names accepted by :func:`solve_program`, in order of preference."""

_PACKAGE = {"cpsat": "ortools", "highs": "highspy", "cbc": "pulp"}
_MAX_SEED = 2**31 - 1
_ABS_TOL, _REL_TOL = 1e-6, 1e-9  # slack when a floating-point bound is rounded down


class BackendUnavailable(ImportError):
    """The Python package (or executable) a backend needs is not installed.

    Parameters
    ----------
    backend
        The backend asked for.
    package
        What is missing (a package name, or a description of the executable).
    """

    def __init__(self, backend: str, package: str) -> None:
        super().__init__(
            f"backend {backend!r} needs {package}: pip install 'ntp-opt[{backend}]'",
            name=package,
        )
        self.backend = backend
        self.package = package


# --------------------------------------------------------------------------- loading


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")


def _load(backend: str) -> Any:
    """Import what ``backend`` needs and return it.

    Returns
    -------
    Any
        ``cp_model`` for ``"cpsat"``, the ``highspy`` module for ``"highs"``,
        a ``(pulp, solver_class)`` pair for ``"cbc"``.

    Raises
    ------
    BackendUnavailable
        The package, or the CBC executable, is missing.
    """
    _check_backend(backend)
    package = _PACKAGE[backend]
    try:
        if backend == "cpsat":
            from ortools.sat.python import cp_model

            return cp_model
        if backend == "highs":
            import highspy

            return highspy
        import pulp
    except ImportError as exc:
        raise BackendUnavailable(backend, package) from exc
    return pulp, _cbc_class(pulp)


def _cbc_class(pulp: Any) -> Any:
    """The PuLP CBC command class to use: the bundled binary, else ``cbc`` on PATH."""
    with warnings.catch_warnings():
        # PuLP 3.3 deprecates PULP_CBC_CMD in favour of COIN_CMD + pip install pulp[cbc].
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in ("PULP_CBC_CMD", "COIN_CMD"):
            cls = getattr(pulp, name, None)
            if cls is None:
                continue
            try:
                if cls(msg=False).available():
                    return cls
            except Exception:  # a broken solver class must not hide the other one
                continue
    raise BackendUnavailable("cbc", "pulp with a CBC executable")


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
            _load(backend)
        except BackendUnavailable:
            continue
        found.append(backend)
    return found


# --------------------------------------------------------------------------- model data


@dataclass(frozen=True)
class _Data:
    """The program checked and normalised for the backends.

    The rows form a row-wise sparse matrix: duplicate variables in a row are
    merged, zero coefficients dropped, and rows without variables or without
    sides left out (they were checked).
    """

    lb: np.ndarray  # int64
    ub: np.ndarray  # int64
    obj: np.ndarray  # int64
    hint: np.ndarray | None  # int64, clipped into the bounds
    start: np.ndarray  # int64, length m + 1
    index: np.ndarray  # int64, variable of each term
    value: np.ndarray  # int64, coefficient of each term
    lo: list[int | None]
    hi: list[int | None]

    @property
    def count(self) -> int:
        return len(self.lo)


@dataclass(frozen=True)
class _Options:
    time_limit: float | None
    threads: int
    seed: int
    log: bool
    gap: float
    cancel: threading.Event | None = None


@dataclass
class _Raw:
    """What a backend function reports, before rounding and checking."""

    status: str
    values: np.ndarray | None = None
    bound: float | None = None
    time_limit_hit: bool = False
    log: str | None = None
    interrupted: bool = False


def _int_array(name: str, values: Any, n: int) -> np.ndarray:
    """``values`` as a 1-d ``int64`` array of length ``n``, or ValueError."""
    arr = np.asarray(values)
    if arr.ndim != 1 or len(arr) != n:
        raise ValueError(f"program.{name} must be a 1-d array of length {n}")
    if arr.dtype.kind in "iub":
        return arr.astype(np.int64)
    if arr.size and not np.array_equal(arr, np.rint(arr)):
        raise ValueError(f"program.{name} must hold integers")
    return np.rint(arr).astype(np.int64)


def _prepare(program: IntProgram) -> tuple[_Data, list[str]]:
    """Check the program's shape and normalise it.

    Returns
    -------
    data
        What to hand to a backend.
    broken
        Names of bounds and rows that no solution can satisfy (``lb > ub``,
        ``lo > hi``, or an empty row whose range excludes 0).

    Raises
    ------
    ValueError
        Arrays of unequal length or not integral, a row with unequal ``var``
        and ``coef``, or a variable index out of range.
    """
    n = program.n_vars
    lb = _int_array("lb", program.lb, n)
    ub = _int_array("ub", program.ub, n)
    obj = _int_array("obj", program.obj, n)
    hint = None
    if program.hint is not None:
        hint = np.clip(_int_array("hint", program.hint, n), lb, ub)
    broken = [f"bound x{j}" for j in np.flatnonzero(lb > ub)]

    variables: list[tuple[int, ...]] = []
    coefs: list[tuple[int, ...]] = []
    los: list[int | None] = []
    his: list[int | None] = []
    for i, row in enumerate(program.rows):
        var, coef = row.var, row.coef
        if len(var) != len(coef):
            raise ValueError(f"row {i} ({row.name!r}) has {len(var)} variables, {len(coef)} coefs")
        name = row.name or f"row {i}"
        lo = None if row.lo is None else int(row.lo)
        hi = None if row.hi is None else int(row.hi)
        if lo is not None and hi is not None and lo > hi:
            broken.append(name)
            continue
        if len(set(var)) != len(var) or 0 in coef:
            merged: dict[int, int] = {}
            for v, c in zip(var, coef, strict=True):
                merged[int(v)] = merged.get(int(v), 0) + int(c)
            kept = [(v, c) for v, c in merged.items() if c != 0]
            var = tuple(v for v, _ in kept)
            coef = tuple(c for _, c in kept)
        if not var:
            if (lo is not None and lo > 0) or (hi is not None and hi < 0):
                broken.append(name)
            continue
        if lo is None and hi is None:
            continue
        variables.append(var)
        coefs.append(coef)
        los.append(lo)
        his.append(hi)

    lengths = np.fromiter(map(len, variables), dtype=np.int64, count=len(variables))
    start = np.zeros(len(variables) + 1, dtype=np.int64)
    np.cumsum(lengths, out=start[1:])
    nnz = int(start[-1])
    index = np.fromiter(chain.from_iterable(variables), dtype=np.int64, count=nnz)
    value = np.fromiter(chain.from_iterable(coefs), dtype=np.int64, count=nnz)
    if nnz and (index.min() < 0 or index.max() >= n):
        raise ValueError(f"a row refers to a variable outside 0..{n - 1}")
    return _Data(lb, ub, obj, hint, start, index, value, los, his), broken


# --------------------------------------------------------------------------- entry point


def _int_param(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` as a Python int in ``lo..hi``, or ValueError."""
    try:
        if isinstance(value, bool):
            raise TypeError
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, not {value!r}") from None
    if not lo <= result <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, not {value!r}")
    return result


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
    _check_backend(backend)
    if time_limit is not None and not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit must be a positive number of seconds, not {time_limit!r}")
    threads = _int_param("threads", threads, 1, 10_000)
    seed = _int_param("seed", seed, 0, _MAX_SEED)
    if not (0.0 <= gap < 1.0):
        raise ValueError(f"gap must be in [0, 1), not {gap!r}")
    opts = _Options(
        time_limit=None if time_limit is None else float(time_limit),
        threads=threads,
        seed=seed,
        log=log,
        gap=float(gap),
        cancel=cancel,
    )

    solver = _load(backend)
    t0 = time.perf_counter()
    data, broken = _prepare(program)
    if broken:
        raw = _Raw("infeasible", log=f"infeasible before solving: {', '.join(broken)}")
    elif program.n_vars == 0:
        raw = _Raw("optimal", values=np.zeros(0), bound=0.0, log="empty program")
    elif backend == "cpsat":
        raw = _solve_cpsat(solver, program, data, opts)
    elif backend == "highs":
        raw = _solve_highs(solver, data, opts)
    else:
        pulp, cbc_class = solver
        raw = _solve_cbc(pulp, cbc_class, data, opts)
    solution = _finish(program, data, backend, raw, opts, time.perf_counter() - t0)
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


def _finish(
    program: IntProgram, data: _Data, backend: str, raw: _Raw, opts: _Options, runtime: float
) -> IntSolution:
    """Round, check, fall back to a feasible hint, and package the answer."""
    status = raw.status
    x: np.ndarray | None = None
    objective: int | None = None
    if status in ("optimal", "feasible"):
        if raw.values is None:
            raise RuntimeError(f"backend {backend!r} reported {status} without a solution")
        x = np.rint(np.asarray(raw.values, dtype=np.float64)).astype(np.int64)
        bad = program.violated(x)
        if bad:
            more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
            why = ""
            if backend == "cbc" and x.size and int(np.abs(x).max()) >= 10**8:
                why = " (CBC writes values with 8 significant digits)"
            raise RuntimeError(
                f"backend {backend!r} returned a solution that, rounded to integers, "
                f"violates {', '.join(bad[:10])}{more}{why}"
            )
        objective = program.value(x)

    hint = data.hint
    if hint is not None and not program.violated(hint):
        if status == "infeasible":
            raise RuntimeError(f"backend {backend!r} reported infeasible, but the hint is feasible")
        value = program.value(hint)
        if objective is None or value > objective:
            x, objective = hint, value
            if status == "unknown":
                status = "feasible"

    bound: float | None = None
    if raw.bound is not None and math.isfinite(raw.bound) and status != "infeasible":
        # The objective is an integer, so its bound is too; the slack absorbs
        # floating-point tolerances of HiGHS and CBC (a larger bound stays valid).
        # An integral bound (CP-SAT always, HiGHS once it sees the objective is
        # integral) is used as it is.
        slack = 0.0 if raw.bound == math.floor(raw.bound) else _ABS_TOL + _REL_TOL * abs(raw.bound)
        bound = float(math.floor(raw.bound + slack))
        if objective is not None and bound < objective:
            bound = float(objective)
    elif status == "optimal" and opts.gap == 0.0 and objective is not None:
        bound = float(objective)

    return IntSolution(
        status=status,
        x=x,
        objective=objective,
        bound=bound,
        time_limit_hit=raw.time_limit_hit,
        runtime_s=runtime,
        log=raw.log if opts.log else None,
        interrupted=raw.interrupted,
    )


# --------------------------------------------------------------------------- CP-SAT


def _solve_cpsat(cp_model: Any, program: IntProgram, data: _Data, opts: _Options) -> _Raw:
    """Build and solve the program with OR-Tools CP-SAT."""
    weighted_sum = cp_model.LinearExpr.weighted_sum
    model = cp_model.CpModel()
    names = program.names if len(program.names) == program.n_vars else ("",) * program.n_vars
    xs = [
        model.new_int_var(lo, hi, name)
        for lo, hi, name in zip(data.lb.tolist(), data.ub.tolist(), names, strict=True)
    ]
    start = data.start.tolist()
    index = data.index.tolist()
    value = data.value.tolist()
    int_min, int_max = cp_model.INT_MIN, cp_model.INT_MAX
    for i in range(data.count):
        a, b = start[i], start[i + 1]
        lo, hi = data.lo[i], data.hi[i]
        model.add_linear_constraint(
            weighted_sum([xs[j] for j in index[a:b]], value[a:b]),
            int_min if lo is None else lo,
            int_max if hi is None else hi,
        )
    model.maximize(weighted_sum(xs, data.obj.tolist()))
    if data.hint is not None:
        for var, val in zip(xs, data.hint.tolist(), strict=True):
            model.add_hint(var, val)

    solver = cp_model.CpSolver()
    params = solver.parameters
    params.num_workers = opts.threads
    params.random_seed = opts.seed
    if opts.time_limit is not None:
        params.max_time_in_seconds = opts.time_limit
    if opts.gap > 0:
        params.relative_gap_limit = opts.gap
    params.fix_variables_to_their_hinted_value = False
    params.log_search_progress = opts.log
    params.log_to_stdout = False
    # ntp_opt handles Ctrl-C (ntp_opt.control): OR-Tools' own SIGINT handler
    # would leave SIGINT at its default action (process death) afterwards
    params.catch_sigint_signal = False
    lines: list[str] = []
    if opts.log:
        solver.log_callback = lines.append

    if opts.cancel is not None and opts.cancel.is_set():
        return _Raw("unknown", interrupted=True)
    previous = signal.getsignal(signal.SIGINT)
    with _stop_when_set(opts.cancel, solver.stop_search):
        try:
            code = solver.solve(model)
        finally:
            restore_sigint(previous)
    stopped = opts.cancel is not None and opts.cancel.is_set()
    log = "\n".join(lines) if opts.log else None
    if code == cp_model.MODEL_INVALID:
        raise RuntimeError(f"CP-SAT rejected the model: {model.validate() or 'no reason given'}")
    if code == cp_model.INFEASIBLE:
        return _Raw("infeasible", log=log)
    bound = float(solver.best_objective_bound)
    if code == cp_model.OPTIMAL:
        return _Raw("optimal", _cpsat_values(solver, xs), bound, log=log)
    # Only a time limit or a cancel stops the search short of FEASIBLE and UNKNOWN.
    hit = opts.time_limit is not None and not stopped
    if code == cp_model.FEASIBLE:
        values = _cpsat_values(solver, xs)
        return _Raw("feasible", values, bound, time_limit_hit=hit, log=log, interrupted=stopped)
    # No bound for UNKNOWN: stopped during presolve, CP-SAT reports best_bound 0,
    # which is no bound at all.
    return _Raw("unknown", time_limit_hit=hit, log=log, interrupted=stopped)


@contextlib.contextmanager
def _stop_when_set(cancel: threading.Event | None, stop: Any) -> Iterator[None]:
    """While inside, a watcher thread calls ``stop()`` once ``cancel`` is set."""
    if cancel is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if cancel.wait(0.05):
                stop()  # a no-op until the solve has started: repeat until done
                done.wait(0.05)

    watcher = threading.Thread(target=watch, name="ntp_opt-cancel", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _cpsat_values(solver: Any, xs: list[Any]) -> np.ndarray:
    """Variable values in creation order (variable ``j`` has proto index ``j``)."""
    solution = solver.response_proto.solution
    if len(solution) == len(xs):
        return np.asarray(list(solution), dtype=np.int64)
    return np.asarray([solver.value(x) for x in xs], dtype=np.int64)


# --------------------------------------------------------------------------- HiGHS

_HIGHS_LOCK = threading.Lock()
_HIGHS_INT_TOL, _HIGHS_MIN_TOL = 1e-6, 1e-10  # HiGHS's default and smallest integrality tol
_highs_banner_shown = False
_highs_threads: int | None = None


@contextlib.contextmanager
def _stdout_to_devnull() -> Iterator[None]:
    """Point file descriptor 1 at ``os.devnull`` (C-level output, not just ``sys.stdout``)."""
    if sys.stdout is not None:
        sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).fflush(None)  # flush C stdio while fd 1 is still devnull
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _new_highs(highspy: Any) -> Any:
    """A ``highspy.Highs``; the first one of the process is made without its stdout banner."""
    global _highs_banner_shown
    with _HIGHS_LOCK:
        if not _highs_banner_shown:
            _highs_banner_shown = True
            try:
                with _stdout_to_devnull():
                    return highspy.Highs()
            except OSError:  # no usable fd 1: accept the banner
                pass
    return highspy.Highs()


def _run_highs(highspy: Any, h: Any, threads: int) -> Any:
    """``h.run()``, resetting HiGHS's global scheduler if it was sized for other threads."""
    global _highs_threads
    with _HIGHS_LOCK:
        if _highs_threads is not None and _highs_threads != threads:
            highspy.Highs.resetGlobalScheduler(True)
        _highs_threads = threads
    status = h.run()
    if status == highspy.HighsStatus.kError and h.getModelStatus() in (
        highspy.HighsModelStatus.kNotset,
        highspy.HighsModelStatus.kSolveError,
    ):
        # Someone else in this process (e.g. PuLP) ran HiGHS with another thread count.
        highspy.Highs.resetGlobalScheduler(True)
        status = h.run()
    return status


def _highs_lp(highspy: Any, data: _Data) -> Any:
    """The program as a ``highspy.HighsLp`` (row-wise matrix, maximisation)."""
    inf = highspy.kHighsInf
    n = len(data.lb)
    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.num_row_ = data.count
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.col_cost_ = data.obj.astype(np.float64)
    lp.col_lower_ = data.lb.astype(np.float64)
    lp.col_upper_ = data.ub.astype(np.float64)
    lp.row_lower_ = np.array([-inf if v is None else float(v) for v in data.lo], dtype=np.float64)
    lp.row_upper_ = np.array([inf if v is None else float(v) for v in data.hi], dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = n
    lp.a_matrix_.num_row_ = data.count
    lp.a_matrix_.start_ = data.start.astype(np.int32)
    lp.a_matrix_.index_ = data.index.astype(np.int32)
    lp.a_matrix_.value_ = data.value.astype(np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    return lp


def _integrality_tolerance(data: _Data) -> float:
    """HiGHS ``mip_feasibility_tolerance`` small enough for rounding to be safe.

    HiGHS accepts ``x = 0.9999992`` as integral (tolerance 1e-6); with a
    coefficient of 3e7 rounding then moves the row activity by 24 and can
    break the row.  The tolerance is cut so that one variable moves a row by
    at most 0.01, within HiGHS's range ``[1e-10, 1e-6]``.
    """
    biggest = float(np.abs(data.value).max()) if data.value.size else 1.0
    return min(_HIGHS_INT_TOL, max(_HIGHS_MIN_TOL, 1e-2 / max(biggest, 1.0)))


def _rounding_breaks(data: _Data, values: np.ndarray) -> bool:
    """Whether ``values`` rounded to integers break a bound or a row (exact arithmetic)."""
    x = np.rint(values).astype(np.int64)
    if np.any((x < data.lb) | (x > data.ub)):
        return True
    if not data.count:
        return False
    activity = np.add.reduceat(data.value * x[data.index], data.start[:-1])
    lo = np.array([np.iinfo(np.int64).min if v is None else v for v in data.lo], dtype=np.int64)
    hi = np.array([np.iinfo(np.int64).max if v is None else v for v in data.hi], dtype=np.int64)
    return bool(np.any((activity < lo) | (activity > hi)))


def _solve_highs(highspy: Any, data: _Data, opts: _Options) -> _Raw:
    """Solve the program with highspy directly.

    If the solution, rounded, breaks a row although HiGHS found it feasible
    within its tolerances, solve once more with HiGHS's tightest integrality
    tolerance, in the time left.
    """
    lp = _highs_lp(highspy, data)
    t0 = time.perf_counter()
    tol = _integrality_tolerance(data)
    raw = _highs_attempt(highspy, lp, data, opts, tol, opts.time_limit)
    if raw.values is None or tol <= _HIGHS_MIN_TOL or not _rounding_breaks(data, raw.values):
        return raw
    left = None if opts.time_limit is None else opts.time_limit - (time.perf_counter() - t0)
    if left is not None and left <= 0.01:
        return raw  # no time for a retry; the caller's check raises
    again = _highs_attempt(highspy, lp, data, opts, _HIGHS_MIN_TOL, left)
    if opts.log:
        note = (
            f"\n--- rounded solution broke a row: solving again with tolerance {_HIGHS_MIN_TOL}\n"
        )
        again.log = (raw.log or "") + note + (again.log or "")
    if raw.bound is not None and (again.bound is None or raw.bound < again.bound):
        again.bound = raw.bound
    return again


def _highs_attempt(
    highspy: Any, lp: Any, data: _Data, opts: _Options, tol: float, time_limit: float | None
) -> _Raw:
    """One HiGHS run with integrality tolerance ``tol``."""
    h = _new_highs(highspy)
    log_path = None
    try:
        h.setOptionValue("output_flag", opts.log)
        if opts.log:
            fd, log_path = tempfile.mkstemp(prefix="ntp_opt_highs_", suffix=".log")
            os.close(fd)
            h.setOptionValue("log_to_console", False)
            h.setOptionValue("log_file", log_path)
        h.setOptionValue("threads", opts.threads)
        h.setOptionValue("random_seed", opts.seed)
        h.setOptionValue("mip_rel_gap", opts.gap)  # HiGHS's default is 1e-4, not 0
        h.setOptionValue("mip_feasibility_tolerance", tol)
        if time_limit is not None:
            h.setOptionValue("time_limit", time_limit)
        if h.passModel(lp) == highspy.HighsStatus.kError:
            raise RuntimeError("HiGHS rejected the model")
        if data.hint is not None:
            solution = highspy.HighsSolution()
            solution.col_value = data.hint.astype(np.float64).tolist()
            solution.value_valid = True
            h.setSolution(solution)

        cancel = opts.cancel
        if cancel is not None:

            def interrupt(event: Any) -> None:
                if cancel.is_set():
                    event.interrupt()

            for name in ("cbMipInterrupt", "cbSimplexInterrupt", "cbIpmInterrupt"):
                getattr(h, name).subscribe(interrupt)
        _run_highs(highspy, h, opts.threads)
        model_status = h.getModelStatus()
        info = h.getInfo()
        has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
        values = np.asarray(h.getSolution().col_value, dtype=np.float64) if has_solution else None
        bound = float(info.mip_dual_bound)
        if opts.log:
            h.setOptionValue("log_file", "")  # close the file before reading it
    finally:
        log = _read_and_remove(log_path)

    ms = highspy.HighsModelStatus
    if model_status == ms.kOptimal:
        return _Raw("optimal", values, bound, log=log)
    if model_status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return _Raw("infeasible", log=log)  # all variables are bounded: never unbounded
    stopped = {ms.kTimeLimit, ms.kInterrupt, ms.kIterationLimit, ms.kUnknown}
    for extra in ("kSolutionLimit", "kObjectiveBound", "kObjectiveTarget", "kMemoryLimit"):
        if hasattr(ms, extra):
            stopped.add(getattr(ms, extra))
    if model_status in stopped:
        hit = model_status == ms.kTimeLimit
        cut = model_status == ms.kInterrupt and opts.cancel is not None and opts.cancel.is_set()
        if values is not None:
            return _Raw("feasible", values, bound, time_limit_hit=hit, log=log, interrupted=cut)
        return _Raw("unknown", bound=bound, time_limit_hit=hit, log=log, interrupted=cut)
    raise RuntimeError(f"HiGHS failed: model status {h.modelStatusToString(model_status)!r}")


def _read_and_remove(path: str | None) -> str | None:
    """The text of the file at ``path`` (None if unreadable), then delete the file."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)


# --------------------------------------------------------------------------- CBC

_CBC_BOUND = re.compile(r"^Upper bound:\s+(\S+)", re.MULTILINE)
_CBC_TIME = re.compile(r"^Result - Stopped on time", re.MULTILINE)


def _solve_cbc(pulp: Any, cbc_class: Any, data: _Data, opts: _Options) -> _Raw:
    """Build the program with PuLP and solve it with the CBC executable."""
    prob = pulp.LpProblem("ntp_opt", pulp.LpMaximize)
    xs = [
        prob.add_variable(f"x{j}", lo, hi, pulp.LpInteger)
        for j, (lo, hi) in enumerate(zip(data.lb.tolist(), data.ub.tolist(), strict=True))
    ]
    # Every variable goes into the objective (zero coefficients too) so that
    # PuLP writes variables that appear in no row, with their bounds.
    prob.setObjective(pulp.LpAffineExpression(list(zip(xs, data.obj.tolist(), strict=True))))
    start = data.start.tolist()
    index = data.index.tolist()
    value = data.value.tolist()
    for i in range(data.count):
        a, b = start[i], start[i + 1]
        terms = [(xs[j], c) for j, c in zip(index[a:b], value[a:b], strict=True)]
        lo, hi = data.lo[i], data.hi[i]
        if lo is not None and lo == hi:
            sides = [(pulp.LpConstraintEQ, lo, f"r{i}")]
        else:
            sides = []
            if lo is not None:
                sides.append((pulp.LpConstraintGE, lo, f"r{i}_lo"))
            if hi is not None:
                sides.append((pulp.LpConstraintLE, hi, f"r{i}_hi"))
        for sense, rhs, name in sides:
            expr = pulp.LpAffineExpression(terms)
            prob.addConstraint(pulp.LpConstraint(expr, sense, name, rhs))
    hint = data.hint
    if hint is not None:
        for var, val in zip(xs, hint.tolist(), strict=True):
            var.setInitialValue(val, check=False)

    options = []
    if opts.seed != 0:  # CBC reads 0 as "seed from the clock"; keep its fixed defaults
        options += [f"randomSeed {opts.seed}", f"randomCbcSeed {opts.seed}"]
    fd, log_path = tempfile.mkstemp(prefix="ntp_opt_cbc_", suffix=".log")
    os.close(fd)
    failure: Exception | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = cbc_class(
                msg=False,
                timeLimit=opts.time_limit,
                gapRel=opts.gap if opts.gap > 0 else None,
                threads=100 + opts.threads if opts.threads > 1 else None,
                warmStart=hint is not None,
                logPath=log_path,
                options=options,
            )
            prob.solve(solver)
    except pulp.PulpError as exc:  # PulpSolverError too: CBC crashed or wrote no solution
        failure = exc
    finally:
        text = _read_and_remove(log_path) or ""
    if failure is not None and opts.cancel is not None and opts.cancel.is_set():
        return _Raw("unknown", log=text if opts.log else None, interrupted=True)
    if failure is not None:
        tail = "\n".join(text.splitlines()[-20:])
        raise RuntimeError(f"CBC failed: {failure}\n{tail}") from failure

    match = _CBC_BOUND.search(text)
    bound = float(match.group(1)) if match else None
    hit = opts.time_limit is not None and _CBC_TIME.search(text) is not None
    log = text if opts.log else None
    # PuLP issue #711: a time-limited run can come back with prob.status == 1
    # ("Optimal") for a merely integer-feasible point, so read sol_status.
    if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        values = np.array(
            [np.nan if v.varValue is None else v.varValue for v in xs], dtype=np.float64
        )
        if np.isnan(values).any():
            raise RuntimeError("CBC reported a solution but PuLP read no value for some variables")
        proved = prob.sol_status == pulp.LpSolutionOptimal and not hit
        return _Raw("optimal" if proved else "feasible", values, bound, hit, log)
    if prob.status == pulp.LpStatusInfeasible:
        return _Raw("infeasible", log=log)
    if prob.status == pulp.LpStatusUnbounded:
        raise RuntimeError("CBC reported the program unbounded, but every variable is bounded")
    return _Raw("unknown", bound=bound, time_limit_hit=hit, log=log)
