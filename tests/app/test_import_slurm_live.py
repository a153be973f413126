"""``ntp-opt import slurm`` against a real Slurm: tree topology, every node state it makes, --live.

``cluster`` (module fixture) runs ``tests/slurm_cluster.py`` as a DGX-like cluster:
10 nodes of 8 GPUs under two leaf switches of ``topology/tree`` (``nvl0``: n1-n5,
``nvl1``: n6-n10), n10 registering one GPU short (``INVALID_REG``), one
``State=FUTURE`` node under leaf ``fut0``, and ``/bin/true`` as reboot, suspend and
resume program, so that ``scontrol reboot`` and ``state=power_down`` work. All
tests that use it live in this file (``pytest -n 4 --dist loadfile`` gives it
to one worker). States are driven with ``scontrol``/``sbatch`` and waited for by
polling ``scontrol show node`` (a bounded number of polls), then the importer's
classification is asserted; states this Slurm cannot make are tested from
recorded text in ``tests/app/test_import_slurm.py``.

Without Slurm the tests skip, except with ``CI=true``, where they fail.
"""

from __future__ import annotations

import getpass
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ntp_opt.app.cli import main
from ntp_opt.app.importers.slurm_nodes import classify_state, read_nodes, scontrol
from tests.slurm_cluster import MAX_POLLS, POLL_S, SlurmCluster, running

GPUS = 8
JOB = {"tp": 8, "pp": 1, "dp": 1, "global_batch": 4}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """10 DGX-like nodes (8 GPUs) under leaves nvl0/nvl1, n10 one GPU short, a FUTURE node."""
    with running(
        tmp_path_factory.mktemp("slurm-live"),
        nodes=10,
        gpus=GPUS,
        spares=0,
        leaves=2,
        future=1,
        short=1,
        admin=True,
        tie_to_parent=True,
    ) as c:
        yield c


@pytest.fixture
def live_env(cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """This process's environment points scontrol at ``cluster`` (SLURM_CONF, PATH)."""
    for k, v in cluster.env().items():
        monkeypatch.setenv(k, v)
    return cluster


def _state(c: SlurmCluster, node: str) -> str:
    out = c.run("scontrol", "show", "node", "--oneliner", node).stdout
    return read_nodes_text(out)[node]


def read_nodes_text(text: str) -> dict[str, str]:
    """Node -> State of scontrol output, read by the importer's reader."""
    from ntp_opt.app.importers.slurm_nodes import Source

    return {n.name: n.state for n in read_nodes(Source(text, "scontrol"))}


def _wait_state(c: SlurmCluster, node: str, want: str) -> str:
    """Poll until ``node`` shows state ``want`` (bounded); the last state seen."""
    seen = ""
    for _ in range(MAX_POLLS):
        seen = _state(c, node)
        if seen == want:
            return seen
        time.sleep(POLL_S)
    raise AssertionError(f"{node}: state {want} never showed (last {seen})")


def _import(tmp_path: Path, *extra: str) -> tuple[int, dict[str, object], str]:
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB))
    out = tmp_path / "inst.json"
    if out.exists():
        out.unlink()
    # the test cluster's Gres has no GPU type: the power of its GPUs is given (700 W
    # H100 boards), never guessed
    power = ["--tdp-w", "700", "--max-power-w", "700"]
    code = main(["import", "slurm", *extra, *power, "--job", str(job), "-o", str(out)])
    data = json.loads(out.read_text()) if out.exists() else {}
    return code, data, str(out)


def _gpus(inst: dict[str, object]) -> dict[str, dict[str, object]]:
    nodes = inst["cluster"]["nodes"]  # type: ignore[index]
    return {n["id"]: n for n in nodes if n["kind"] == "gpu"}  # type: ignore[union-attr]


def _failed_hosts(inst: dict[str, object]) -> set[str]:
    return {str(g["host"]) for g in _gpus(inst).values() if g["state"] == "failed"}


