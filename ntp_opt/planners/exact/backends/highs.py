"""The HiGHS backend, through its own binding ``highspy`` (extra ``ntp-opt[highs]``).

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
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from ntp_opt.planners.exact.backends.base import SolverBackend
from ntp_opt.planners.exact.backends.common import (
    MAX_SEED,
    BackendUnavailable,
    Data,
    Options,
    Raw,
    prepare,
    read_and_remove,
)
from ntp_opt.planners.exact.program import IntProgram
from ntp_opt.rules.tolerances import HIGHS_INT_TOL, HIGHS_MIN_INT_TOL, ROUNDING_SHIFT

__all__ = [
    "HighsBackend",
    "HighsLP",
    "highs_attempt",
    "highs_lp",
    "integrality_tolerance",
    "load",
    "new_highs",
    "rounding_breaks",
    "solve_highs",
]

_HIGHS_LOCK = threading.Lock()
_highs_banner_shown = False
highs_threads: int | None = None
"""Thread count HiGHS's global scheduler was last sized for (None: unknown)."""


def load() -> Any:
    """Import ``highspy``.

    Returns
    -------
    Any
        The ``highspy`` module.

    Raises
    ------
    BackendUnavailable
        ``highspy`` is not installed.
    """
    try:
        import highspy
    except ImportError as exc:
        raise BackendUnavailable("highs", "highspy") from exc
    return highspy


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


def new_highs(highspy: Any) -> Any:
    """A ``highspy.Highs`` object; the first one of the process is made without the
    banner HiGHS prints to standard output.

    Parameters
    ----------
    highspy
        The module, from :func:`load`.

    Returns
    -------
    Any
        A new ``highspy.Highs``.
    """
    return _new_highs(highspy)


def _run_highs(highspy: Any, h: Any, threads: int) -> Any:
    """``h.run()``, resetting HiGHS's global scheduler if it was sized for other threads."""
    global highs_threads
    with _HIGHS_LOCK:
        if highs_threads is not None and highs_threads != threads:
            highspy.Highs.resetGlobalScheduler(True)
        highs_threads = threads
    status = h.run()
    if status == highspy.HighsStatus.kError and h.getModelStatus() in (
        highspy.HighsModelStatus.kNotset,
        highspy.HighsModelStatus.kSolveError,
    ):
        # Someone else in this process (e.g. PuLP) ran HiGHS with another thread count.
        highspy.Highs.resetGlobalScheduler(True)
        status = h.run()
    return status


def highs_lp(highspy: Any, data: Data) -> Any:
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


def integrality_tolerance(data: Data) -> float:
    """HiGHS ``mip_feasibility_tolerance`` small enough for rounding to be safe.

    HiGHS accepts ``x = 0.9999992`` as integral (tolerance 1e-6); with a
    coefficient of 3e7 rounding then moves the row activity by 24 and can
    break the row.  The tolerance is cut so that one variable moves a row by
    at most 0.01, within HiGHS's range ``[1e-10, 1e-6]``.
    """
    biggest = float(np.abs(data.value).max()) if data.value.size else 1.0
    return min(HIGHS_INT_TOL, max(HIGHS_MIN_INT_TOL, ROUNDING_SHIFT / max(biggest, 1.0)))


def rounding_breaks(data: Data, values: np.ndarray) -> bool:
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


