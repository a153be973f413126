"""ntp_opt.planners.exact.backends against brute-force enumeration, on every installed backend."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from ntp_opt.planners.exact.backends import (
    BACKENDS,
    Backend,
    BackendUnavailable,
    RelaxingBackend,
    available_backends,
    common,
    cpsat,
    get_backend,
    highs,
    register,
    solve_program,
)
from ntp_opt.planners.exact.program import IntProgram, Row

AVAILABLE = available_backends()
backend = pytest.mark.parametrize("backend", AVAILABLE)


# --------------------------------------------------------------------------- programs


def program(lb, ub, obj, rows, hint=None) -> IntProgram:
    return IntProgram(
        lb=np.asarray(lb, dtype=np.int64),
        ub=np.asarray(ub, dtype=np.int64),
        obj=np.asarray(obj, dtype=np.int64),
        rows=tuple(rows),
        hint=None if hint is None else np.asarray(hint, dtype=np.int64),
    )


def brute_force(p: IntProgram) -> int | None:
    """The optimum by enumerating every integer point in the bounds (None: infeasible)."""
    ranges = [range(lo, hi + 1) for lo, hi in zip(p.lb.tolist(), p.ub.tolist(), strict=True)]
    points = np.array(list(itertools.product(*ranges)), dtype=np.int64).reshape(-1, p.n_vars)
    ok = np.ones(len(points), dtype=bool)
    for row in p.rows:
        s = np.zeros(len(points), dtype=np.int64)
        for v, c in zip(row.var, row.coef, strict=True):
            s += c * points[:, v]
        if row.lo is not None:
            ok &= s >= row.lo
        if row.hi is not None:
            ok &= s <= row.hi
    if not ok.any():
        return None
    return int((points[ok] @ p.obj).max())


def random_knapsack(rng: np.random.Generator, n: int = 10) -> IntProgram:
    w = rng.integers(1, 30, n)
    v = rng.integers(1, 30, n)
    cap = int(w.sum() // 2)
    return program([0] * n, [1] * n, v, [Row(tuple(range(n)), tuple(w.tolist()), None, cap, "cap")])


def random_assignment(rng: np.random.Generator, k: int = 3) -> IntProgram:
    """x[i, j] = 1 when worker i does job j; each worker and each job exactly once."""
    idx = [[i * k + j for j in range(k)] for i in range(k)]
    rows = [Row(tuple(idx[i]), (1,) * k, 1, 1, f"worker{i}") for i in range(k)]
    rows += [Row(tuple(idx[i][j] for i in range(k)), (1,) * k, 1, 1, f"job{j}") for j in range(k)]
    return program([0] * k * k, [1] * k * k, rng.integers(-10, 20, k * k), rows)


def random_general(rng: np.random.Generator) -> IntProgram:
    """Small general-integer program: negative bounds, duplicate variables in a row,
    zero coefficients, ranged and equality rows, a variable in no row."""
    n = int(rng.integers(3, 6))
    lb = rng.integers(-2, 1, n)
    ub = lb + rng.integers(0, 4, n)
    point = rng.integers(lb, ub + 1)  # keeps most rows satisfiable
    rows = []
    for i in range(int(rng.integers(1, 4))):
        k = int(rng.integers(1, n + 1))
        var = rng.integers(0, n - 1, k)  # x[n-1] is in no row; duplicates allowed
        coef = rng.integers(-4, 6, k)
        at = int(coef @ point[var])
        kind = i % 3
        lo, hi = (at - 2, at + 1) if kind == 0 else (at, at) if kind == 1 else (None, at + 1)
        rows.append(Row(tuple(var.tolist()), tuple(coef.tolist()), lo, hi, f"r{i}"))
    return program(lb, ub, rng.integers(-5, 10, n), rows)


def hard_knapsack(n: int = 80, m: int = 8) -> IntProgram:
    """A multi-dimensional knapsack no backend proves optimal within seconds."""
    rng = np.random.default_rng(1)
    w = rng.integers(10, 100, (m, n))
    cap = w.sum(axis=1) // 2
    value = w.sum(axis=0) // m + rng.integers(0, 10, n)
    rows = [
        Row(tuple(range(n)), tuple(w[i].tolist()), None, int(cap[i]), f"c{i}") for i in range(m)
    ]
    return program([0] * n, [1] * n, value, rows)


def greedy(p: IntProgram) -> np.ndarray:
    """A feasible 0/1 point of a <=-constrained knapsack, most valuable items first."""
    x = np.zeros(p.n_vars, dtype=np.int64)
    for j in np.argsort(-p.obj, kind="stable"):
        x[j] = 1
        if p.violated(x):
            x[j] = 0
    return x


# --------------------------------------------------------------------------- module


def test_available_backends():
    # A missing backend is skipped by the tests below, not failed.
    assert AVAILABLE == [b for b in BACKENDS if b in AVAILABLE]
    assert AVAILABLE, "no backend installed"


def test_unknown_backend():
    with pytest.raises(ValueError, match="cpsat, highs, cbc"):
        solve_program(random_knapsack(np.random.default_rng(0)), "gurobi")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"time_limit": 0},
        {"time_limit": -1.0},
        {"threads": 0},
        {"seed": -1},
        {"gap": 1.5},
        {"work_limit": 0.0},
        {"work_limit": float("inf")},
    ],
)
def test_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        solve_program(random_knapsack(np.random.default_rng(0)), **kwargs)


def test_import_is_lazy_and_quiet():
    # In a fresh interpreter: importing the module imports no solver package,
    # and solving with HiGHS prints nothing (not even HiGHS's banner).
    code = """