def test_tree_dgx_cluster_live_and_saved(
    live_env: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh cluster: --live and the saved scontrol output give the same instance."""
    c = live_env
    n = {i: f"{c.tag}n{i}" for i in range(1, 11)}
    future = f"{c.tag}f1"
    topo = c.run("scontrol", "show", "topology").stdout
    # Slurm 22.05's format, checked here against the real scontrol: Level, LinkSpeed,
    # and the upper switch listing every node below it besides its Switches
    assert f"SwitchName=nvl0 Level=0 LinkSpeed=1 Nodes={n[1]},{n[2]}" in topo
    assert "SwitchName=top Level=1 LinkSpeed=1 Nodes=" in topo and "Switches=nvl0,nvl1" in topo
    nodes_txt = c.run("scontrol", "show", "node", "--oneliner", "--future").stdout
    states = read_nodes_text(nodes_txt)
    assert states[n[10]] == "UNKNOWN+DRAIN+INVALID_REG"  # registered with 7 of its 8 GPUs
    assert states[future] == "FUTURE"
    (tmp_path / "topology.txt").write_text(topo)
    (tmp_path / "nodes.txt").write_text(nodes_txt)

    code, live, _ = _import(tmp_path, "--live")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "each 8-GPU host is taken as one NVLink domain" in err
    assert f"host {n[10]} is UNKNOWN+DRAIN+INVALID_REG in Slurm" in err
    code, saved, _ = _import(
        tmp_path,
        "--topology",
        str(tmp_path / "topology.txt"),
        "--nodes",
        str(tmp_path / "nodes.txt"),
    )
    assert code == 0
    assert live["cluster"] == saved["cluster"]

    kinds: dict[str, list[dict[str, object]]] = {}
    for node in live["cluster"]["nodes"]:  # type: ignore[index]
        kinds.setdefault(node["kind"], []).append(node)
    hosts = [*n.values(), future]
    assert len(kinds["gpu"]) == GPUS * len(hosts)
    assert {d["id"]: d["size"] for d in kinds["domain"]} == {f"{h}/nvlink": GPUS for h in hosts}
    assert {r["id"] for r in kinds["rack"]} == {"nvl0", "nvl1", "fut0"}
    edges = {(e["source"], e["target"]) for e in live["cluster"]["edges"]}  # type: ignore[index]
    assert (n[3], "nvl0") in edges or ("nvl0", n[3]) in edges
    assert (n[6], "nvl1") in edges or ("nvl1", n[6]) in edges
    assert _failed_hosts(live) == {n[10], future}

    code, leaf, _ = _import(tmp_path, "--live", "--nvlink", "leaf")
    assert code == 0
    domains = {d["id"]: d["size"] for d in leaf["cluster"]["nodes"] if d["kind"] == "domain"}  # type: ignore[index]
    assert domains == {"nvl0": 5 * GPUS, "nvl1": 5 * GPUS, "fut0": GPUS}

    # --live with a --topology file: the file wins (here a block of the first five)
    block = tmp_path / "block.conf"
    block.write_text(f"BlockName=nvlA Nodes={c.tag}n[1-5]\n")
    code, blk, _ = _import(tmp_path, "--live", "--topology", str(block))
    assert code == 0
    assert {d["id"] for d in blk["cluster"]["nodes"] if d["kind"] == "domain"} == {"nvlA"}  # type: ignore[index]


def test_every_state_this_slurm_makes(
    live_env: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Drive each state with scontrol/sbatch, wait for it, check the importer's reading."""
    c = live_env
    n = {i: f"{c.tag}n{i}" for i in range(1, 11)}
    sbatch = ["sbatch", "-p", c.tag, "-o", "/dev/null", "--wrap", "sleep 600"]
    c.run("scontrol", "update", f"nodename={n[1]}", "state=drain", "reason=GPU Xid 79")
    c.run("scontrol", "update", f"nodename={n[2]}", "state=fail", "reason=ECC errors")
    c.run(*sbatch[:1], "-w", n[3], "-n", "1", *sbatch[1:])
    c.run(*sbatch[:1], "-w", n[4], "--exclusive", *sbatch[1:])
    c.run(
        "scontrol", "create", "reservation", "reservationname=maint", "starttime=now",
        "duration=120", "flags=maint", f"users={getpass.getuser()}", f"nodes={n[5]}",
    )  # fmt: skip
    c.run(
        "scontrol", "create", "reservation", "reservationname=team", "starttime=now",
        "duration=120", f"users={getpass.getuser()}", f"nodes={n[8]}",
    )  # fmt: skip
    c.run("scontrol", "update", f"nodename={n[7]}", "state=power_down", "reason=power saving")
    c.run("scontrol", "update", f"nodename={n[9]}", "state=down", "reason=cable")
    _wait_state(c, n[3], "MIXED")
    c.run("scontrol", "reboot", n[3])  # busy: the reboot waits for the job
    c.run("scontrol", "reboot", n[6])  # idle: issued at once
    # state word(s) the real slurmctld shows -> usable by default, usable with every --allow
    want = {
        n[1]: ("IDLE+DRAIN", False, False),
        n[2]: ("IDLE+FAIL", False, False),
        n[3]: ("MIXED+REBOOT_REQUESTED", False, True),
        n[4]: ("ALLOCATED", True, True),
        n[5]: ("IDLE+MAINTENANCE+RESERVED", False, True),
        n[6]: ("DOWN+REBOOT_ISSUED", False, False),
        n[7]: ("IDLE+POWERED_DOWN", False, True),
        n[8]: ("IDLE+RESERVED", False, True),
        n[9]: ("DOWN", False, False),
        n[10]: ("UNKNOWN+DRAIN+INVALID_REG", False, False),
    }
    every = ("reserved", "powered-down", "reboot")
    for node, (state, usable, allowed) in want.items():
        got = _wait_state(c, node, state)
        assert classify_state(got).usable is usable, got
        assert classify_state(got, every).usable is allowed, got

    code, inst, _ = _import(tmp_path, "--live")
    err = capsys.readouterr().err
    assert code == 0, err
    usable = {h for h, (_, u, _) in want.items() if u}
    assert _failed_hosts(inst) == set(want) - usable | {f"{c.tag}f1"}
    assert f"host {n[1]} is drained for a GPU reason ('GPU Xid 79" in err
    assert "--allow reserved if the job will run in that reservation" in err
    assert "--allow powered-down if power saving boots the node" in err

    allow = [a for k in every for a in ("--allow", k)]
    code, inst, _ = _import(tmp_path, "--live", *allow)
    err = capsys.readouterr().err
    assert code == 0, err
    usable = {h for h, (_, _, a) in want.items() if a}
    assert _failed_hosts(inst) == set(want) - usable | {f"{c.tag}f1"}
    assert f"host {n[7]} is IDLE+POWERED_DOWN, counted usable" in err


def test_live_errors_are_one_line(
    cluster: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No scontrol on PATH, a SLURM_CONF that is not there: one line, exit 2, nothing written."""
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, inst, out = _import(tmp_path, "--live")
    err = capsys.readouterr().err.splitlines()
    assert (code, inst) == (2, {})
    assert err == ["ntp-opt: error: scontrol show node --oneliner --future: scontrol is not on "
                   "PATH (--live runs it; or give saved files)"]  # fmt: skip
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nowhere.conf"))
    code, inst, out = _import(tmp_path, "--live")
    err = capsys.readouterr().err.splitlines()
    assert (code, inst) == (2, {})
    assert len(err) == 1 and "SLURM_CONF=" in err[0] and "is not a file" in err[0]
    assert not Path(out).exists()
    # scontrol against this cluster, asked for nonsense: its exit status and first line
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    with pytest.raises(Exception, match=r"scontrol show nonsense: exit status 1"):
        scontrol("show", "nonsense")
