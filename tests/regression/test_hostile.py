"""Hostile inputs and failures (issue 18, the file and command-line half).

Item of issue 18 -> tests here (the service half, items 2 and 3, is tested
with the service):

| item | what | tests (``pytest -k``) |
|---|---|---|
| 1 | `-o` onto device/FIFO/symlink/input, mode, planted temp | test_item1_* |
| 4 | gzip and parse bombs, escapes, encodings | test_item4_* |
| 5 | clean errors (10**400, events, flags, overflow) | test_item5_*, |
|   | bench row with a list as key | test_item6_read_rows_reports_file_and_line |
| 6 | bench lock, workers die with the driver, corrupt rows | test_item6_* |
| 7 | NaN never written, names escaped in Markdown | test_item7_* |
| 8 | workloads loader linear (100k fleets) | test_item8_hundred_thousand_fleets |
| 9 | SIGTERM/SIGINT during a save: no .tmp | test_item9_signal_during_gen_leaves_no_temp |
| 10 | strict types, duplicate keys, 1e999, names, one line | test_item10_*, |
|   | BOM and UTF-16 | test_item4_other_encodings_refused |
|   | write errors name the user's path | test_item1_write_error_names_the_users_path |
| fuzz | mutated files load or raise InputError | test_fuzz_loaders_* |
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt.app.cli import main
from ntp_opt.app.proctree import alive
from ntp_opt.model import files
from ntp_opt.model.files import caps, loaders, safe_json
from ntp_opt.model.safeio import UnsafeTargetError, atomic_append, atomic_write, save_figure

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "instances" / "tiny.json"
GEN = ["gen", "--builder", "nvl32", "--gpus", "64", "--tp", "8"]


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # exactly one line
    assert err.startswith("ntp-opt: error: "), err
    return err


def _no_temp(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# --- item 1: safe writes ---------------------------------------------------


@pytest.mark.parametrize("kind", ["device", "fifo", "symlink", "directory"])
def test_item1_gen_refuses_non_regular_target(tmp_path, capsys, kind):
    if kind == "device":
        target = Path("/dev/null")
        before = os.stat(target)
    elif kind == "fifo":
        target = tmp_path / "f.json"
        os.mkfifo(target)
    elif kind == "symlink":
        victim = tmp_path / "victim"
        victim.write_text("precious")
        target = tmp_path / "link.json"
        target.symlink_to(victim)
    else:
        target = tmp_path / "d.json"
        target.mkdir()
    assert main([*GEN, "-o", str(target)]) == 2
    err = _err(capsys)
    assert str(target) in err and "refusing" in err
    if kind == "device":
        after = os.stat(target)
        assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino
    elif kind == "symlink":
        assert (tmp_path / "victim").read_text() == "precious"
        assert target.is_symlink()
    _no_temp(tmp_path)


def test_item1_solve_refuses_its_input_as_output(tmp_path, capsys):
    inst = tmp_path / "x.json"
    inst.write_bytes(TINY.read_bytes())
    assert main(["solve", str(inst), "--policy", "ntp", "-o", str(inst)]) == 2
    err = _err(capsys)
    assert str(inst) in err and "input" in err
    assert inst.read_bytes() == TINY.read_bytes()
    # also through a hard link (same file, other name)
    alias = tmp_path / "alias.json"
    os.link(inst, alias)
    assert main(["solve", str(inst), "--policy", "ntp", "-o", str(alias)]) == 2
    assert str(alias) in _err(capsys)


def test_item1_replan_refuses_inputs_as_outputs(tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["solve", str(TINY), "--policy", "ntp", "-o", str(plan)]) == 0
    capsys.readouterr()
    before = plan.read_bytes()
    assert main(["replan", str(TINY), str(plan), "--event", "fail:g0", "-o", str(plan)]) == 2
    assert str(plan) in _err(capsys)
    assert plan.read_bytes() == before


def test_item1_mode_of_target_kept(tmp_path, capsys):
    target = tmp_path / "i.json"
    target.write_text("{}")
    target.chmod(0o600)
    assert main([*GEN, "-o", str(target)]) == 0
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert json.loads(target.read_text())["format"] == "ntp-opt/instance@1"


def test_item1_new_file_gets_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "new.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o640


def test_item1_export_ignores_planted_temp_symlink(tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["solve", str(TINY), "--policy", "ntp", "-o", str(plan)]) == 0
    out = tmp_path / "launch"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in (".ranks.txt.tmp", ".ntp_config.py.tmp", ".megatron-ntp.json.tmp"):
        (out / name).symlink_to(victim)
    argv = ["export", str(plan), "--to", "megatron-ntp", "--instance", str(TINY), "-o", str(out)]
    status = main([*argv, "--equal-batch"])  # Megatron runs one local batch
    assert status == 0, capsys.readouterr()
    assert victim.read_text() == "precious"
    assert (out / "ranks.txt").read_text().startswith("# ")
    assert not (out / "ranks.txt").is_symlink()


def test_item1_write_error_names_the_users_path(tmp_path, capsys, monkeypatch):
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ntp_opt.model.safeio.os.fsync", full)
    target = tmp_path / "i.json"
    assert main([*GEN, "-o", str(target)]) == 2
    err = _err(capsys)
    assert f"{target}: No space left on device" in err and ".tmp" not in err
    assert not target.exists()
    _no_temp(tmp_path)


def test_item1_append_and_figure_refuse_non_regular(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "results.jsonl"
    link.symlink_to(victim)
    with pytest.raises(UnsafeTargetError, match=r"results\.jsonl"):
        atomic_append(link, "{}\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeTargetError, match="fifo"):
        atomic_append(fifo, "{}\n")  # never blocks on a FIFO without reader
    assert victim.read_text() == "precious"
    plain = tmp_path / "rows.jsonl"
    atomic_append(plain, "a\n")
    atomic_append(plain, b"b\n")
    assert plain.read_text() == "a\nb\n"

    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, _ = plt.subplots()
    png = tmp_path / "fig.png"
    png.symlink_to(victim)
    with pytest.raises(UnsafeTargetError):
        save_figure(fig, png)
    png.unlink()
    save_figure(fig, png, dpi=20)
    plt.close(fig)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _no_temp(tmp_path)


def test_item1_bench_refuses_symlinked_results(tmp_path, capsys):
    out = tmp_path / "bench"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (out / "results.jsonl").symlink_to(victim)
    status = main(["bench", str(TINY), "--planners", "ntp", "-o", str(out), "--no-best-known"])
    assert status == 2
    assert "results.jsonl" in _err(capsys)
    assert victim.read_text() == "precious\n"


def test_item1_atomic_write_keeps_old_content_on_error(tmp_path):
    target = tmp_path / "t.txt"
    atomic_write(target, "old")
    with pytest.raises(UnsafeTargetError):
        atomic_write(target, "new", inputs=[target])
    assert target.read_text() == "old"
    _no_temp(tmp_path)


# --- item 9: signals during a save ----------------------------------------

# A real `ntp-opt gen` whose save pauses inside the temporary file (after the
# first bytes are written) and says so on stdout; the test then sends a real
# signal. No timing: the child blocks on stdin until it is signalled.
_PAUSED_GEN = """
import contextlib, sys
from ntp_opt.model import safeio
from ntp_opt.model.files import dump
from ntp_opt.app.cli import main