import sys
import ntp_opt.planners.exact.backends as b
print([m for m in ("ortools", "pulp", "highspy") if m in sys.modules])
if "highs" in b.available_backends():
    import numpy as np
    from ntp_opt.planners.exact.program import IntProgram, Row
    one = np.ones(2, np.int64)
    p = IntProgram(0 * one, one, one, (Row((0, 1), (1, 1), None, 1),))
    s = b.solve_program(p, "highs")
    assert s.status == "optimal" and s.objective == 1, s
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n"


def test_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "highspy", None)  # makes `import highspy` fail
    with pytest.raises(BackendUnavailable, match=r"needs highspy: pip install 'ntp-opt\[highs\]'"):
        solve_program(random_knapsack(np.random.default_rng(0)), "highs")
    assert "highs" not in available_backends()
    assert issubclass(BackendUnavailable, ImportError)


def test_registry_holds_every_backend_once_in_order_of_preference():
    assert BACKENDS == ("cpsat", "highs", "cbc")
    for name, extra in (("cpsat", "cpsat"), ("highs", "highs"), ("cbc", "cbc")):
        found = get_backend(name)
        assert isinstance(found, Backend)
        assert (found.name, found.extra) == (name, extra)
    # only HiGHS bounds a program by its relaxation
    assert [b for b in BACKENDS if isinstance(get_backend(b), RelaxingBackend)] == ["highs"]
    # only CP-SAT has a deterministic work limit (solve_or_highs hands over past it)
    assert [b for b in BACKENDS if get_backend(b).has_work_limit] == ["cpsat"]
    known = "unknown backend 'gurobi'; known backends: cpsat, highs, cbc"
    with pytest.raises(ValueError, match=known):
        get_backend("gurobi")
    with pytest.raises(ValueError, match="registered already"):
        register(get_backend("cbc"))
    assert BACKENDS == ("cpsat", "highs", "cbc")


def test_missing_pulp_names_the_extra_for_the_malleus_program(monkeypatch):
    from ntp_opt.planners import peers

    monkeypatch.setitem(sys.modules, "pulp", None)  # makes `import pulp` fail
    with pytest.raises(BackendUnavailable, match=r"needs pulp: pip install 'ntp-opt\[cbc\]'"):
        peers.malleus_split([1.0, 2.0], 3)
    assert "cbc" not in available_backends()


