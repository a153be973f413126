"""Hostile inputs and failures (issue 18, the file and command-line half).

Item of issue 18 -> tests here (the service half, items 2 and 3, is tested
with the service):

| item | what | tests |
|---|---|---|
| 1 | `-o` onto devices, FIFOs, symlinks, inputs; mode kept; planted export temp | test_item1_* |
| 4 | gzip / parse bombs, escapes, encodings | test_item4_* |
| 5 | clean errors (huge ints, bad events, gen/serve flags, overflow) | test_item5_* |
| 6 | bench lock, workers die with driver, corrupt rows | test_item6_* |
| 7 | NaN never written, names escaped in Markdown | test_item7_* |
| 8 | workloads loader linear | test_item8_* |
| 9 | SIGTERM / SIGINT during a save leave no temp file | test_item9_* |
| 10 | strict types, duplicate keys, BOM/UTF-16, 1e999, names, one-line errors | test_item10_* |
| fuzz | mutated valid files load or raise InputError | test_fuzz_loaders_* |
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ntp_opt.cli import main
from ntp_opt.safeio import UnsafeTargetError, atomic_append, atomic_write, save_figure

ROOT = Path(__file__).resolve().parent.parent
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


def test_item1_export_ignores_planted_temp_symlink(tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["solve", str(TINY), "--policy", "ntp", "-o", str(plan)]) == 0
    out = tmp_path / "launch"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in (".ranks.txt.tmp", ".megatron-ntp.json.tmp"):
        (out / name).symlink_to(victim)
    status = main(
        ["export", str(plan), "--to", "megatron-ntp", "--instance", str(TINY), "-o", str(out)]
    )
    assert status == 0, capsys.readouterr()
    assert victim.read_text() == "precious"
    assert (out / "ranks.txt").read_text().startswith("# ")
    assert not (out / "ranks.txt").is_symlink()


def test_item1_write_error_names_the_users_path(tmp_path, capsys, monkeypatch):
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ntp_opt.safeio.os.fsync", full)
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
import ntp_opt.files as files
from ntp_opt import safeio
from ntp_opt.cli import main

@contextlib.contextmanager
def paused(path, inputs=()):
    with safeio.atomic_open(path, inputs) as fh:
        fh.write(b'{"partial": ')
        fh.flush()
        print("WRITING", flush=True)
        sys.stdin.readline()  # blocks until the test signals us
        yield fh

files.atomic_open = paused
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