@contextlib.contextmanager
def paused(path, inputs=()):
    with safeio.atomic_open(path, inputs) as fh:
        fh.write(b'{"partial": ')
        fh.flush()
        print("WRITING", flush=True)
        sys.stdin.readline()  # blocks until the test signals us
        yield fh

dump.atomic_open = paused
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_item9_signal_during_gen_leaves_no_temp(tmp_path, sig, status):
    out = tmp_path / "big.json.gz"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_GEN, *GEN, "-o", str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "WRITING\n"
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # mid-save
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, err
    assert "Traceback" not in err
    assert not out.exists()
    _no_temp(tmp_path)


# --- item 4: gzip and parse bombs (same shapes, caps lowered) ---------------


def _gz_stream(path: Path, head: bytes, unit: bytes, count: int, tail: bytes) -> None:
    """A .json.gz of ``head + unit * count + tail``, compressed member by member."""
    per = max(1, min(count, 10_000))
    member = gzip.compress(unit * per, compresslevel=9)
    with path.open("wb") as fh:
        fh.write(gzip.compress(head))
        for _ in range(count // per):
            fh.write(member)
        fh.write(gzip.compress(unit * (count % per) + tail))


@pytest.fixture
def low_caps(monkeypatch):
    """Caps of a 1,000-node world; parsing itself must never be reached."""
    monkeypatch.setattr(caps, "MAX_NODES", 1000)
    monkeypatch.setattr(caps, "TOKENS_EXTRA", 0)
    monkeypatch.setattr(caps, "MAX_STRING_BYTES", 10_000)
    monkeypatch.setattr(caps, "MAX_FILE_BYTES", 2_000_000)

    def no_parse(raw, source):
        raise AssertionError("the bomb reached the JSON parser")

    monkeypatch.setattr(safe_json, "parse_checked", no_parse)
    monkeypatch.setattr(loaders, "parse_checked", no_parse)


HEAD = b'{"format": "ntp-opt/instance@1", "name": "x", "job": {}, "cluster": {"nodes": ['


@pytest.mark.parametrize(
    ("unit", "what"),
    [
        (b"{}, ", "JSON values"),  # empty nodes: no "kind" to count
        (b'{"id": "g", "\\u006bind": "gpu"}, ', "JSON values"),  # escaped key
        (b'{"id": "g", "kind": "gpu"}, ', "nodes"),  # plain nodes
        (b"[], ", "JSON values"),
        (b"0, ", "JSON values"),
    ],
)
def test_item4_node_bombs_refused_while_streaming(tmp_path, low_caps, capsys, unit, what):
    p = tmp_path / "bomb.json.gz"
    _gz_stream(p, HEAD, unit, 40_000, b"{}]}}")  # 40x the 1,000-node world
    with pytest.raises(files.InputError, match=what) as err:
        files.load_instance(p)
    assert err.value.source == str(p)
    assert main(["info", str(p)]) == 2
    assert str(p) in _err(capsys)


@pytest.mark.parametrize(
    "unit", [b"a", b"\\u0061", b"{[,"], ids=["plain", "escaped", "structural-in-string"]
)
def test_item4_long_string_in_meta_refused(tmp_path, low_caps, unit):
    p = tmp_path / "bomb.json.gz"
    head = b'{"format": "ntp-opt/instance@1", "name": "x", "meta": {"blob": "'
    _gz_stream(p, head, unit, 200_000, b'"}, "job": {}, "cluster": {"nodes": []}}')
    with pytest.raises(files.InputError, match=r"without a quote|JSON values"):
        files.load_instance(p)


def test_item4_decompressed_size_capped(tmp_path, low_caps):
    p = tmp_path / "spaces.json.gz"
    _gz_stream(p, b'{"format": "ntp-opt/instance@1", "name": "x"', b" " * 1000, 5_000, b"}")
    assert p.stat().st_size < 100_000
    with pytest.raises(files.InputError, match="exceeds 2000000 bytes"):
        files.load_instance(p)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
def test_item4_other_encodings_refused(tmp_path, encoding):
    text = TINY.read_text()
    p = tmp_path / "enc.json"
    p.write_bytes(text.encode(encoding))
    with pytest.raises(files.InputError, match=r"byte-order mark|UTF-8"):
        files.load_instance(p)


def test_item4_node_count_checked_after_cheap_parse(tmp_path, monkeypatch):
    """Nodes counted on the parsed JSON, before pydantic or NetworkX see them."""
    data = json.loads(TINY.read_text())
    n = len(data["cluster"]["nodes"])
    monkeypatch.setattr(caps, "MAX_NODES", n - 1)
    monkeypatch.setattr(caps, "TOKENS_EXTRA", 10**6)  # let the stream scan pass
    for node in data["cluster"]["nodes"]:  # hide every "kind" key behind an escape
        node["\\u006bind"] = node.pop("kind")
    p = tmp_path / "escaped.json"
    p.write_text(json.dumps(data).replace("\\\\u006bind", "\\u006bind"))
    assert b'"kind"' not in p.read_bytes()

    def no_model(*a, **k):
        raise AssertionError("pydantic reached")

    monkeypatch.setattr(files.InstanceFile, "model_validate", no_model)
    with pytest.raises(files.InputError, match=f"more than {n - 1} nodes") as err:
        files.load_instance(p)
    assert err.value.problems[0][0] == "cluster.nodes"


# --- item 5: clean errors instead of tracebacks -----------------------------


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["solve", str(TINY), "--policy", "ntp", "-o", str(path)]) == 0
    return path


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("field", ["tp", "local_batch"])
@pytest.mark.parametrize("command", ["validate", "evaluate", "replan", "export"])
def test_item5_huge_integers_in_plan(tmp_path, capsys, plan_file, field, command):
    data = json.loads(plan_file.read_text())
    data["replicas"][0][field] = 10**400
    bad = _write(tmp_path / "big.json", json.dumps(data))
    argv = {
        "validate": ["validate", str(TINY), bad],
        "evaluate": ["evaluate", str(TINY), bad],
        "replan": ["replan", str(TINY), bad, "--event", "fail:g0"],
        "export": ["export", bad, "--to", "megatron-ntp", "--instance", str(TINY), "-o", "x"],
    }[command]
    assert main(argv) == 2
    err = _err(capsys)
    assert f"{bad}: replicas[0].{field}:" in err


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("[1]", "[0]: expected an object"),
        ('[{"kind": "fail", "nodes": [["a"]]}]', "[0].nodes: node ids"),
        ('[{"kind": "fail", "nodes": {"a": 1}}]', "[0].nodes: expected a list"),
        ('[{"kind": "fail", "nodes": ["g0"], "speed": "x"}]', "[0].speed"),
        ('{"kind": "fail"}', "expected a JSON list"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('[{"kind": "explode", "nodes": ["g0"]}]', "[0]: event kind"),
        ('[{"kind": "fail", "nodes": ["nope"]}]', "nope"),
    ],
)
def test_item5_bad_event_files(tmp_path, capsys, plan_file, text, where):
    events = _write(tmp_path / "events.json", text)
    assert main(["replan", str(TINY), str(plan_file), "--events", events]) == 2
    err = _err(capsys)
    assert f"{events}: " in err and where in err