def solve_highs(highspy: Any, data: Data, opts: Options) -> Raw:
    """Solve the program with highspy directly.

    If the solution, rounded, breaks a row although HiGHS found it feasible
    within its tolerances, solve once more with HiGHS's tightest integrality
    tolerance, in the time left.
    """
    lp = highs_lp(highspy, data)
    t0 = time.perf_counter()
    tol = integrality_tolerance(data)
    try:
        raw = highs_attempt(highspy, lp, data, opts, tol, opts.time_limit)
    except RuntimeError:
        # HiGHS's own failure ("Solve error") on a sound program can depend on its
        # random seed (a 15-variable multi-workload program failed with seed 0 only):
        # once more with the next seed, in the time left
        left = None if opts.time_limit is None else opts.time_limit - (time.perf_counter() - t0)
        if left is not None and left <= 0.01:
            raise
        opts = replace(opts, seed=(opts.seed + 1) % (MAX_SEED + 1))
        raw = highs_attempt(highspy, lp, data, opts, tol, left)
    if raw.values is None or tol <= HIGHS_MIN_INT_TOL or not rounding_breaks(data, raw.values):
        return raw
    left = None if opts.time_limit is None else opts.time_limit - (time.perf_counter() - t0)
    if left is not None and left <= 0.01:
        return raw  # no time for a retry; the caller's check raises
    again = highs_attempt(highspy, lp, data, opts, HIGHS_MIN_INT_TOL, left)
    if opts.log:
        note = "\n--- rounded solution broke a row: solving again with tolerance "
        note += f"{HIGHS_MIN_INT_TOL}\n"
        again.log = (raw.log or "") + note + (again.log or "")
    if raw.bound is not None and (again.bound is None or raw.bound < again.bound):
        again.bound = raw.bound
    return again


def highs_attempt(
    highspy: Any, lp: Any, data: Data, opts: Options, tol: float, time_limit: float | None
) -> Raw:
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
            interrupt = _Interrupt(cancel)
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
        log = read_and_remove(log_path)

    ms = highspy.HighsModelStatus
    if model_status == ms.kOptimal:
        return Raw("optimal", values, bound, log=log)
    if model_status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return Raw("infeasible", log=log)  # all variables are bounded: never unbounded
    stopped = {ms.kTimeLimit, ms.kInterrupt, ms.kIterationLimit, ms.kUnknown}
    for extra in ("kSolutionLimit", "kObjectiveBound", "kObjectiveTarget", "kMemoryLimit"):
        if hasattr(ms, extra):
            stopped.add(getattr(ms, extra))
    if model_status in stopped:
        hit = model_status == ms.kTimeLimit
        cut = model_status == ms.kInterrupt and opts.cancel is not None and opts.cancel.is_set()
        if values is not None:
            return Raw("feasible", values, bound, time_limit_hit=hit, log=log, interrupted=cut)
        return Raw("unknown", bound=bound, time_limit_hit=hit, log=log, interrupted=cut)
    raise RuntimeError(f"HiGHS failed: model status {h.modelStatusToString(model_status)!r}")


class _Interrupt:
    """A HiGHS interrupt callback: stops the solve once ``cancel`` is set."""

    def __init__(self, cancel: threading.Event) -> None:
        self.cancel = cancel

    def __call__(self, event: Any) -> None:
        """Interrupt HiGHS at this callback if the token is set."""
        if self.cancel.is_set():
            event.interrupt()


