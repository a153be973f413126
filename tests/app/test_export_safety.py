"""Exports that cannot run a name, lose a file, or stop half-way.

Hostile names (instance name, host names, tray / GPU / domain / rack ids) either
make the export refuse (rules ``megatron-hosts`` / ``megatron-ids``) or reach
the files only as inert text: the generated ``ntp_config.py`` is imported and
the generated scripts are run (in a sandbox folder, with ``nvidia-smi`` and
``torchrun`` replaced by stubs on ``PATH``), and a sentinel file that every
payload would create must not exist afterwards. ``LAUNCH.md`` must keep exactly
its own fences.

The writer (``write_launch_set``) is all-or-nothing: a disk that fills up after
``k`` files, an interrupt, or a refusal leave the old directory as it was and
no temporary directory behind; files the user put there are kept.
"""

from __future__ import annotations

import ast
import errno
import os
import signal
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import networkx as nx
import pytest

from ntp_opt.app.cli import main
from ntp_opt.app.export import (
    CONFIG_NAME,
    EXTRAS_NAME,
    LAUNCH_NAME,
    MANIFEST_NAME,
    POWER_RESTORE_NAME,
    POWER_SET_NAME,
    RANKS_NAME,
    TORCHRUN_HOSTS_NAME,
    TORCHRUN_NAME,
    RankRow,
    export_megatron,
    import_megatron,
    md_code,
    megatron_export,
    power_commands,
    power_only,
    write_launch_set,
)
from ntp_opt.app.export import megatron as megatron_mod
from ntp_opt.app.export import writing as writing_mod
from ntp_opt.model import topology
from ntp_opt.model.files import save_instance, save_plan
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.model.safeio import UnsafeTargetError
from ntp_opt.planners.megatron import MegatronError
from ntp_opt.rules.validate import certified

ROOT = Path(__file__).resolve().parents[2]

# --- a small export with every kind of file -----------------------------------------
#
# 3 domains of 4 GPUs in trays (hosts) of 2; d0.t0.g1 failed. Replica 0: TP3 on
# d0's three healthy GPUs at power 1.2 (boosted: the power scripts have lines);
# replica 1: TP4 on d1. The inactive rank of replica 0 runs on idle host d2.t0.


def _graph(rename: dict[str, str] | None = None, hosts: dict[str, str] | None = None) -> nx.Graph:
    g = topology.build_cluster(3, 4, 2, 2, rack_power_factor=1.5)
    topology.fail_gpus(g, ["d0.t0.g1"])
    for tray, host in (hosts or {}).items():
        g.nodes[tray]["host"] = host
    return nx.relabel_nodes(g, rename) if rename else g


def _instance(name: str = "safe", **kw: Any) -> Instance:
    job = Job(tp=4, tp_min=3, tp_allowed=(3, 4), pp=1, dp=2, global_batch=8, max_local_batch=4)
    return Instance(name, _graph(**kw), job)


def _plan(inst: Instance, rename: dict[str, str] | None = None) -> Plan:
    r = rename or {}

    def n(x: str) -> str:
        return r.get(x, x)

    small = Replica(
        3, 4, (Stage(n("d0"), tuple(map(n, ["d0.t0.g0", "d0.t1.g0", "d0.t1.g1"])), 1.2),)
    )
    full = Replica(4, 4, (Stage(n("d1"), tuple(n(f"d1.t{i // 2}.g{i % 2}") for i in range(4))),))
    return certified(inst, Plan(inst.name, (small, full)))


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.name: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def _leftovers(parent: Path, name: str) -> list[str]:
    """Staging directories left beside or inside ``parent / name``."""
    found = [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]
    if (parent / name).is_dir():
        found += [p.name for p in (parent / name).iterdir() if p.name.startswith(".ntp-opt-stage")]
    return sorted(found)


# --- item 5: nothing from an instance runs -------------------------------------------

SENTINEL = "PWNED"


def _hostile(sentinel: Path) -> list[str]:
    s = str(sentinel)
    return [
        '"""',
        "'''",
        "a\nb",
        f"$(touch {s})",
        f"`touch {s}`",
        f"; touch {s}",
        f"x\n```sh\ntouch {s}\n```\n",
        "x\u2028y\u2029z",
        "x\x00y",
        f'\\"""\nimport os; os.system("touch {s}")\n"""',
        f"'; import os; os.system('touch {s}'); '",
        "-rf",
        " ",
        "\\N{BULLET}\\x41",
    ]