@pytest.mark.parametrize("flag", ["--tp", "--pp", "--gpus", "--dp", "--global-batch"])
def test_item5_gen_zero_flags(tmp_path, capsys, flag):
    argv = ["gen", "--gpus", "64", "--tp", "8", "-o", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, flag, "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be at least 1, got 0" in err and "Traceback" not in err


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_item5_serve_port_checked_by_argparse(capsys, port):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", port])
    assert exit_.value.code == 2
    assert "argument --port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("job", "field"),
    [
        ({"tp_efficiency": {"3": 1e308}}, "tp_efficiency[3]"),
        ({"tp_efficiency": {"3": 5e-324}}, "tp_efficiency[3]"),
        ({"seq_time_s": 5e-324}, "job.seq_time_s"),
        ({"seq_time_s": 1e308}, "job.seq_time_s"),
    ],
)
def test_item5_job_values_that_overflow(tmp_path, capsys, job, field):
    data = json.loads(TINY.read_text())
    data["job"].update(job)
    bad = _write(tmp_path / "job.json", json.dumps(data))
    for argv in (["info", bad], ["solve", bad, "--policy", "fast"]):
        assert main(argv) == 2
        assert field in _err(capsys)


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("rack", "power_budget_w", 1.7e308),  # the site's sum overflowed (int(inf))
        ("gpu", "speed", 1e-300),  # powers of the speed overflowed
        ("gpu", "tdp_w", 1e-300),
    ],
)
def test_item5_cluster_values_that_overflow(tmp_path, capsys, kind, field, value):
    data = json.loads(TINY.read_text())
    i = _node_path(data, kind)
    data["cluster"]["nodes"][i][field] = value
    bad = _write(tmp_path / "c.json", json.dumps(data))
    assert main(["solve", bad, "--policy", "optimal"]) == 2
    assert f"{bad}: cluster.nodes[{i}].{field}: " in _err(capsys)