class HighsBackend(SolverBackend):
    """HiGHS through ``highspy``; it also bounds programs by their relaxation."""

    name = "highs"
    extra = "highs"

    def load(self) -> Any:
        """The ``highspy`` module (:func:`load`)."""
        return load()

    def run(self, solver: Any, program: IntProgram, data: Data, opts: Options) -> Raw:
        """:func:`solve_highs`."""
        return solve_highs(solver, data, opts)

    def relax(
        self,
        program: IntProgram,
        threads: int = 1,
        *,
        integer_from: int | None = None,
        node_limit: int | None = None,
        time_limit: float | None = None,
    ) -> float | None:
        """The optimum of a relaxation of ``program``, or ``None`` when ``highspy``
        is missing or the relaxation is not solved.

        Parameters
        ----------
        program
            A maximisation with integer variables.
        threads
            HiGHS threads.
        integer_from
            First variable kept integer (``None``: every variable continuous,
            the LP relaxation).
        node_limit
            Branch-and-bound nodes for a mixed program; at the limit its
            proven (dual) bound is returned.
        time_limit
            Seconds for a mixed program; likewise.

        Returns
        -------
        float or None
            An upper bound on the program's integer optimum, up to solver tolerances.
        """
        try:
            highspy = load()
        except BackendUnavailable:
            return None
        data, broken = prepare(program)
        if broken:
            return None
        lp = highs_lp(highspy, data)
        n = len(data.lb)
        first = n if integer_from is None else max(0, min(n, integer_from))
        continuous, integer = highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger
        lp.integrality_ = [continuous] * first + [integer] * (n - first)
        h = new_highs(highspy)
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", threads)
        if first < n:
            # the objective is integral on the integer variables: a gap below 1 decides it
            h.setOptionValue("mip_rel_gap", 0.0)
            h.setOptionValue("mip_abs_gap", 1.0 - 1e-3)
            if node_limit is not None:
                h.setOptionValue("mip_max_nodes", node_limit)
            if time_limit is not None:
                h.setOptionValue("time_limit", max(0.01, time_limit))
        h.passModel(lp)
        h.run()
        status = h.getModelStatus()
        info = h.getInfo()
        if first == n:
            if status != highspy.HighsModelStatus.kOptimal:
                return None
            return float(info.objective_function_value)
        # a mixed program: its dual bound, once proven (a solve error, e.g. a solution
        # refused for a row violated by 1e-5, gives none)
        stopped = (highspy.HighsModelStatus.kSolutionLimit, highspy.HighsModelStatus.kTimeLimit)
        if status != highspy.HighsModelStatus.kOptimal and status not in stopped:
            return None
        bound = float(info.mip_dual_bound)
        return bound if math.isfinite(bound) else None


class HighsLP:
    """A maximisation LP built and re-solved incrementally with HiGHS (column generation).

    Rows are added once, with empty columns; columns are added one at a time
    with their sparse entries; row bounds may change between solves.

    Parameters
    ----------
    lo, hi
        Bounds of the rows (``-inf``/``inf`` for none: :attr:`inf`).
    threads, seed
        HiGHS's ``threads`` and ``random_seed``.

    Raises
    ------
    BackendUnavailable
        ``highspy`` is missing (the message names the extra ``highs``).
    """

    def __init__(self, lo: list[float], hi: list[float], *, threads: int, seed: int) -> None:
        highspy = load()
        self._highspy = highspy
        self.inf = float(highspy.kHighsInf)
        h = new_highs(highspy)
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", threads)
        h.setOptionValue("random_seed", seed)
        h.changeObjectiveSense(highspy.ObjSense.kMaximize)
        n_rows = len(lo)
        h.addRows(
            n_rows,
            np.array(lo),
            np.array(hi),
            0,
            np.zeros(n_rows + 1, dtype=np.int32)[:n_rows],
            np.zeros(0, dtype=np.int32),
            np.zeros(0),
        )
        self._h = h

    def add_col(
        self, cost: float, lo: float, hi: float, rows: np.ndarray, values: np.ndarray
    ) -> None:
        """Add a column: objective ``cost``, bounds ``lo..hi``, ``values`` in ``rows``."""
        idx = np.asarray(rows, dtype=np.int32)
        self._h.addCol(cost, lo, hi, len(idx), idx, np.asarray(values, dtype=np.float64))

    def set_row_bounds(self, row: int, lo: float, hi: float) -> None:
        """Change the bounds of ``row``."""
        self._h.changeRowBounds(row, lo, hi)

    def solve(self) -> str:
        """Solve; ``"optimal"``, ``"infeasible"`` or HiGHS's own words for another status."""
        h, status_enum = self._h, self._highspy.HighsModelStatus
        h.run()
        status = h.getModelStatus()
        if status == status_enum.kOptimal:
            return "optimal"
        if status == status_enum.kInfeasible:
            return "infeasible"
        return str(h.modelStatusToString(status))

    def objective(self) -> float:
        """The last solve's objective value."""
        return float(self._h.getInfo().objective_function_value)

    def row_duals(self) -> np.ndarray:
        """The last solve's row duals."""
        return np.asarray(self._h.getSolution().row_dual, dtype=np.float64)

    def col_values(self) -> np.ndarray:
        """The last solve's column values."""
        return np.asarray(self._h.getSolution().col_value, dtype=np.float64)