def test_infeasible_answer_is_never_returned(monkeypatch):
    p = random_knapsack(np.random.default_rng(0))
    bogus = common.Raw("optimal", values=np.ones(p.n_vars))  # breaks the capacity
    monkeypatch.setattr(cpsat, "solve_cpsat", lambda *args: bogus)
    with pytest.raises(RuntimeError, match="violates cap"):
        solve_program(p, "cpsat")


# --------------------------------------------------------------------------- every backend


@backend
def test_knapsack_and_assignment_optima(backend):
    rng = np.random.default_rng(2024)
    for p in [random_knapsack(rng) for _ in range(3)] + [random_assignment(rng) for _ in range(2)]:
        s = solve_program(p, backend)
        assert s.status == "optimal"
        assert s.objective == brute_force(p)
        assert s.x is not None and s.x.dtype == np.int64 and s.x.shape == (p.n_vars,)
        assert not p.violated(s.x)
        assert p.value(s.x) == s.objective
        assert s.bound == s.objective
        assert not s.time_limit_hit
        assert s.log is None


@backend
def test_general_programs(backend):
    rng = np.random.default_rng(7)
    for _ in range(6):
        p = random_general(rng)
        s = solve_program(p, backend)
        best = brute_force(p)
        if best is None:
            assert s.status == "infeasible" and s.x is None and s.objective is None
        else:
            assert s.status == "optimal", p
            assert s.objective == best
            assert s.x is not None and not p.violated(s.x)


@backend
def test_infeasible(backend):
    # x0 + x1 >= 3 with binaries: only the backend can tell.
    p = program([0, 0], [1, 1], [1, 1], [Row((0, 1), (1, 1), 3, None, "too much")])
    s = solve_program(p, backend)
    assert s.status == "infeasible"
    assert s.x is None and s.objective is None and s.bound is None
    # lb > ub is caught before the backend.
    q = program([0, 2], [1, 1], [1, 1], [])
    assert solve_program(q, backend).status == "infeasible"


@backend
def test_hint(backend):
    p = hard_knapsack(n=14, m=3)
    hint = greedy(p)
    assert not p.violated(hint)
    hinted = IntProgram(p.lb, p.ub, p.obj, p.rows, hint=hint)
    s = solve_program(hinted, backend)
    assert s.status == "optimal"
    optimum = brute_force(p)
    assert optimum is not None and s.objective == optimum >= p.value(hint)


@backend
def test_time_limit(backend):
    p = hard_knapsack()
    s = solve_program(p, backend, time_limit=0.2)
    assert s.status in ("feasible", "unknown")
    assert s.time_limit_hit
    assert s.runtime_s < 0.2 + 30.0  # a margin for a loaded machine, no speed test
    if s.x is not None:
        assert not p.violated(s.x)
    if s.bound is not None and s.objective is not None:
        assert s.bound >= s.objective
    # A hint is never lost, even when the limit stops the search.
    hint = greedy(p)
    t = solve_program(IntProgram(p.lb, p.ub, p.obj, p.rows, hint=hint), backend, time_limit=0.2)
    assert t.status == "feasible" and t.time_limit_hit
    assert t.objective is not None and t.objective >= p.value(hint)
    assert t.bound is None or t.bound >= t.objective


def test_cpsat_work_limit_is_deterministic():
    # CP-SAT's deterministic time limit stops the hard knapsack like a time limit,
    # at the same point on any load: two runs give the same solution
    pytest.importorskip("ortools")
    p = hard_knapsack()
    a = solve_program(p, "cpsat", work_limit=0.05)
    b = solve_program(p, "cpsat", work_limit=0.05)
    assert a.status in ("feasible", "unknown") and a.time_limit_hit
    assert a.status == b.status and a.objective == b.objective
    if a.x is not None:
        assert b.x is not None and (a.x == b.x).all()
        assert not p.violated(a.x)
    # the other backends ignore it
    if "highs" in AVAILABLE:
        small = random_knapsack(np.random.default_rng(3))
        assert solve_program(small, "highs", work_limit=1e-9).status == "optimal"


