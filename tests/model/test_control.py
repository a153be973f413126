"""Progress callbacks, the cancel token and Ctrl-C (SIGINT), in the API and the CLI.

No test here depends on the machine's speed: every wait is for an event (a
line on the child's stderr, a first progress report), and the solves that
get interrupted run for minutes when left alone (their limit is only a hang
guard).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from ntp_opt import load_instance, load_plan
from ntp_opt.model.control import SolveProgress
from ntp_opt.planners.exact.backends import available_backends
from ntp_opt.rules.validate import evaluate
from ntp_opt.solve import HEURISTICS, PLANNERS, solve
from tests.helpers import HANG_GUARD

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "instances" / "tiny.json"


def _long_instance() -> Path:
    """``default.json`` made elastic (power boost): the exact search solves dozens
    of programs (the fixed job is proven after a few). Removed at exit."""
    data = json.loads((ROOT / "instances" / "default.json").read_text())
    data["job"]["batch_policy"] = "elastic"
    folder = tempfile.mkdtemp(prefix="ntp_opt_long_")
    atexit.register(shutil.rmtree, folder, True)
    path = Path(folder) / "default-elastic.json"
    path.write_text(json.dumps(data))
    return path


#: elastic with power boost: the exact search runs for seconds when not interrupted
LONG = _long_instance()
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _sigint_cli(
    tmp_path: Path,
    instance: Path,
    policy: str,
    marker: str,
    count: int,
    prefix: list[str] | None = None,
    sig: int = signal.SIGINT,
) -> None:
    """Run ``ntp-opt solve --log``, send ``sig`` once ``marker`` was logged ``count``
    times, and check the exit status and the plan written. ``prefix``: the
    interpreter's arguments that run the CLI (default ``-m ntp_opt.app.cli``)."""
    out = tmp_path / "plan.json"
    cmd = [sys.executable, *(prefix or ["-m", "ntp_opt.app.cli"])]
    cmd += ["solve", str(instance), "--policy", policy]
    cmd += ["--time-limit", str(HANG_GUARD), "--log", "-o", str(out)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen, head = 0, []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            head.append(line)
            seen += marker in line
            if seen >= count:
                break
        assert seen >= count, "".join(head)  # the child ended before the marker
        proc.send_signal(sig)  # a real signal, as Ctrl-C (or scancel) sends
        stdout, stderr = proc.communicate(timeout=HANG_GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, stderr
    assert "(interrupted)" in stdout  # the summary table's status column
    assert "limit interrupted" in stderr and "best plan found so far is kept" in stderr
    assert ("terminated:" in stderr) == (sig == signal.SIGTERM)
    assert "Traceback" not in stderr
    check = subprocess.run(
        [sys.executable, "-m", "ntp_opt.app.cli", "validate", str(instance), str(out)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    inst = load_instance(instance)
    ev = evaluate(inst, load_plan(out))
    assert ev.feasible and ev.goodput > 0


@pytest.mark.parametrize("policy", ["optimal", "highs", "cbc"])
def test_cli_sigint_exact_returns_best_plan(tmp_path: Path, policy: str) -> None:
    backend = {"optimal": "cpsat"}.get(policy, policy)
    if backend not in available_backends():
        pytest.skip(f"{backend} not installed")
    # after three programs: OR-Tools must not have left SIGINT at its default
    # (process death) behind; the gate holds the fourth until the signal landed
    _sigint_cli(tmp_path, LONG, policy, "GATE:", 1, prefix=["-c", GATED_EXACT_CLI])


#: ``ntp-opt solve`` whose exact search holds its fourth program until the cancel
#: token is set (by the CLI's SIGINT handler): three programs have run (so
#: OR-Tools had its chance to reset SIGINT), and the signal surely lands while
#: the search runs, however fast it has become and however loaded the machine.
GATED_EXACT_CLI = """
import sys
import ntp_opt.planners.exact.oracle as oracle
from ntp_opt.app.cli import main

real, calls = oracle.solve_or_highs, []

def gate(*args, **kwargs):
    calls.append(1)
    if len(calls) == 4:
        print("GATE: three programs solved, waiting for Ctrl-C", file=sys.stderr, flush=True)
        while not kwargs["cancel"].wait(0.05):
            pass
    return real(*args, **kwargs)

oracle.solve_or_highs = gate
sys.exit(main(sys.argv[1:]))
"""


#: ``ntp-opt solve`` whose ``fast`` run stops after its first candidates until
#: the cancel token is set (by the CLI's SIGINT handler): the signal then surely
#: lands while ``fast`` runs, however fast it is and however loaded the machine.
GATED_CLI = """
import sys
import ntp_opt.planners.fast as fast
import ntp_opt.planners.fast_candidates as fast_candidates
from ntp_opt.app.cli import main

token = []
candidates, fit_by_degree = fast.candidates, fast_candidates.fit_by_degree

def record(instance, *, cancel=None):
    token.append(cancel)
    return candidates(instance, cancel=cancel)

def gate(*args, **kwargs):
    print("GATE: candidates scored, waiting for Ctrl-C", file=sys.stderr, flush=True)
    while not token[-1].wait(0.05):
        pass
    return fit_by_degree(*args, **kwargs)

fast.candidates, fast_candidates.fit_by_degree = record, gate
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("policy", ["optimal", "highs"])
def test_cli_sigterm_exact_keeps_best_plan(tmp_path: Path, policy: str) -> None:
    """SIGTERM (scancel, Slurm's time limit, a pod's deletion) keeps the plan as Ctrl-C
    does, then exits 143: the gate holds the search until the CLI's handler set the
    token, so the signal lands inside the search whatever the machine's speed."""
    backend = {"optimal": "cpsat"}.get(policy, policy)
    if backend not in available_backends():
        pytest.skip(f"{backend} not installed")
    prefix = ["-c", GATED_EXACT_CLI]
    _sigint_cli(tmp_path, LONG, policy, "GATE:", 1, prefix=prefix, sig=signal.SIGTERM)


def test_cli_compare_sigterm_prints_the_table() -> None:
    """``compare`` under SIGTERM: the table with the best plan's figure, then exit 143."""
    cmd = [sys.executable, "-c", GATED_EXACT_CLI, "compare", str(LONG), "--policies"]
    cmd += ["optimal,ntp", "--time-limit", str(HANG_GUARD), "-q"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        head = []
        for line in proc.stderr:
            head.append(line)
            if line.startswith("GATE:"):
                break
        assert head and head[-1].startswith("GATE:"), "".join(head)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=HANG_GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr
    assert "terminated: the best plan found so far is kept" in stderr
    row = next(line for line in stdout.splitlines() if "default" in line)
    cells = [c.strip() for c in row.replace("│", "|").split("|") if c.strip()]
    # instance, optimal, ntp, GPUs, failed (policies first, they must fit the terminal)
    assert cells[1].endswith("*") and float(cells[1][:-1]) > 0  # optimal's best, unproven
    assert cells[2] == "-"  # no further policy after the signal
    assert "Traceback" not in stderr


def test_cli_sigint_fast_returns_best_plan(tmp_path: Path) -> None:
    # the gate, not the instance's size, makes the signal land while fast runs
    _sigint_cli(tmp_path, LONG, "fast", "GATE:", 1, prefix=["-c", GATED_CLI])


def test_sigint_after_a_cpsat_solve_is_still_python_s(tmp_path: Path) -> None:
    """OR-Tools resets SIGINT to SIG_DFL after catching it; ntp_opt must not let it."""
    pytest.importorskip("ortools")
    code = (
        "import os, signal\n"
        "from ntp_opt.planners.exact.backends import solve_program\n"
        "from ntp_opt.planners.exact.program import IntProgram, Row\n"
        "import numpy as np\n"
        "p = IntProgram(np.array([0]), np.array([3]), np.array([1]), (Row((0,), (1,), None, 2),))\n"
        "assert solve_program(p, 'cpsat').objective == 2\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    for _ in range(10**6): pass\n"
        "except KeyboardInterrupt:\n"
        "    print('caught')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "caught", done.stderr


def _monotone(reports: list[SolveProgress]) -> None:
    assert reports and reports[-1].final and not any(r.final for r in reports[:-1])
    inc = [r.incumbent for r in reports if r.incumbent is not None]
    bnd = [r.bound for r in reports if r.bound is not None]
    assert inc == sorted(inc)
    assert bnd == sorted(bnd, reverse=True)
    assert [r.elapsed for r in reports] == sorted(r.elapsed for r in reports)
    for r in reports:
        if r.incumbent is not None and r.bound is not None:
            assert r.incumbent <= r.bound * (1 + 1e-9)
            assert r.gap == pytest.approx((r.bound - r.incumbent) / r.bound)


@pytest.mark.parametrize("solver", ["optimal", "highs"])
def test_callback_sees_monotone_incumbents_and_bounds(solver: str) -> None:
    if solver == "highs" and "highs" not in available_backends():
        pytest.skip("highs not installed")
    inst = load_instance(TINY)
    reports: list[SolveProgress] = []
    res = solve(inst, solver, time_limit=HANG_GUARD, callback=reports.append)
    assert res.status == "optimal"
    _monotone(reports)
    assert len(reports) >= 3  # the warm start, better plans of the search, the result
    assert reports[0].incumbent is not None and reports[0].incumbent < res.objective
    assert reports[-1].incumbent == res.objective and reports[-1].bound == res.bound
    assert {r.planner for r in reports} == {solver}


@pytest.mark.parametrize("solver", [*HEURISTICS, "fast"])
def test_heuristics_report_once_at_the_end(solver: str) -> None:
    inst = load_instance(TINY)
    reports: list[SolveProgress] = []
    res = solve(inst, solver, callback=reports.append)
    assert len(reports) == 1 and reports[0].final
    assert reports[0].incumbent == res.objective and reports[0].bound == res.bound


def test_cancel_from_another_thread() -> None:
    """Solve in a worker thread; cancel from this one once the first report came."""
    inst = load_instance(LONG)
    cancel, first = threading.Event(), threading.Event()
    out: dict[str, object] = {}

    def run() -> None:
        out["res"] = solve(
            inst,
            "optimal",
            time_limit=HANG_GUARD,
            cancel=cancel,
            callback=lambda p: first.set(),
        )

    worker = threading.Thread(target=run)
    worker.start()
    assert first.wait(HANG_GUARD)
    cancel.set()
    worker.join(HANG_GUARD)
    assert not worker.is_alive()
    res = out["res"]
    assert res.limit == "interrupted" and res.status == "feasible"  # type: ignore[attr-defined]
    assert evaluate(inst, res.plan).feasible  # type: ignore[attr-defined]


@pytest.mark.parametrize("solver", PLANNERS)
def test_every_planner_honours_a_set_cancel_token(solver: str) -> None:
    """Cancelled before it starts: every planner still returns a valid plan at once."""
    inst = load_instance(TINY)
    cancel = threading.Event()
    cancel.set()
    before = signal.getsignal(signal.SIGINT)
    res = solve(inst, solver, time_limit=HANG_GUARD, cancel=cancel)
    assert res.plan is not None and evaluate(inst, res.plan).feasible
    # a plan proven optimal before the cancel was seen keeps its proof
    assert res.limit == "interrupted" or res.status == "optimal"
    if solver not in HEURISTICS and solver != "fast":
        assert res.limit == "interrupted"
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back


def test_cancel_stops_the_exact_search_without_a_proof() -> None:
    """Against a run that is not cancelled: the cancelled one stops short of the proof."""
    inst = load_instance(TINY)
    full = solve(inst, "optimal", time_limit=HANG_GUARD)
    cancel = threading.Event()
    cancel.set()
    cut = solve(inst, "optimal", time_limit=HANG_GUARD, cancel=cancel)
    assert full.status == "optimal" and full.limit == "none"
    assert cut.status == "feasible" and cut.objective < full.objective
    # tiny.json (instances/README.md): the baselines give 0.75, the optimum 0.75 * 1.3**0.65 / 1.01
    assert cut.relative_objective == pytest.approx(0.75)


def test_api_doc_progress_block_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The example of docs/api.md "Progress, cancel and logging" runs and prints what it says."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("## Progress, cancel and logging") :]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(block, "docs/api.md", "exec"), {})
    finally:
        os.chdir(cwd)
    lines = capsys.readouterr().out.splitlines()
    # tiny.json: baselines 0.75 (goodput 1.5), optimum 2 * 0.75 * 1.3**0.65 / 1.01
    assert "incumbent 1.5 " in lines[0] and lines[-2].endswith("final True")
    final = float(lines[-2].split("incumbent ")[1].split()[0])
    assert final == pytest.approx(2 * 0.75 * 1.3**0.65 / 1.01, rel=1e-5)
    assert lines[-1] == "feasible interrupted 0.7500"


def test_every_module_logs_to_its_own_logger_without_handlers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    with caplog.at_level(logging.DEBUG, logger="ntp_opt"):
        res = solve(load_instance(TINY), "optimal", time_limit=HANG_GUARD)
    names = {r.name for r in caplog.records}
    assert {"ntp_opt.solve", "ntp_opt.model.control", "ntp_opt.planners.exact.oracle"} <= names
    assert "ntp_opt.planners.exact.backends.base" in names  # SolverBackend.solve
    assert all(not logging.getLogger(n).handlers for n in names)  # the library adds none
    assert not logging.getLogger("ntp_opt").handlers
    ends = [r.getMessage() for r in caplog.records if r.name == "ntp_opt.solve"]
    assert ends[-1].startswith(f"optimal: {res.status}, limit none")


def test_api_sigint_returns_best_plan() -> None:
    """In Python: Ctrl-C during solve(..., "optimal") returns the best plan, interrupted."""
    code = (
        "import sys\n"
        "from ntp_opt import load_instance, solve\n"
        f"inst = load_instance({str(LONG)!r})\n"
        "def seen(p):\n"
        "    print('incumbent', p.incumbent, file=sys.stderr, flush=True)\n"
        f"res = solve(inst, 'optimal', time_limit={HANG_GUARD}, callback=seen)\n"
        "print(res.status, res.limit, res.plan is not None and res.evaluation.feasible)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline() for _ in range(2)]  # two reports: inside the search
        assert all(line.startswith("incumbent") for line in lines), lines
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=HANG_GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert stdout.split() == ["feasible", "interrupted", "True"]
