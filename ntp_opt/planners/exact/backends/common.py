"""What the backends share: the checked program data, options, raw answers and the final check.

:func:`prepare` normalises an :class:`~ntp_opt.planners.exact.program.IntProgram`
for the backends; :func:`finish` rounds, checks and packages a backend's
:class:`Raw` answer; :func:`options` checks the parameters of
:func:`~ntp_opt.planners.exact.backends.solve_program`, the entry point.

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
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import threading
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from ntp_opt.planners.exact.program import IntProgram, IntSolution
from ntp_opt.rules.tolerances import INT_BOUND_ABS_TOL, INT_BOUND_REL_TOL

__all__ = [
    "MAX_SEED",
    "BackendUnavailable",
    "Data",
    "Options",
    "Raw",
    "finish",
    "int_array",
    "int_param",
    "options",
    "prepare",
    "read_and_remove",
]

MAX_SEED = 2**31 - 1
"""Largest random seed accepted."""


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


@dataclass(frozen=True)
class Data:
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
class Options:
    time_limit: float | None
    threads: int
    seed: int
    log: bool
    gap: float
    cancel: threading.Event | None = None
    work_limit: float | None = None  # CP-SAT deterministic time; other backends ignore it


@dataclass
class Raw:
    """What a backend function reports, before rounding and checking."""

    status: str
    values: np.ndarray | None = None
    bound: float | None = None
    time_limit_hit: bool = False
    log: str | None = None
    interrupted: bool = False


def int_array(name: str, values: Any, n: int) -> np.ndarray:
    """``values`` as a 1-d ``int64`` array of length ``n``, or ValueError."""
    arr = np.asarray(values)
    if arr.ndim != 1 or len(arr) != n:
        raise ValueError(f"program.{name} must be a 1-d array of length {n}")
    if arr.dtype.kind in "iub":
        return arr.astype(np.int64)
    if arr.size and not np.array_equal(arr, np.rint(arr)):
        raise ValueError(f"program.{name} must hold integers")
    return np.rint(arr).astype(np.int64)


def prepare(program: IntProgram) -> tuple[Data, list[str]]:
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
    lb = int_array("lb", program.lb, n)
    ub = int_array("ub", program.ub, n)
    obj = int_array("obj", program.obj, n)
    hint = None
    if program.hint is not None:
        hint = np.clip(int_array("hint", program.hint, n), lb, ub)
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
    return Data(lb, ub, obj, hint, start, index, value, los, his), broken


def int_param(name: str, value: Any, lo: int, hi: int) -> int:
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


def options(
    *,
    time_limit: float | None,
    threads: int,
    seed: int,
    log: bool,
    gap: float,
    cancel: threading.Event | None,
    work_limit: float | None = None,
) -> Options:
    """The checked solve options (parameters as for ``solve_program``).

    Raises
    ------
    ValueError
        A time limit that is not a positive finite number, ``threads`` not in
        ``[1, 10000]``, ``seed`` not in ``[0, MAX_SEED]`` or ``gap`` not in
        ``[0, 1)``; a work limit that is not a positive finite number.
    """
    if work_limit is not None and not (work_limit > 0 and math.isfinite(work_limit)):
        raise ValueError(f"work_limit must be a positive number, not {work_limit!r}")
    if time_limit is not None and not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit must be a positive number of seconds, not {time_limit!r}")
    threads = int_param("threads", threads, 1, 10_000)
    seed = int_param("seed", seed, 0, MAX_SEED)
    if not (0.0 <= gap < 1.0):
        raise ValueError(f"gap must be in [0, 1), not {gap!r}")
    return Options(
        time_limit=None if time_limit is None else float(time_limit),
        threads=threads,
        seed=seed,
        log=log,
        gap=float(gap),
        cancel=cancel,
        work_limit=None if work_limit is None else float(work_limit),
    )


def finish(
    program: IntProgram, data: Data, backend: str, raw: Raw, opts: Options, runtime: float
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
        slack = (
            0.0
            if raw.bound == math.floor(raw.bound)
            else INT_BOUND_ABS_TOL + INT_BOUND_REL_TOL * abs(raw.bound)
        )
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


def read_and_remove(path: str | None) -> str | None:
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