@backend
def test_deterministic(backend):
    # Many ties (values equal to weights), so many optimal points to choose from.
    rng = np.random.default_rng(5)
    w = rng.integers(1, 6, 16)
    p = program([0] * 16, [2] * 16, w, [Row(tuple(range(16)), tuple(w.tolist()), None, 23)])
    a = solve_program(p, backend, threads=1, seed=3)
    b = solve_program(p, backend, threads=1, seed=3)
    assert a.status == b.status == "optimal"
    assert a.x is not None and b.x is not None
    np.testing.assert_array_equal(a.x, b.x)


@backend
def test_log_threads_gap(backend):
    p = hard_knapsack(n=14, m=3)
    optimum = brute_force(p)
    assert optimum is not None
    s = solve_program(p, backend, log=True, threads=2)  # HiGHS must survive the thread switch
    assert s.status == "optimal" and s.objective == optimum
    assert isinstance(s.log, str) and s.log.strip()
    g = solve_program(p, backend, gap=0.2)
    assert g.status == "optimal" and g.objective is not None and g.bound is not None
    assert g.objective >= (1 - 0.2) * g.bound - 1e-9
    assert g.bound >= optimum


@backend
def test_empty_program(backend):
    s = solve_program(program([], [], [], []), backend)
    assert s.status == "optimal" and s.objective == 0 and s.x is not None and s.x.size == 0


@pytest.mark.skipif("highs" not in AVAILABLE, reason="highspy not installed")
def test_highs_thread_scheduler_reset():
    # HiGHS sizes one global scheduler per process; a run with another thread
    # count fails unless it is reset, also after HiGHS was used behind our back.
    p = hard_knapsack(n=14, m=3)
    assert solve_program(p, "highs", threads=1).status == "optimal"
    highs.highs_threads = None  # as if PuLP had run HiGHS with 1 thread
    assert solve_program(p, "highs", threads=2).status == "optimal"
    assert solve_program(p, "highs", threads=1).status == "optimal"


@backend
def test_large_values_exact_or_refused(backend):
    big = 123_456_789
    p = program([0, 0], [10**10, 10**10], [1, 2], [Row((0, 1), (1, 1), None, big, "sum")])
    try:
        s = solve_program(p, backend)
    except RuntimeError as exc:  # never a wrong answer
        assert backend == "cbc" and "8 significant digits" in str(exc)
    else:
        assert s.status == "optimal" and s.objective == 2 * big
        assert s.x is not None and s.x.tolist() == [0, big]


@backend
def test_big_coefficients(backend):
    # Watts-sized coefficients: a tolerance-feasible point may round infeasible.
    rng = np.random.default_rng(11)
    for _ in range(3):
        c = rng.integers(25_000_000, 37_000_000, 6)
        cap = int(c.sum() * 1.3)
        p = program(
            [0] * 6, [3] * 6, rng.integers(1, 17, 6), [Row(tuple(range(6)), tuple(c), None, cap)]
        )
        s = solve_program(p, backend)
        assert s.status == "optimal" and s.objective == brute_force(p)


def test_rounding_check_and_highs_retry(monkeypatch):
    p = program([0, 0], [1, 5], [1, 1], [Row((0, 1), (30_000_000, 1), None, 29_999_976, "site")])
    data, broken = common.prepare(p)
    assert not broken
    assert highs.integrality_tolerance(data) == pytest.approx(1e-2 / 30_000_000)
    # HiGHS with its default tolerance may call x0 = 0.9999992 integral; rounded, it breaks "site".
    assert highs.rounding_breaks(data, np.array([0.9999992, 0.0]))
    assert not highs.rounding_breaks(data, np.array([0.0, 5.0]))
    assert highs.rounding_breaks(data, np.array([0.0, 5.6]))  # bound

    calls = []

    def attempt(highspy, lp, data, opts, tol, time_limit):
        calls.append(tol)
        values = np.array([0.9999992, 0.0]) if len(calls) == 1 else np.array([0.0, 5.0])
        return common.Raw("optimal", values, 5.0)

    if "highs" not in AVAILABLE:
        return
    monkeypatch.setattr(highs, "highs_attempt", attempt)
    highspy = highs.load()
    s = highs.solve_highs(highspy, data, common.Options(None, 1, 0, False, 0.0))
    assert calls == [pytest.approx(1e-2 / 30_000_000), 1e-10]
    assert s.values is not None and s.values.tolist() == [0.0, 5.0]