@pytest.mark.parametrize("demand", [5e-324, 1e300])
def test_item5_multi_tiny_demand(tmp_path, capsys, demand):
    w = {
        "format": "ntp-opt/workloads@1",
        "serving": [{"name": "chat", "throughput": {"4": 3.5}, "demand": demand}],
    }
    bad = _write(tmp_path / "w.json", json.dumps(w))
    assert main(["multi", str(TINY), bad]) == 2
    assert f"{bad}: serving[0].demand:" in _err(capsys)


# --- item 6: bench runner ---------------------------------------------------


def test_item6_second_runner_gets_clean_error(tmp_path, capsys):
    from ntp_opt.app.bench import LOCK
    from ntp_opt.model.safeio import locked

    out = tmp_path / "bench"
    out.mkdir()
    with locked(out / LOCK):  # another runner holds the folder
        argv = ["bench", str(TINY), "--planners", "ntp", "-o", str(out), "--no-best-known"]
        assert main(argv) == 2
    err = _err(capsys)
    assert "locked by another process" in err and str(out) in err
    assert not (out / "results.jsonl").exists()


BAD_ROWS = [
    '{"key": ["a", "b"]}',  # a list as key (was: TypeError)
    "KEY_ONLY",  # the right key and nothing else (was: every later bench failed)
    '{"key": "k", "instance": "tiny", "planner": "ntp", "status": "optimal", "bound": NaN}',
    '{"key": "k", "instance": "tiny", "planner": "ntp", "status": "ok", "gpus": "12"}',
    "[1, 2]",
    "not json at all",
    '{"key": "k", "instance": "tiny", "planner": "ntp", "status": "ok", "gap": [1]}',
]


