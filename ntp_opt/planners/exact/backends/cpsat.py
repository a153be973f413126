"""The CP-SAT backend (OR-Tools, package ``ortools``, extra ``ntp-opt[cpsat]``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ntp_opt.model.control import restore_sigint
from ntp_opt.planners.exact.backends.base import SolverBackend
from ntp_opt.planners.exact.backends.common import BackendUnavailable, Data, Options, Raw
from ntp_opt.planners.exact.program import IntProgram

__all__ = ["CpSatBackend", "load", "solve_cpsat"]


def load() -> Any:
    """Import OR-Tools CP-SAT.

    Returns
    -------
    Any
        The ``ortools.sat.python.cp_model`` module.

    Raises
    ------
    BackendUnavailable
        ``ortools`` is not installed.
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError as exc:
        raise BackendUnavailable("cpsat", "ortools") from exc
    return cp_model


def solve_cpsat(cp_model: Any, program: IntProgram, data: Data, opts: Options) -> Raw:
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
    if opts.work_limit is not None:
        params.max_deterministic_time = opts.work_limit
    if opts.gap > 0:
        params.relative_gap_limit = opts.gap
    params.fix_variables_to_their_hinted_value = False
    params.log_search_progress = opts.log
    params.log_to_stdout = False
    # ntp_opt handles Ctrl-C (ntp_opt.model.control): OR-Tools' own SIGINT handler
    # would leave SIGINT at its default action (process death) afterwards
    params.catch_sigint_signal = False
    lines: list[str] = []
    if opts.log:
        solver.log_callback = lines.append

    if opts.cancel is not None and opts.cancel.is_set():
        return Raw("unknown", interrupted=True)
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
        return Raw("infeasible", log=log)
    bound = float(solver.best_objective_bound)
    if code == cp_model.OPTIMAL:
        return Raw("optimal", _cpsat_values(solver, xs), bound, log=log)
    # Only a time or work limit or a cancel stops the search short of FEASIBLE and UNKNOWN.
    hit = (opts.time_limit is not None or opts.work_limit is not None) and not stopped
    if code == cp_model.FEASIBLE:
        values = _cpsat_values(solver, xs)
        return Raw("feasible", values, bound, time_limit_hit=hit, log=log, interrupted=stopped)
    # No bound for UNKNOWN: stopped during presolve, CP-SAT reports best_bound 0,
    # which is no bound at all.
    return Raw("unknown", time_limit_hit=hit, log=log, interrupted=stopped)


def _watch(cancel: threading.Event, stop: Any, done: threading.Event) -> None:
    """Call ``stop()`` while ``cancel`` is set, until ``done`` is."""
    # polls ``cancel`` while waiting on ``done``, so that leaving the block
    # wakes the watcher at once (waiting on ``cancel`` instead kept every
    # solve waiting up to one poll interval for the join below)
    while True:
        if cancel.is_set():
            stop()  # a no-op until the solve has started: repeat until done
        if done.wait(0.05):
            return


@contextlib.contextmanager
def _stop_when_set(cancel: threading.Event | None, stop: Any) -> Iterator[None]:
    """While inside, a watcher thread calls ``stop()`` once ``cancel`` is set."""
    if cancel is None:
        yield
        return
    done = threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(cancel, stop, done), name="ntp_opt-cancel", daemon=True
    )
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


class CpSatBackend(SolverBackend):
    """OR-Tools CP-SAT, built through ``cp_model.CpModel``."""

    name = "cpsat"
    extra = "cpsat"
    has_work_limit = True  # max_deterministic_time

    def load(self) -> Any:
        """The ``cp_model`` module (:func:`load`)."""
        return load()

    def run(self, solver: Any, program: IntProgram, data: Data, opts: Options) -> Raw:
        """:func:`solve_cpsat`."""
        return solve_cpsat(solver, program, data, opts)
