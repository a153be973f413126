"""What an operator sees: the results table at 80-120 columns, the live status line,
and hostile inputs (issue 33): oversized --threads, speeds below the file format's
minimum, a full disk, control characters and megabyte echoes in names and labels."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ntp_opt.app.cli import common as cli_common
from ntp_opt.app.cli import main
from ntp_opt.app.cli import solve as cli_solve
from ntp_opt.model.control import SolveProgress
from ntp_opt.model.echo import echo
from ntp_opt.model.files import load_instance
from ntp_opt.planners.base import Limit, Status
from ntp_opt.solve import POLICIES, Result, solve
from tests.helpers import HANG_GUARD

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "instances" / "tiny.json")
CLI = [sys.executable, "-m", "ntp_opt.app.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm"}
ESCAPES = "\x1b]0;owned\x07\x1b[2J"


# --- the results table ---------------------------------------------------------------


@pytest.fixture(scope="module")
def results() -> tuple[Any, list[tuple[str, Result]]]:
    instance = load_instance(TINY)
    rows = [(p, solve(instance, p, time_limit=30)) for p in POLICIES]
    # the widest cells a real run can print: the longest planner name, a stopped search
    _name, res = rows[-1]
    stopped = dataclasses.replace(res, status=Status.FEASIBLE, limit=Limit.TIME)
    rows.append(("optimal-megatron-nopower", stopped))
    return instance, rows


def _render(tables: list[Any], width: int) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None, highlight=False)
    for t in tables:
        con.print(t)
    return buf.getvalue()


@pytest.mark.parametrize("width", [80, 100, 120])
def test_table_shows_policy_goodput_bound_gap_status_whole(results, width: int) -> None:
    instance, rows = results
    text = _render(cli_solve.summary_tables(rows, instance, width), width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in text  # nothing cut
    scale = instance.job.seq_time_s / instance.job.dp
    for name, res in rows:
        status = str(res.status) + ("" if res.limit == "none" else f" ({res.limit})")
        cells = [name, f"{res.relative_objective:.4f}", status]
        if res.bound is not None:
            cells += [f"{res.bound * scale:.4f}", f"{res.gap:.1e}"]
        # all on one line of the first table
        assert any(all(f" {c} " in line for c in cells) for line in lines), (name, text)
    assert "feasible (time_limit)" in text
    # the other columns are stacked below, not lost
    for header in ("power", "replicas", "reduced", "GPUs", "seq/s"):
        assert header in text
    for _, res in rows:
        assert f" {res.evaluation.site_power_w / 1e3:.1f} " in text


def test_table_80_columns_through_the_command(monkeypatch, capsys) -> None:
    buf = io.StringIO()
    con = Console(file=buf, width=80, force_terminal=True, color_system=None, highlight=False)
    monkeypatch.setattr(cli_solve, "make_console", lambda: con)
    assert main(["solve", TINY, "--policy", "all", "--time-limit", "30"]) == 0
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    for p in POLICIES:
        assert f"│ {p} " in text
    assert "(more columns)" in text and "…" not in text


def test_compare_table_80_columns(monkeypatch) -> None:
    from ntp_opt.app.cli import compare as cli_compare

    buf = io.StringIO()
    con = Console(file=buf, width=80, color_system=None, highlight=False)
    monkeypatch.setattr(cli_compare, "make_console", lambda: con)
    assert main(["compare", TINY, "--time-limit", "30", "-q"]) == 0
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    instance = load_instance(TINY)
    row = next(line for line in text.splitlines() if line.startswith("│ tiny "))
    for p in POLICIES:
        assert f" {p} " in text
        value = solve(instance, p, time_limit=30).relative_objective
        assert f" {value:.4f} " in row


def test_time_limit_stop_is_explained(monkeypatch, capsys) -> None:
    instance = load_instance(TINY)
    real = solve(instance, "optimal", time_limit=30)
    stopped = dataclasses.replace(real, status=Status.FEASIBLE, limit=Limit.TIME, bound=None)
    monkeypatch.setattr(cli_solve, "solve", lambda *a, **k: stopped)
    assert main(["solve", TINY, "--policy", "optimal", "--time-limit", "7"]) == 0
    out = capsys.readouterr().out
    assert "optimal: stopped at the 7 s time limit (no bound; valid, not proven optimal)" in out


def test_table_wide_terminal_is_one_table(results) -> None:
    instance, rows = results
    text = _render(cli_solve.summary_tables(rows, instance, 160), 160)
    assert "(more columns)" not in text and "goodput seq/s" in text


# --- the live status line ------------------------------------------------------------


def test_status_line_follows_the_callback() -> None:
    now = [100.0]
    line = cli_solve.StatusLine("optimal", 0.5, 60.0, "[2/5] ", clock=lambda: now[0])
    now[0] = 112.2
    assert line.text().startswith("[2/5] optimal  12 s of 60 s  no plan yet")
    line.update(SolveProgress("optimal", 11.0, incumbent=1.5, bound=1.6, gap=0.0625))
    now[0] = 130.9
    text = line.text()
    assert "31 s of 60 s" in text
    assert "incumbent 0.7500  bound 0.8000  gap 6.2e-02" in text
    heuristic = cli_solve.StatusLine("ntp-pw", 1.0, None, clock=lambda: now[0])
    assert heuristic.text().startswith("ntp-pw  0 s  no plan yet")


def _pty_run(args: list[str]) -> tuple[int, bytes, bytes]:
    """Run the command with stderr on a pseudo-terminal; (status, stdout, terminal)."""
    master, slave = os.openpty()
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=slave, env=ENV, cwd=ROOT)
    os.close(slave)
    seen = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out = proc.stdout.read() if proc.stdout else b""
    os.close(master)
    return proc.wait(timeout=HANG_GUARD), out, bytes(seen)


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_status_line_on_a_terminal_only() -> None:
    status, out, tty = _pty_run(["solve", TINY, "--policy", "optimal", "--time-limit", "30"])
    assert status == 0
    assert b"optimal" in tty and b"incumbent" in tty and b"of 30 s" in tty
    assert b"incumbent" not in out  # the status goes to the terminal, not the table's stream
    # piped: nothing on stderr at all
    piped = subprocess.run(
        [*CLI, "solve", TINY, "--policy", "optimal", "--time-limit", "30"],
        capture_output=True,
        env=ENV,
        cwd=ROOT,
        timeout=HANG_GUARD,
    )
    assert piped.returncode == 0 and piped.stderr == b""
    assert b"optimal" in piped.stdout


def test_no_status_line_with_log(monkeypatch) -> None:
    # --log streams the search log on stderr: no status line drawn over it
    monkeypatch.setattr(cli_solve, "status_console", lambda: pytest.fail("status line with --log"))
    assert main(["solve", TINY, "--policy", "ntp", "--log"]) == 0


# --- hostile inputs ------------------------------------------------------------------


@pytest.mark.parametrize("threads", ["100000", "10000", "0", "-1"])
def test_threads_bounded_by_cores(monkeypatch, capsys, threads: str) -> None:
    monkeypatch.setattr(cli_common, "usable_cores", lambda: 2)
    with pytest.raises(SystemExit) as exc:
        main(["solve", TINY, "--threads", threads])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--threads: must be 1 to 8 (4 x the 2 cores this process may use)" in err


def test_threads_at_the_bound_run(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli_common, "usable_cores", lambda: 2)
    assert main(["solve", TINY, "--policy", "optimal", "--threads", "8"]) == 0


def _plan(tmp_path: Path) -> tuple[Path, str]:
    plan = tmp_path / "plan.json"
    assert main(["solve", TINY, "--policy", "ntp", "-o", str(plan)]) == 0
    gpu = json.loads(plan.read_text())["replicas"][0]["stages"][0]["gpus"][0]
    return plan, str(gpu)


def test_replan_speed_range_is_the_file_formats(tmp_path, capsys) -> None:
    # the smallest speed the instance schema accepts, read from the published schema
    assert main(["schema", "instance"]) == 0
    schema = json.loads(capsys.readouterr().out)
    lowest = schema["$defs"]["GpuNode"]["properties"]["speed"]["minimum"]
    plan, gpu = _plan(tmp_path)
    out = tmp_path / "after.json"
    capsys.readouterr()
    event = f"speed:{gpu}={lowest / 10:g}"
    assert main(["replan", TINY, str(plan), "--event", event, "--instance-out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--event" in err and f"[{lowest:g}, 1]" in err
    assert not out.exists()
    event = f"speed:{gpu}={lowest:g}"
    assert main(["replan", TINY, str(plan), "--event", event, "--instance-out", str(out)]) == 0
    assert main(["info", str(out)]) == 0  # what replan writes, info reads


class _FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_on_stdout_names_it(monkeypatch, capsys) -> None:
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    assert main(["info", TINY]) == 2
    err = capsys.readouterr().err
    assert err == "ntp-opt: error: standard output: No space left on device\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_on_redirected_stdout_names_the_file() -> None:
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [*CLI, "info", TINY], stdout=full, stderr=subprocess.PIPE, env=ENV, timeout=HANG_GUARD
        )
    assert r.returncode == 2
    assert r.stderr == b"ntp-opt: error: /dev/full (standard output): No space left on device\n"


def test_full_disk_on_output_file_names_it(tmp_path, monkeypatch, capsys) -> None:
    from ntp_opt.model import safeio

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safeio.os, "fsync", full)
    target = tmp_path / "plan.json"
    assert main(["solve", TINY, "--policy", "ntp", "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert err == f"ntp-opt: error: {target}: No space left on device\n"
    assert not target.exists() and not list(tmp_path.iterdir())  # no temporary file left


def _evil_instance(tmp_path: Path, name: str) -> Path:
    data = json.loads(Path(TINY).read_text())
    data["name"] = name
    path = tmp_path / "evil.json"
    path.write_text(json.dumps(data))
    return path


def _clean(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text, text[:300]
    assert "Traceback" not in text


def test_control_characters_in_names_are_escaped(tmp_path, capsys) -> None:
    # escape sequences, rich markup and emoji codes: printed as text, never obeyed
    name = ESCAPES + "[/]x:smile:[bold]"
    inst = _evil_instance(tmp_path, name)
    plan = tmp_path / "p.json"
    assert main(["info", str(inst)]) == 0
    assert main(["solve", str(inst), "--policy", "ntp", "-o", str(plan)]) == 0
    assert main(["validate", str(inst), str(plan)]) == 0
    out, err = capsys.readouterr()
    _clean(out + err)
    shown = "\\x1b]0;owned\\x07\\x1b[2J[/]x:smile:[bold]"
    assert out.count(shown) == 4  # info, solve's header and table title, validate


def test_long_and_multiline_echoes_are_cut(tmp_path, capsys) -> None:
    # names are at most 200 characters (the schema), 4 times that once escaped
    name = "line1\nline2" + "\x07" * 180
    inst = _evil_instance(tmp_path, name)
    assert main(["info", str(inst)]) == 0
    out = capsys.readouterr().out
    first = out[: out.index(" GPUs in ")].replace("\n", "")  # the console wraps at 160
    assert first.startswith("line1\\nline2\\x07\\x07") and first.endswith("characters): 12")
    assert len(first) < 300


def test_error_lines_are_printable_and_short(tmp_path, capsys) -> None:
    data = json.loads(Path(TINY).read_text())
    data["job"][ESCAPES + "y" * 1_000_000] = 1  # an unknown field named with escapes
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["info", str(bad)]) == 2
    err = capsys.readouterr().err
    _clean(err)
    assert err.count("\n") == 1 and len(err) < 700
    missing = str(tmp_path / f"{ESCAPES}nope.json")
    assert main(["info", missing]) == 2
    err = capsys.readouterr().err
    _clean(err)
    assert "\\x1b]0;owned\\x07" in err and err.count("\n") == 1


def test_warnings_are_one_printable_line(capsys) -> None:
    cli_common.warn("node n1: reason " + ESCAPES + "\nsecond line" + "z" * 1_000_000)
    err = capsys.readouterr().err
    _clean(err)
    assert err.startswith("ntp-opt: warning: node n1: reason \\x1b]0;owned")
    assert err.count("\n") == 1 and len(err) < 700


def test_echo() -> None:
    assert echo("plain name") == "plain name"
    assert echo("a\x1b[2Jb\x07\n\t\u202e") == "a\\x1b[2Jb\\x07\\n\\t\\u202e"
    cut = echo("ab\x1bcdef", limit=6)
    assert cut == "ab\\x1b… (4 more characters)"
    assert echo("x" * 10, limit=None) == "x" * 10
