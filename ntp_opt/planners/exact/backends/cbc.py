"""The CBC backend, through PuLP (package ``pulp``, extra ``ntp-opt[cbc]``).

CBC limitations
---------------
* CBC checks its time limit only once branch-and-bound runs: the root LP
  relaxation is solved to the end whatever the limit (a random program with
  2,000 rows, 20,000 columns and 10^5 terms took 70 s under a 1 s limit).
* The CBC solution file, which PuLP reads, prints values with 8 significant
  digits, so variables of magnitude 10^8 or more come back inexact; the
  feasibility check then raises :class:`RuntimeError`.
* The bound is read from CBC's log ("Upper bound:"), printed with 3 decimals.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from typing import Any

import numpy as np

from ntp_opt.planners.exact.backends.base import SolverBackend
from ntp_opt.planners.exact.backends.common import (
    BackendUnavailable,
    Data,
    Options,
    Raw,
    read_and_remove,
)
from ntp_opt.planners.exact.program import IntProgram

__all__ = ["CbcBackend", "cbc_class", "load", "solve_cbc"]


def load() -> tuple[Any, Any]:
    """Import PuLP and find a CBC executable.

    Returns
    -------
    tuple[Any, Any]
        The ``pulp`` module and the PuLP solver class to run CBC with.

    Raises
    ------
    BackendUnavailable
        ``pulp`` is not installed, or no CBC executable is found.
    """
    try:
        import pulp
    except ImportError as exc:
        raise BackendUnavailable("cbc", "pulp") from exc
    return pulp, cbc_class(pulp)


def cbc_class(pulp: Any) -> Any:
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


_CBC_BOUND = re.compile(r"^Upper bound:\s+(\S+)", re.MULTILINE)
_CBC_TIME = re.compile(r"^Result - Stopped on time", re.MULTILINE)


def solve_cbc(pulp: Any, cbc_class: Any, data: Data, opts: Options) -> Raw:
    """Build the program with PuLP and solve it with the CBC executable."""
    prob, xs = _build(pulp, data)
    hint = data.hint
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
        text = read_and_remove(log_path) or ""
    if failure is not None and opts.cancel is not None and opts.cancel.is_set():
        return Raw("unknown", log=text if opts.log else None, interrupted=True)
    if failure is not None:
        tail = "\n".join(text.splitlines()[-20:])
        raise RuntimeError(f"CBC failed: {failure}\n{tail}") from failure
    return _read(pulp, prob, xs, text, opts)


def _build(pulp: Any, data: Data) -> tuple[Any, list[Any]]:
    """The PuLP problem of ``data`` and its variables (with the hint as initial values)."""
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
    return prob, xs


def _read(pulp: Any, prob: Any, xs: list[Any], text: str, opts: Options) -> Raw:
    """CBC's answer from the solved problem and its log."""
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
        return Raw("optimal" if proved else "feasible", values, bound, hit, log)
    if prob.status == pulp.LpStatusInfeasible:
        return Raw("infeasible", log=log)
    if prob.status == pulp.LpStatusUnbounded:
        raise RuntimeError("CBC reported the program unbounded, but every variable is bounded")
    return Raw("unknown", bound=bound, time_limit_hit=hit, log=log)


class CbcBackend(SolverBackend):
    """COIN-OR CBC through PuLP (the bundled executable, else ``cbc`` on PATH)."""

    name = "cbc"
    extra = "cbc"

    def load(self) -> tuple[Any, Any]:
        """The ``pulp`` module and the CBC command class (:func:`load`)."""
        return load()

    def run(self, solver: Any, program: IntProgram, data: Data, opts: Options) -> Raw:
        """:func:`solve_cbc`."""
        pulp, cbc_command = solver
        return solve_cbc(pulp, cbc_command, data, opts)
