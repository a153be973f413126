"""The batch runner: rows, resume after a kill, hard timeout, errors, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ntp_opt.app.bench import RESULTS, read_rows, run_bench, run_key, summary
from ntp_opt.app.cli import main
from tests.helpers import HANG_GUARD

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "instances" / "tiny.json"
PLANNERS = ["ntp", "optimal"]


def sleepy(instance: Any, time_limit: float, seed: int) -> Any:
    """A test planner (``tests.app.test_bench:sleepy``) that never finishes in time."""
    time.sleep(60)
    raise AssertionError("should have been killed")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inst") / "small.json"
    args = ["gen", "--gpus", "128", "--tp", "32", "--pp", "2", "--fail-count", "3"]
    assert main([*args, "-o", str(path)]) == 0
    return path


def _keys(out: Path) -> list[str]:
    return [r["key"] for r in read_rows(out / RESULTS)]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory, small: Path) -> tuple[Path, list[dict]]:
    """One bench of tiny and small with every planner (two workers), shared by the
    row checks and the resume test (which starts from a copy of its folder)."""
    out = tmp_path_factory.mktemp("bench") / "out"
    rows = run_bench(
        [TINY, small],
        PLANNERS,
        [0],
        out,
        time_limit=HANG_GUARD,
        timeout=HANG_GUARD,
        workers=2,
        progress=False,
    )
    return out, rows


def test_rows_summary_plots(first_run: tuple[Path, list[dict]]) -> None:
    out, rows = first_run
    assert len(rows) == 4
    assert {(Path(r["file"]).name, r["planner"]) for r in rows} == {
        (f, p) for f in ("tiny.json", "small.json") for p in PLANNERS
    }
    for r in rows:
        assert r["status"] in ("optimal", "feasible"), r
        assert 0 < r["relative_goodput"] <= 1
        assert r["gpus"] in (12, 128)
        assert r["version"]
    opt = next(r for r in rows if r["planner"] == "optimal" and r["instance"] == "tiny")
    assert opt["bound"] == pytest.approx(opt["relative_goodput"], rel=1e-4)
    text = (out / "summary.md").read_text()
    assert "| tiny | 12 | 1 | optimal |" in text and "small" in text
    assert text.strip() == summary(rows)
    assert len((out / "results.csv").read_text().splitlines()) == 5
    assert (out / "goodput.png").stat().st_size > 0
    assert (out / "time_vs_size.png").stat().st_size > 0
    assert (out / "gap.png").stat().st_size > 0
    assert opt["validated"] is True and len(opt["sha256"]) == 64


def test_resume_after_kill_mid_write(
    tmp_path: Path, small: Path, first_run: tuple[Path, list[dict]]
) -> None:
    out = tmp_path / "out"
    kw: dict[str, Any] = {"time_limit": HANG_GUARD, "timeout": HANG_GUARD, "progress": False}
    shutil.copytree(first_run[0], out)  # a finished run of [TINY, small] x PLANNERS
    results = out / RESULTS
    lines = results.read_text().splitlines(keepends=True)
    assert len(lines) == 4
    lost = json.loads(lines[-1])["key"]
    # killed while writing the last row: half a line, no newline
    results.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    first = {json.loads(x)["key"]: x for x in lines[:-1]}
    rows = run_bench([TINY, small], PLANNERS, [0], out, **kw)
    keys = _keys(out)
    assert sorted(keys) == sorted({r["key"] for r in rows}) and len(keys) == 4
    assert keys[-1] == lost  # only the lost run was rerun
    text = results.read_text()
    assert text.endswith("\n") and all(json.loads(x) for x in text.splitlines())
    for k, line in first.items():  # earlier rows untouched
        assert line in text, k
    # a third run does nothing new
    run_bench([TINY, small], PLANNERS, [0], out, **kw)
    assert _keys(out) == keys


def test_hard_timeout_kills_the_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # ntp must finish: its timeout only guards against a hang (no wall-clock race)
    run_bench([TINY], ["ntp"], [0], out, time_limit=HANG_GUARD, timeout=HANG_GUARD, progress=False)
    # the sleeper never finishes: whatever the load, the 1 s timeout kills it
    rows = run_bench(
        [TINY],
        ["tests.app.test_bench:sleepy", "ntp"],
        [0],
        out,
        time_limit=1,
        timeout=1.0,
        workers=2,
        progress=False,
    )
    by = {r["planner"]: r for r in rows}
    assert by["tests.app.test_bench:sleepy"]["status"] == "timeout"
    # the size is kept if the worker sent it before the kill (on a loaded
    # machine it may not have loaded the instance within 1 s)
    assert by["tests.app.test_bench:sleepy"]["gpus"] in (12, None)
    assert by["ntp"]["status"] == "feasible"
    assert "timeout" in (out / "summary.md").read_text()


def crashy(instance: Any, time_limit: float, seed: int) -> Any:
    """A test planner (``tests.app.test_bench:crashy``) that fails after the instance loaded."""
    raise RuntimeError("planner crashed")


def test_what_the_worker_sent_before_failing_is_kept(tmp_path: Path) -> None:
    rows = run_bench(
        [TINY],
        ["tests.app.test_bench:crashy"],
        [0],
        tmp_path,
        time_limit=HANG_GUARD,
        timeout=HANG_GUARD,
        progress=False,
    )
    assert rows[0]["status"] == "error" and "planner crashed" in rows[0]["message"]
    assert rows[0]["gpus"] == 12 and rows[0]["failed"] == 1


def test_bad_file_is_an_error_row(tmp_path: Path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text('{"format": "ntp-opt/instance@1", "name": 3}')
    out = tmp_path / "out"
    rows = run_bench(
        [bad], ["ntp"], [0], out, time_limit=HANG_GUARD, timeout=HANG_GUARD, progress=False
    )
    assert len(rows) == 1 and rows[0]["status"] == "error"
    assert "broken.json" in rows[0]["message"]
    assert rows[0]["key"] == run_key(bad, "ntp", 0)


def test_unknown_planner_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown planner"):
        run_bench([TINY], ["nope"], [0], tmp_path, time_limit=1, timeout=1, progress=False)


def test_cli_bench_directory(tmp_path: Path, small: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "res"
    argv = ["bench", str(small.parent), "--planners", "ntp,optimal", "--seeds", "0,1"]
    assert main([*argv, "-o", str(out), "--time-limit", str(HANG_GUARD), "--workers", "2"]) == 0
    text = capsys.readouterr().out
    assert "| small | 128 | 3 | optimal | 2 |" in text
    assert len(_keys(out)) == 4
    assert main(["bench", str(TINY), "--planners", "bogus", "-o", str(out)]) == 2


def test_cli_killed_mid_run_resumes(tmp_path: Path) -> None:
    """SIGKILL the whole ``ntp-opt bench`` process group mid-run, then rerun it."""
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "ntp_opt.app.cli", "bench", str(TINY), "-o", str(out)]
    cmd += ["--planners", "ntp,tests.app.test_bench:sleepy", "--time-limit", "1", "--no-best-known"]
    proc = subprocess.Popen(
        [*cmd, "--timeout", str(HANG_GUARD)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # event-driven: wait for ntp's row (the sleepy run starts next and never
        # ends); the guard only stops a hung child from hanging the suite
        guard = time.monotonic() + HANG_GUARD
        while len(read_rows(out / RESULTS)) < 1:
            assert proc.poll() is None and time.monotonic() < guard, "bench ended early"
            time.sleep(0.05)
        time.sleep(0.3)  # the sleepy run is now in progress
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [r["planner"] for r in read_rows(out / RESULTS)] == ["ntp"]
    done = subprocess.run(
        [*cmd, "--timeout", "1"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "timeout" in done.stdout
    rows = read_rows(out / RESULTS)
    assert [r["planner"] for r in rows] == ["ntp", "tests.app.test_bench:sleepy"]
    assert rows[1]["status"] == "timeout"