def _stub_path(tmp: Path) -> dict[str, str]:
    """An environment whose PATH starts with stubs of nvidia-smi and torchrun (log only)."""
    stubs = tmp / "stubs"
    stubs.mkdir(exist_ok=True)
    for tool in ("nvidia-smi", "torchrun"):
        p = stubs / tool
        p.write_text(f'#!/bin/sh\necho {tool} "$@" >> "{tmp}/calls.log"\n')
        p.chmod(0o755)
    return {"PATH": f"{stubs}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(tmp)}


def _assert_inert(out: Path, tmp: Path, sentinel: Path) -> None:
    """Import ntp_config.py, run every script on every host; the sentinel stays absent."""
    config = (out / CONFIG_NAME).read_text()
    tree = ast.parse(config)
    kinds = [type(node).__name__ for node in tree.body]
    assert kinds == ["Expr", "Assign", "FunctionDef"], kinds  # docstring, literal, function
    ast.literal_eval(tree.body[1].value)  # type: ignore[attr-defined]
    probe = "import ntp_config; print(sorted(ntp_config.NTP_CONFIG_KWARGS))"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=out,
        env={**os.environ, "PYTHONPATH": str(out)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # LAUNCH.md: its own four fences, no other
    fences = [line.strip() for line in (out / LAUNCH_NAME).read_text().splitlines()]
    assert [f for f in fences if f.startswith("```")] == ["```python", "```", "```sh", "```"]
    env = _stub_path(tmp)
    hosts = {line.split()[1] for line in (out / RANKS_NAME).read_text().splitlines()[1:]}
    scripts = [POWER_SET_NAME, POWER_RESTORE_NAME]
    for host in sorted(hosts):
        for script in scripts:
            if (out / script).exists():
                r = subprocess.run(
                    ["bash", str(out / script)],
                    cwd=tmp,
                    env={**env, "NTP_HOST": host},
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert r.returncode == 0, r.stderr
        ranks = [line.split() for line in (out / RANKS_NAME).read_text().splitlines()[1:]]
        first = next(int(c[0]) for c in ranks if c[1] == host)
        r = subprocess.run(
            ["bash", str(out / "bind.sh"), "true"],
            cwd=tmp,
            env={**env, "SLURMD_NODENAME": host, "SLURM_PROCID": str(first)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        if (out / TORCHRUN_NAME).exists():
            r = subprocess.run(
                ["bash", str(out / TORCHRUN_NAME), "true"],
                cwd=tmp,
                env={**env, "NTP_HOST": host, "MASTER_ADDR": "localhost"},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
    assert not sentinel.exists()
    assert "nvidia-smi -i" in (tmp / "calls.log").read_text()  # the scripts did run


def test_instance_name_never_runs(tmp_path: Path) -> None:
    sentinel = tmp_path / SENTINEL
    for k, name in enumerate(_hostile(sentinel)):
        inst = _instance(name)
        out = tmp_path / f"out{k}"
        export_megatron(inst, _plan(inst), out)
        _assert_inert(out, tmp_path, sentinel)
        head = (out / LAUNCH_NAME).read_text().splitlines()[0]
        assert head.startswith("# Launching the ntp-opt plan of `")
        assert import_megatron(out, inst).replicas == _plan(inst).replicas


@pytest.mark.parametrize("where", ["host", "tray", "gpu", "domain", "rack"])
def test_hostile_ids_refused_or_inert(tmp_path: Path, where: str) -> None:
    """Every hostile id is either refused by rule or (racks: never written) inert."""
    sentinel = tmp_path / SENTINEL
    for k, bad in enumerate(_hostile(sentinel)):
        rename: dict[str, str] = {}
        hosts: dict[str, str] = {}
        if where == "host":
            hosts = {"d0.t1": bad}
        elif where == "tray":
            rename = {"d0.t1": bad}
        elif where == "gpu":
            rename = {"d0.t1.g0": bad}
        elif where == "domain":
            rename = {"d1": bad}
        else:
            g = _graph()
            rack = next(n for n, a in g.nodes(data=True) if a.get("kind") == "rack")
            rename = {rack: bad}
        inst = Instance("hostile", _graph(rename=rename, hosts=hosts), _instance().job)
        plan = _plan(inst, rename)
        out = tmp_path / f"out{k}"
        try:
            export_megatron(inst, plan, out)
        except MegatronError as err:
            assert where != "rack", err
            assert {v.rule for v in err.violations} <= {"megatron-hosts", "megatron-ids"}
            assert not out.exists()  # refused before anything was written
            with pytest.raises(MegatronError):
                power_only(inst, plan, out) if where in ("host", "tray") else (
                    megatron_export(inst, plan)
                )
            continue
        assert where == "rack", f"{where} {bad!r} was written"
        _assert_inert(out, tmp_path, sentinel)


def test_hostile_names_through_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through instance files and the CLI: refused with one line, or exported inert."""
    sentinel = tmp_path / SENTINEL
    for k, bad in enumerate(_hostile(sentinel)):
        for where in ("name", "host"):
            inst = _instance(bad) if where == "name" else _instance(hosts={"d2.t0": bad})
            ipath, ppath = tmp_path / f"i{k}{where}.json", tmp_path / f"p{k}{where}.json"
            save_instance(inst, ipath)
            save_plan(_plan(inst), ppath)
            out = tmp_path / f"o{k}{where}"
            argv = ["export", str(ppath), "--to", "megatron-ntp", "--instance", str(ipath)]
            status = main([*argv, "-o", str(out)])
            err = capsys.readouterr().err
            assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
            if where == "host":  # the idle host d2.t0 would run the placeholder
                assert status == 2 and "megatron-hosts" in err, err
                assert not out.exists()
            elif status == 0:
                _assert_inert(out, tmp_path, sentinel)
            else:
                assert status == 2 and not out.exists()
    assert not sentinel.exists()


def test_power_scripts_take_only_whitelisted_hosts(tmp_path: Path) -> None:
    """``power_commands`` itself refuses a host outside the whitelist (last gate)."""
    row = RankRow(0, "h1", 0, "g", "d", 0, 0, 0, True, 1.2, 1200)
    assert "h1)" in power_commands([row], False, {("h1", 0): 1000})
    for bad in _hostile(tmp_path / SENTINEL):
        with pytest.raises(MegatronError, match="megatron-hosts"):
            power_commands([replace(row, host=bad)], False, {(bad, 0): 1000})
    with pytest.raises(MegatronError, match="megatron-hosts"):
        power_commands([replace(row, device=-1)], False, {("h1", -1): 1000})


def test_power_only_ignores_ids_it_does_not_write(tmp_path: Path) -> None:
    """GPU and domain ids never reach the power scripts: odd ids do not block them."""
    sentinel = tmp_path / SENTINEL
    rename = {"d0.t1.g0": f"$(touch {sentinel})", "d1": "a b"}
    inst = Instance("odd", _graph(rename=rename), _instance().job)
    out = tmp_path / "power"
    power_only(inst, _plan(inst, rename), out)
    env = _stub_path(tmp_path)
    for host in ("d0.t0", "d0.t1"):
        r = subprocess.run(
            ["bash", str(out / POWER_SET_NAME)],
            cwd=tmp_path,
            env={**env, "NTP_HOST": host},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
    assert not sentinel.exists()
    # by hand: d0's three GPUs at power 1.2 of 1000 W; d0.t0.g0 is device 0 of d0.t0
    assert "nvidia-smi -i 0 -pl 1200" in (tmp_path / "calls.log").read_text()


def test_md_code_keeps_a_name_on_one_code_span() -> None:
    # by hand: the span's fence is longer than any backtick run inside
    assert md_code("plain") == "`plain`"
    assert md_code("a`b") == "``a`b``"
    assert md_code("``x") == "``` ``x ```"
    assert md_code("a\nb\u2028c\x00") == "`a\\u000ab\\u2028c\\u0000`"


# --- item 6: all or nothing ----------------------------------------------------------


def _fill_disk_after(monkeypatch: pytest.MonkeyPatch, k: int) -> list[str]:
    """Make the writer's k+1-th new file fail with ENOSPC (after writing half of it)."""
    real = writing_mod._write_new
    written: list[str] = []

    def write(path: Path, data: bytes, mode: int) -> None:
        if len(written) >= k:
            real(path, data[: len(data) // 2], mode)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(path.name)
        real(path, data, mode)

    monkeypatch.setattr(writing_mod, "_write_new", write)
    return written


@pytest.mark.parametrize("k", [0, 1, 5, 11])
def test_disk_full_mid_export_keeps_the_old_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    inst = _instance()
    out = tmp_path / "launch"
    export_megatron(inst, _plan(inst), out)
    (out / "notes.txt").write_text("mine\n")
    before = _snapshot(out)
    other = Instance("other", inst.cluster, inst.job)  # another name: other bytes
    written = _fill_disk_after(monkeypatch, k)
    with pytest.raises(OSError) as err:
        export_megatron(other, _plan(other), out)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(out)
    assert len(written) == k
    assert _snapshot(out) == before
    assert _leftovers(tmp_path, "launch") == []


def test_interrupt_mid_export_keeps_the_old_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inst = _instance()
    out = tmp_path / "launch"
    export_megatron(inst, _plan(inst), out)
    before = _snapshot(out)
    real = writing_mod._write_new
    calls: list[int] = []

    def write(path: Path, data: bytes, mode: int) -> None:
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real(path, data, mode)

    monkeypatch.setattr(writing_mod, "_write_new", write)
    other = Instance("other", inst.cluster, inst.job)
    with pytest.raises(KeyboardInterrupt):
        export_megatron(other, _plan(other), out)
    assert _snapshot(out) == before
    assert _leftovers(tmp_path, "launch") == []


def test_refused_export_leaves_a_user_file(tmp_path: Path) -> None:
    inst = _instance()
    out = tmp_path / "launch"
    out.mkdir()
    (out / TORCHRUN_NAME).write_text("#!/bin/sh\necho my own launcher\n")
    small, full = _plan(inst).replicas
    swapped = certified(inst, Plan(inst.name, (full, small)))  # reduced after full: refused
    with pytest.raises(MegatronError, match="megatron-order"):
        export_megatron(inst, swapped, out)
    assert (out / TORCHRUN_NAME).read_text() == "#!/bin/sh\necho my own launcher\n"
    # a valid export that would write torchrun.sh over it is refused, nothing written
    with pytest.raises(UnsafeTargetError, match="no previous export"):
        export_megatron(inst, _plan(inst), out)
    assert sorted(p.name for p in out.iterdir()) == [TORCHRUN_NAME]
    assert _leftovers(tmp_path, "launch") == []


def test_user_files_kept_stale_export_files_removed(tmp_path: Path) -> None:
    inst = _instance()
    out = tmp_path / "launch"
    export_megatron(inst, _plan(inst), out)
    assert (out / TORCHRUN_NAME).exists() and (out / MANIFEST_NAME).exists()
    (out / "pretrain_gpt_ntp.py").write_text("print('mine')\n")
    os.symlink("pretrain_gpt_ntp.py", out / "link.py")
    (out / CONFIG_NAME).chmod(0o600)
    # the same directory again, as a previous export: replaced, the user's files kept
    export_megatron(inst, _plan(inst), out)
    assert (out / "pretrain_gpt_ntp.py").read_text() == "print('mine')\n"
    assert os.readlink(out / "link.py") == "pretrain_gpt_ntp.py"
    assert stat.S_IMODE((out / CONFIG_NAME).stat().st_mode) == 0o600  # kept its bits
    for script in ("bind.sh", TORCHRUN_NAME, POWER_SET_NAME, POWER_RESTORE_NAME):
        assert os.access(out / script, os.X_OK), script
    # a set without torchrun files: the previous export's are removed, the user's not
    files = {k: v for k, v in megatron_export(inst, _plan(inst)).files.items()}
    del files[TORCHRUN_NAME], files[TORCHRUN_HOSTS_NAME]
    write_launch_set(files, out)
    names = {p.name for p in out.iterdir()}
    assert TORCHRUN_NAME not in names and TORCHRUN_HOSTS_NAME not in names
    assert {"pretrain_gpt_ntp.py", "link.py", EXTRAS_NAME} <= names
    # a subdirectory of the user's stays as it is
    (out / "data").mkdir()
    (out / "data" / "x.bin").write_bytes(b"\0\1")
    export_megatron(inst, _plan(inst), out)
    assert (out / "data" / "x.bin").read_bytes() == b"\0\1"
    assert _leftovers(tmp_path, "launch") == []


def test_failed_commit_is_undone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rename that fails half-way through the commit: every file is put back."""
    inst = _instance()
    out = tmp_path / "launch"
    export_megatron(inst, _plan(inst), out)
    before = _snapshot(out)
    real = os.rename
    calls: list[str] = []

    def rename(src: Any, dst: Any) -> None:
        calls.append(str(src))
        if len(calls) == 7:  # three files moved out, three in: fail on the fourth
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(src, dst)

    other = Instance("other", inst.cluster, inst.job)
    monkeypatch.setattr(writing_mod.os, "rename", rename)
    with pytest.raises(OSError) as err:
        export_megatron(other, _plan(other), out)
    monkeypatch.undo()
    assert err.value.errno == errno.EIO and err.value.filename == str(out)
    assert _snapshot(out) == before
    assert _leftovers(tmp_path, "launch") == []


def test_sigterm_waits_for_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM arriving during the renames is delivered after them: the set is whole."""

    class Stop(Exception):
        pass

    def stop(signum: int, frame: object) -> None:
        raise Stop

    inst = _instance()
    out = tmp_path / "launch"
    export_megatron(inst, _plan(inst), out)
    real = os.rename
    calls: list[int] = []

    def rename(src: Any, dst: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        real(src, dst)

    other = Instance("other", inst.cluster, inst.job)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        monkeypatch.setattr(writing_mod.os, "rename", rename)
        with pytest.raises(Stop):
            export_megatron(other, _plan(other), out)
        monkeypatch.undo()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(calls) > 2  # the commit went on after the signal was sent
    assert _snapshot(out) == _snapshot_of(megatron_export(other, _plan(other)).files, out)
    assert _leftovers(tmp_path, "launch") == []


def _snapshot_of(files: dict[str, str], out: Path) -> dict[str, tuple[bytes, int]]:
    """``files`` as :func:`_snapshot` would see them in ``out`` (modes taken from disk)."""
    snap = _snapshot(out)
    want = {n: (t.encode(), snap[n][1]) for n, t in files.items() if n in snap}
    return {**{n: v for n, v in snap.items() if n not in files}, **want}


def test_old_export_without_manifest_is_still_a_previous_export(tmp_path: Path) -> None:
    inst = _instance()
    out = tmp_path / "launch"
    export_megatron(inst, _plan(inst), out)
    (out / MANIFEST_NAME).unlink()  # as written before manifests existed
    export_megatron(inst, _plan(inst), out)
    assert (out / MANIFEST_NAME).exists()


@pytest.mark.parametrize(
    "manifest",
    [b"[1, 2]", b"{", b'{"format": "x", "files": ["ranks.txt"]}', b'{"files": 3}', b"\xff"],
)
def test_a_bad_manifest_makes_no_previous_export(tmp_path: Path, manifest: bytes) -> None:
    """A manifest that is not ours owns nothing: the files it names are not replaced."""
    inst = _instance()
    out = tmp_path / "launch"
    export_megatron(inst, _plan(inst), out)
    (out / EXTRAS_NAME).unlink()  # no sidecar to fall back on either
    (out / MANIFEST_NAME).write_bytes(manifest)
    before = _snapshot(out)
    with pytest.raises(UnsafeTargetError, match="no previous export"):
        export_megatron(inst, _plan(inst), out)
    assert _snapshot(out) == before and _leftovers(tmp_path, "launch") == []


def test_power_limits_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inst = _instance()
    out = tmp_path / "power"
    _fill_disk_after(monkeypatch, 1)  # power-limits.sh written, power-restore.sh fails
    with pytest.raises(OSError):
        power_only(inst, _plan(inst), out)
    assert not out.exists() and _leftovers(tmp_path, "power") == []
    monkeypatch.undo()
    assert power_only(inst, _plan(inst), out) == [POWER_SET_NAME, POWER_RESTORE_NAME]
    assert "nvidia-smi -i" in (out / POWER_SET_NAME).read_text()


@pytest.mark.parametrize(
    ("flags", "option"),
    [
        (["--placeholder-gpus", "30000000"], "--placeholder-gpus"),
        (["--placeholder-gpus", "0"], "--placeholder-gpus"),
        (["--placeholder-gpus", "-3"], "--placeholder-gpus"),
        (["--placeholder-hosts", ",".join(f"h{i}" for i in range(20000))], "--placeholder-hosts"),
        (
            [
                "--placeholder-hosts",
                ",".join(f"h{i}" for i in range(2000)),
                "--placeholder-gpus",
                "1000",
            ],
            "--placeholder-hosts x --placeholder-gpus",
        ),
    ],
)
def test_counts_are_bounded_before_anything_is_built(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    option: str,
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the placeholder rows were built")

    monkeypatch.setattr(megatron_mod, "placeholder_rows", never)
    inst = _instance()
    ipath, ppath = tmp_path / "i.json", tmp_path / "p.json"
    save_instance(inst, ipath)
    save_plan(_plan(inst), ppath)
    argv = ["export", str(ppath), "--to", "megatron-ntp", "--instance", str(ipath)]
    assert main([*argv, "-o", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ntp-opt: error: ") and option in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_world_size_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = _instance()
    monkeypatch.setattr(megatron_mod, "MAX_WORLD", 7)  # the world here has 8 ranks
    with pytest.raises(MegatronError, match="8 ranks"):
        megatron_export(inst, _plan(inst))