@pytest.mark.parametrize("bad", BAD_ROWS)
def test_item6_read_rows_reports_file_and_line(tmp_path, bad):
    from ntp_opt.app.bench import read_rows, run_key

    good = {"key": "g", "instance": "tiny", "planner": "ntp", "status": "optimal", "gpus": 12}
    line = json.dumps({"key": run_key(TINY, "ntp", 0)}) if bad == "KEY_ONLY" else bad
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    problems: list[str] = []
    rows = read_rows(path, problems)
    assert len(rows) == 1 and {k: rows[0][k] for k in good} == good
    assert len(problems) == 1 and problems[0].startswith(f"{path}:2: skipped: ")


def test_item6_corrupt_results_rows_skipped_and_redone(tmp_path, capsys):
    from ntp_opt.app.bench import run_key

    out = tmp_path / "bench"
    out.mkdir()
    key = run_key(TINY, "ntp", 0)
    lines = [json.dumps({"key": key}) if b == "KEY_ONLY" else b for b in BAD_ROWS]
    (out / "results.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["bench", str(TINY), "--planners", "ntp", "-o", str(out), "--no-best-known"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    for n in range(1, len(lines) + 1):
        assert f"{out / 'results.jsonl'}:{n}: skipped:" in err
    now = (out / "results.jsonl").read_text().splitlines()
    assert now[: len(lines)] == lines and len(now) == len(lines) + 1  # kept; run redone
    row = json.loads(now[-1])
    assert row["key"] == key and row["status"] in ("optimal", "feasible")


def stuck(instance, time_limit, seed):
    """A planner (``tests.regression.test_hostile:stuck``): says where it is, never returns."""
    Path(os.environ["NTP_OPT_STUCK_PID"]).write_text(str(os.getpid()))
    while True:
        signal.pause()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_item6_worker_dies_with_its_driver(tmp_path):
    out = tmp_path / "bench"
    marker = tmp_path / "worker.pid"
    cmd = [sys.executable, "-m", "ntp_opt.app.cli", "bench", str(TINY), "-o", str(out)]
    cmd += [
        "--planners",
        "tests.regression.test_hostile:stuck",
        "--no-best-known",
        "--timeout",
        "3600",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NTP_OPT_STUCK_PID": str(marker)}
    driver = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    worker = None
    try:
        for _ in _waiting(lambda: marker.exists() and marker.read_text()):
            pass
        worker = int(marker.read_text())
        assert alive(worker)
        driver.kill()  # SIGKILL: no finally runs in the driver
        driver.wait()
        for _ in _waiting(lambda: not alive(worker)):
            pass
    finally:
        if driver.poll() is None:
            driver.kill()
        if worker is not None and alive(worker):
            os.kill(worker, signal.SIGKILL)
            raise AssertionError("the worker outlived its driver")


def _waiting(done, limit: float = 120.0):
    """Poll ``done()`` until true; fail after ``limit`` s (a safety net, not a timing)."""
    import time

    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        time.sleep(0.02)
        yield


# --- item 7: NaN never written, Markdown escaped ----------------------------


def nan_bound(instance, time_limit, seed):
    """A planner (``tests.regression.test_hostile:nan_bound``): a good plan with a NaN bound."""
    import dataclasses

    from ntp_opt.solve import solve

    res = solve(instance, "ntp", time_limit=time_limit, seed=seed)
    return dataclasses.replace(res, bound=float("nan"))


def _strict_json(text: str):
    def refuse(token):
        raise AssertionError(f"{token} written")

    return json.loads(text, parse_constant=refuse)


def test_item7_nan_bound_dropped_and_reported(tmp_path, capsys):
    out = tmp_path / "bench"
    table = tmp_path / "best_known.json"
    argv = [
        "bench",
        str(TINY),
        "--planners",
        "tests.regression.test_hostile:nan_bound",
        "-o",
        str(out),
    ]
    assert main([*argv, "--best-known", str(table)]) == 0
    rows = [_strict_json(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert rows[0]["bound"] is None and "bound nan dropped" in rows[0]["message"]
    assert rows[0]["relative_goodput"] > 0
    entry = _strict_json(table.read_text())["instances"]["tiny"]
    assert entry["bound"] is None and entry["goodput"] == rows[0]["relative_goodput"]


def test_item7_best_known_refuses_nan_and_escapes_names(tmp_path):
    from ntp_opt.app import best_known as bk

    sha = bk.file_sha256(TINY)
    name = "evil | x\n| injected | row |<script>alert(1)</script>"
    row = {
        "key": f"{TINY.resolve()}|fast|0",
        "instance": name,
        "planner": "fast",
        "status": "feasible",
        "sha256": sha,
        "validated": True,
        "relative_goodput": 0.5,
        "bound": float("nan"),
        "gpus": 12,
        "failed": 1,
    }
    path = tmp_path / "best_known.json"
    changes = bk.update(path, [row])
    assert any("bound nan dropped" in c for c in changes)
    table = _strict_json(path.read_text())
    assert table["instances"][name]["bound"] is None
    md = path.with_suffix(".md").read_text()
    body = [x for x in md.splitlines() if x.startswith("| evil")]
    assert len(body) == 1  # one row: the newline did not start another
    assert "<script>" not in md and "&lt;script&gt;" in md
    assert body[0].count("|") - body[0].count("\\|") == 9  # 8 cells, escaped bars inside
    path.write_text(path.read_text().replace('"gpus": 12', '"gpus": NaN'))
    with pytest.raises(ValueError, match="NaN is not valid JSON"):
        bk.load(path)


# --- item 8: the workloads loader is linear ---------------------------------


def test_item8_hundred_thousand_fleets(tmp_path, capsys):
    from ntp_opt.model.files.workloads import load_workloads

    fleets = [{"name": f"f{i}", "throughput": {"4": 1.0}, "demand": 1.0} for i in range(100_000)]
    fleets[99_999]["name"] = "f7"  # the whole list is validated, then the names
    p = tmp_path / "w.json"
    p.write_text(json.dumps({"format": "ntp-opt/workloads@1", "serving": fleets}))
    with pytest.raises(files.InputError, match=r"repeated: \['f7'\]"):
        load_workloads(p)


# --- item 10: strict and consistent parsing ---------------------------------


def _node_path(data, kind="gpu"):
    return next(i for i, n in enumerate(data["cluster"]["nodes"]) if n["kind"] == kind)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["cluster"]["nodes"][_node_path(d)].update(speed=True), ".speed"),
        (lambda d: d["cluster"]["nodes"][_node_path(d)].update(speed="1.0"), ".speed"),
        (lambda d: d["job"].update(tp="4"), "job.tp"),
        (lambda d: d["job"].update(global_batch=8.0), "job.global_batch"),
        (lambda d: d["job"].update(tp_allowed=["3", 4]), "job.tp_allowed"),
        (lambda d: d["job"].update(tp_efficiency={"x": 0.9}), "job.tp_efficiency"),
        (lambda d: d["cluster"]["nodes"][_node_path(d, "domain")].update(size=4.0), ".size"),
    ],
)
def test_item10_strict_types(tmp_path, capsys, mutate, field):
    data = json.loads(TINY.read_text())
    mutate(data)
    bad = _write(tmp_path / "strict.json", json.dumps(data))
    assert main(["info", bad]) == 2
    err = _err(capsys)
    assert f"{bad}: " in err and field in err


def test_item10_strict_types_in_plans(tmp_path, capsys, plan_file):
    data = json.loads(plan_file.read_text())
    data["replicas"][0]["tp"] = "4"
    bad = _write(tmp_path / "p.json", json.dumps(data))
    assert main(["validate", str(TINY), bad]) == 2
    assert "replicas[0].tp: Input should be a valid integer" in _err(capsys)


def test_item10_tp_efficiency_integer_keys_still_load(tmp_path):
    data = json.loads(TINY.read_text())
    data["job"]["tp_efficiency"] = {"3": 0.9}
    p = _write(tmp_path / "ok.json", json.dumps(data))
    assert files.load_instance(p).job.efficiency(3) == 0.9


@pytest.mark.parametrize("where", ["top", "job", "node", "meta"])
def test_item10_duplicate_keys_named(tmp_path, capsys, where):
    text = TINY.read_text()
    needle, dup = {
        "top": ('"format": "ntp-opt/instance@1"', '"format": "ntp-opt/instance@1", '),
        "job": ('"tp": 4', '"tp": 4, '),
        "node": ('"kind": "gpu"', '"kind": "gpu", '),
        "meta": ('"meta": {', '"meta": {"a": 1, "a": 2, '),
    }[where]
    assert needle in text
    if where == "meta":
        text = text.replace(needle, dup, 1)
        key = "a"
    else:
        text = text.replace(needle, dup + needle, 1)
        key = needle.split('"')[1]
    bad = _write(tmp_path / "dup.json", text)
    assert main(["info", bad]) == 2
    assert f"duplicate key {key!r}" in _err(capsys)


@pytest.mark.parametrize("literal", ["1e999", "-1e999", "NaN", "Infinity"])
def test_item10_non_finite_anywhere_refused_at_load(tmp_path, capsys, literal):
    text = TINY.read_text().replace('"meta": {', f'"meta": {{"x": [1, {{"y": {literal}}}], ', 1)
    bad = _write(tmp_path / "inf.json", text)
    assert main(["info", bad]) == 2
    assert f"{bad}: meta.x[1].y: " in _err(capsys)


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["-o", "DIR/.json"], "the file name: an instance name has 1 to 200"),
        (["-o", "DIR/x.json", "--name", "n" * 300], "--name: an instance name has 1 to 200"),
    ],
)
def test_item10_gen_names_refused_up_front(tmp_path, capsys, args, expect):
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    assert main([*GEN, *args]) == 2
    assert expect in _err(capsys)
    assert not list(tmp_path.iterdir())