@pytest.mark.skipif("cpsat" not in AVAILABLE, reason="ortools not installed")
def test_cpsat_model_invalid():
    p = program([0], [2**62], [1], [Row((0,), (1,), None, 10)])
    with pytest.raises(RuntimeError, match=r"CP-SAT rejected the model: .*domain"):
        solve_program(p, "cpsat")


@backend
def test_a_deadline_already_past_stops_the_solve_not_the_planner(backend):
    # Under load the deadline could pass between the search's check and the call:
    # solve_or_highs passed a negative time limit and the backend raised ValueError
    # out of solve(). Now the backend gets the shortest limit and returns.
    import time

    from ntp_opt.planners.exact.backends import solve_or_highs

    p = random_knapsack(np.random.default_rng(3))
    sol = solve_or_highs(p, backend, deadline=time.perf_counter() - 0.5, work=1.0)
    assert sol.status in ("optimal", "feasible", "unknown")
    if sol.status != "optimal":
        assert sol.time_limit_hit


def test_highs_solve_error_is_retried_with_another_seed():
    """A multi-workload program (4,096-GPU replay benchmark, bursty trace, step 22) on
    which HiGHS 1.x reports 'Solve error' with seed 0 at the integrality tolerance the
    backend picks; the other seeds and tolerances prove the optimum 402,732,939,936.
    Before the retry the multi planner fell back to CP-SAT, which stalled for a minute."""
    if "highs" not in AVAILABLE:
        pytest.skip("highspy not installed")
    bins = [
        ((6, 7, 9, 10, 12, 13, 0, 2), (4, 8, 2, 4, 1, 2, -32, -31)),
        ((6, 7, 9, 10, 13, 0, 2), (4, 8, 2, 4, 2, -32, -30)),
        ((6, 7, 10, 0, 2), (4, 8, 4, -32, -28)),
        ((7, 0, 2), (8, -32, -24)),
    ]
    rows = [
        Row((0, 1), (1, 1), 120, 120),
        Row((2,), (1,), 8, 8),
        Row((3, 1), (4, -1), None, 0),
        Row((3,), (1,), None, 24),
        Row((4, 3), (1, -8), None, 0),
        Row((4, 5), (1, -192), 0, 0),
        Row((8, 6, 7), (1, -81441, -151249), None, 0),
        Row((6, 7), (1, 1), 4, 123),
        Row((11, 9, 10), (1, -391703, -721558), None, 0),
        Row((9, 10), (1, 1), None, 256),
        Row((9, 10), (391703, 721558), 50_000_000, None),
        Row((14, 12, 13), (1, -400710, -761349), None, 0),
        Row((12, 13), (1, 1), None, 250),
        *(Row(v, c, None, 0) for v, c in bins),
    ]
    ub = [120, 120, 8, 24, 192, 1, 123, 123, 10**7, 256, 256, 10**8, 250, 250, 10**8]
    obj = [0, 0, 0, 0, 520833333, 0, 0, 0, 10000, 0, 0, 2000, 0, 0, 500]
    prog = program([0] * 15, ub, obj, rows)
    sol = solve_program(prog, "highs", time_limit=None, seed=0)  # no clock: it finishes
    assert sol.status == "optimal"
    assert sol.objective == 402_732_939_936