def test_item10_gen_flag_errors_have_no_pydantic_text(tmp_path, capsys):
    argv = [*GEN, "--global-batch", str(2 * 10**9), "-o", str(tmp_path / "x.json")]
    assert main(argv) == 2
    err = _err(capsys)
    assert "--global-batch: " in err and "pydantic" not in err and "http" not in err


def test_item10_many_problems_one_line(tmp_path, capsys):
    data = json.loads(TINY.read_text())
    for node in data["cluster"]["nodes"]:
        if node["kind"] == "gpu":
            node["speed"] = -1.0
    n = sum(1 for x in data["cluster"]["nodes"] if x["kind"] == "gpu")
    bad = _write(tmp_path / "many.json", json.dumps(data))
    assert main(["info", bad]) == 2
    assert f"(and {n - 1} more problems)" in _err(capsys)


def test_item10_replan_blames_the_right_input(tmp_path, capsys, plan_file):
    ok_events = _write(tmp_path / "e.json", '[{"kind": "fail", "nodes": ["g0"]}]')
    base = ["replan", str(TINY), str(plan_file), "--events", ok_events]
    assert main([*base, "--tolerance", "-1"]) == 2
    err = _err(capsys)
    assert "--tolerance" in err and ok_events not in err
    assert main([*base, "--tolerance", "nan"]) == 2
    assert "--tolerance" in _err(capsys)
    data = json.loads(plan_file.read_text())
    data["replicas"][0]["stages"][0]["gpus"][0] = data["replicas"][0]["stages"][0]["gpus"][1]
    bad_plan = _write(tmp_path / "bad-plan.json", json.dumps(data))
    assert main(["replan", str(TINY), bad_plan, "--events", ok_events]) == 2
    err = _err(capsys)
    assert f"{bad_plan}: not a valid running plan" in err and ok_events not in err


# --- fuzz: mutated valid files load or raise InputError ---------------------

#: Byte strings that often break parsers or slip past checks.
NASTY = [
    b"1e999",
    b"NaN",
    b"-Infinity",
    b"\\u006bind",
    b'"kind"',
    b"\\ud800",
    b"\x00",
    b"\xef\xbb\xbf",
    b"\xff\xfe",
    b"\xc3(",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b'"',
    b"null",
    b"true",
    b"0",
    b"-1",
    b"1" * 30,
    b"[" * 3000,
    b"4.0",
    b'"4"',
]


@st.composite
def mutated_bytes(draw, base: bytes):
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(["insert", "replace", "delete", "byte"]))
        if how == "delete":
            del data[pos : pos + draw(st.integers(1, 40))]
        elif how == "byte":
            if pos < len(data):
                data[pos] = draw(st.integers(0, 255))
        else:
            blob = draw(st.sampled_from(NASTY) | st.binary(min_size=1, max_size=8))
            end = pos + (len(blob) if how == "replace" else 0)
            data[pos:end] = blob
    return bytes(data), draw(st.booleans())


def _fuzz_file(tmp: Path, blob: bytes, gz: bool, name: str) -> Path:
    path = tmp / (name + (".json.gz" if gz else ".json"))
    path.write_bytes(gzip.compress(blob) if gz else blob)
    return path


INSTANCE_BYTES = TINY.read_bytes()


@given(mutated_bytes(INSTANCE_BYTES))
def test_fuzz_loaders_instance(case):
    blob, gz = case
    with TemporaryDirectory() as tmp:
        path = _fuzz_file(Path(tmp), blob, gz, "inst")
        try:
            instance = files.load_instance(path)
        except files.InputError as err:
            assert str(err).startswith(f"{path}: ")
            return
        files.save_instance(instance, Path(tmp) / "again.json")  # what loads, saves


def _plan_bytes() -> bytes:
    from ntp_opt.solve import solve

    res = solve(files.load_instance(TINY), "ntp")
    assert res.plan is not None
    return json.dumps(files.plan_to_dict(res.plan), indent=1).encode()


PLAN_BYTES = _plan_bytes()
TINY_INSTANCE = files.load_instance(TINY)


@given(mutated_bytes(PLAN_BYTES))
def test_fuzz_loaders_plan(case):
    from ntp_opt.rules.validate import evaluate

    blob, gz = case
    with TemporaryDirectory() as tmp:
        path = _fuzz_file(Path(tmp), blob, gz, "plan")
        try:
            plan = files.load_plan(path)
        except files.InputError as err:
            assert str(err).startswith(f"{path}: ")
            return
        evaluate(TINY_INSTANCE, plan)  # a loaded plan can always be judged


EVENTS_BYTES = (
    b'[{"kind": "fail", "nodes": ["g0", "g1"]}, {"kind": "speed", "nodes": [3], "speed": 0.5}]'
)


@given(mutated_bytes(EVENTS_BYTES))
def test_fuzz_loaders_events(case):
    from ntp_opt.app.cli import load_events

    blob, gz = case
    with TemporaryDirectory() as tmp:
        path = _fuzz_file(Path(tmp), blob, gz, "events")
        try:
            load_events(str(path))
        except files.InputError as err:
            assert str(err).startswith(f"{path}: ")


def test_item10_export_rank_file_stays_beside_the_config(tmp_path, plan_file):
    from ntp_opt.app.export import RANKS_NAME, import_megatron

    out = tmp_path / "launch"
    argv = ["export", str(plan_file), "--to", "megatron-ntp", "--instance", str(TINY)]
    assert main([*argv, "--equal-batch", "-o", str(out)]) == 0
    import_megatron(out)  # reads back
    # the reader takes the rank file beside the config only, never another path
    (tmp_path / RANKS_NAME).write_text((out / RANKS_NAME).read_text())
    (out / RANKS_NAME).unlink()
    with pytest.raises(files.InputError, match=str(out / RANKS_NAME)):
        import_megatron(out)


def test_item10_gen_refuses_what_could_not_be_loaded(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(caps, "MAX_NODES", 70)  # 64 GPUs + trays, domains, racks > 70
    assert main([*GEN, "-o", str(tmp_path / "x.json")]) == 2
    assert "an instance file holds at most 70" in _err(capsys)
    assert main(["gen", "--gpus", "96", "--tp", "8", "-o", str(tmp_path / "x.json")]) == 2
    assert "--gpus: at most 70 GPUs" in _err(capsys)
    assert not list(tmp_path.iterdir())


ROW_BYTES = (
    json.dumps({"key": "k", "instance": "tiny", "planner": "ntp", "status": "optimal", "gpus": 12})
    + "\n"
).encode()


@given(mutated_bytes(ROW_BYTES * 3))
def test_fuzz_loaders_bench_rows(case):
    from ntp_opt.app.bench import read_rows

    blob, _ = case
    with TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.jsonl"
        path.write_bytes(blob)
        problems: list[str] = []
        rows = read_rows(path, problems)
        for row in rows:  # every row kept is usable by the summary and the table
            assert isinstance(row["key"], str) and isinstance(row["status"], str)
        assert all(p.startswith(f"{path}:") for p in problems)
        from ntp_opt.app.bench import summary

        summary(rows)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--tdp-w", "0.5"], ".tdp_w"),
        (["--stragglers", "2", "--straggler-speed", "1e-9"], ".speed"),
        (["--tdp-w", "1000000", "--rack-power-factor", "100000"], ".power_budget_w"),
    ],
)
def test_item10_gen_never_writes_an_unloadable_file(tmp_path, capsys, flags, field):
    out = tmp_path / "x.json"
    assert main([*GEN, *flags, "-o", str(out)]) == 2
    err = _err(capsys)
    assert "not written" in err and field in err
    assert not out.exists()
