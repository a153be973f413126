"""``ntp-opt watch``: the diff and the hysteresis, a live Slurm cluster, a replayed Kubernetes.

The Slurm tests run ``tests/slurm_cluster.py`` as 16 DGX-like nodes (8 GPUs, two
leaf switches); every test that uses it lives in this file (one xdist worker owns
the cluster). The watch runs as a child process (``python -m ntp_opt.app.cli``),
states are driven with ``scontrol update``, and the tests wait for the watch's
journal and status.json (bounded polls, generous limits), never for a time.
Without Slurm the live tests skip, except with ``CI=true``, where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ntp_opt.app.watch_diff import Flaps, diff
from ntp_opt.model.files import load_instance, load_plan
from ntp_opt.rules.validate import evaluate
from tests.slurm_cluster import SlurmCluster, running

ROOT = Path(__file__).resolve().parents[2]
K8S = Path(__file__).parents[1] / "fixtures" / "import" / "h100-k8s"
#: Upper bound on waits for the watch (polls ``POLL_S`` apart): a bound, not a delay.
MAX_POLLS = 3000
POLL_S = 0.1


# --- the diff and the hysteresis, without a cluster ------------------------------------------


def test_diff_turns_readings_into_events() -> None:
    inst = load_instance(ROOT / "instances" / "default.json")
    a = inst.arrays
    ids = list(a.gpu_ids)
    healthy = np.flatnonzero(a.healthy)
    down = healthy[:3]
    after = inst.with_health(a.healthy & ~np.isin(np.arange(a.n_gpus), down), None)
    d = diff(inst, after)
    assert [(e.kind, set(e.nodes)) for e in d.events] == [("fail", {ids[i] for i in down})]
    assert d.structure is None and not d.power
    back = diff(after, inst)
    assert [(e.kind, set(e.nodes)) for e in back.events] == [("repair", {ids[i] for i in down})]
    speed = a.speed.copy()
    speed[healthy[5]] = 0.5
    slow = diff(inst, inst.with_health(None, speed))
    assert [(e.kind, e.nodes, e.speed) for e in slow.events] == [("speed", (ids[healthy[5]],), 0.5)]
    assert diff(inst, inst).empty


def test_flaps_hold_a_node_that_goes_down_and_up() -> None:
    f = Flaps(hold=600.0, count=2)
    f.failed("g", 0.0)
    assert not f.held("g", 10.0)  # one failure: back at once
    f.released("g")
    f.failed("g", 20.0)
    assert f.held("g", 30.0)  # the second failure within 600 s: held out
    assert f.held("g", 629.0)
    assert not f.held("g", 630.0)  # up for 600 s since 30
    f.released("g")
    f.failed("g", 2000.0)  # long after: one failure in the window again
    assert not f.held("g", 2001.0)
    f.failed("g", 2002.0)
    assert f.held("g", 2003.0)
    f.down("g", 2650.0)  # down again while held: the probation starts over
    assert f.held("g", 2700.0) and f.held("g", 3299.0) and not f.held("g", 3300.0)


# --- running the watch -------------------------------------------------------------------------


def _journal(out: Path) -> list[dict[str, Any]]:
    try:
        lines = (out / "journal.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    recs = []
    for ln in lines:
        try:
            recs.append(json.loads(ln))
        except ValueError:
            pass  # a line being written
    return recs


def _versions(out: Path) -> list[int]:
    return [r["version"] for r in _journal(out) if r["kind"] == "publish"]


def _status(out: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((out / "status.json").read_text())
        return data
    except (FileNotFoundError, ValueError):
        return {}


def _wait(what: str, cond: Callable[[], Any], proc: subprocess.Popen[bytes], log: Path) -> Any:
    """Poll ``cond`` until truthy (bounded); fail early if the watch exited."""
    for _ in range(MAX_POLLS):
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(
                f"the watch exited ({proc.returncode}) before {what}: {log.read_text()[-2000:]}"
            )
        time.sleep(POLL_S)
    raise AssertionError(f"{what} never happened: {log.read_text()[-2000:]}")


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    env = {**env, "PYTHONPATH": str(ROOT)}
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "ntp_opt.app.cli", "watch", *argv],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=120)


def _summary(out: Path, v: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"v{v:04d}" / "summary.json").read_text())
    return data


def _check_version(out: Path, v: int, launch: bool = True) -> None:
    """The version is complete: its plan is valid for its instance (the validator says)."""
    vdir = out / f"v{v:04d}"
    assert (vdir / "summary.json").is_file()
    ev = evaluate(load_instance(vdir / "instance.json"), load_plan(vdir / "plan.json"))
    assert ev.feasible
    if launch:
        assert (vdir / "launch" / "ntp_config.py").is_file()
    else:  # the summary says why this plan has no launch files
        assert "launch_refused" in _summary(out, v), _summary(out, v)


def _event_hosts(summary: dict[str, Any], kind: str) -> set[str]:
    return {n.split(":")[0] for e in summary["events"] if e["kind"] == kind for n in e["nodes"]}


# --- a live Slurm --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """16 DGX-like nodes (8 GPUs) under leaves nvl0/nvl1."""
    with running(
        tmp_path_factory.mktemp("slurm-watch"),
        nodes=16,
        gpus=8,
        spares=0,
        leaves=2,
        tie_to_parent=True,
    ) as c:
        yield c


def _slurm_argv(tmp: Path, out: Path, *extra: str) -> list[str]:
    job = tmp / "job.json"
    job.write_text(
        json.dumps({"tp": 8, "pp": 2, "dp": 8, "global_batch": 64, "batch_policy": "elastic"})
    )
    return [
        "slurm",
        "--job",
        str(job),
        "--out",
        str(out),
        "--tdp-w",
        "700",
        "--interval",
        "1",
        "--placeholder-hosts",  # no spare GPUs: inactive ranks go there
        "ph1,ph2,ph3",
        *extra,
    ]


def _scontrol(c: SlurmCluster, node: str, state: str) -> None:
    extra = [] if state == "resume" else ["reason=watch-test"]
    c.run("scontrol", "update", f"nodename={node}", f"state={state}", *extra)


def test_slurm_watch_drain_down_fail_resume_kill9_and_hooks(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    c = cluster
    out = tmp_path / "out"
    log = tmp_path / "watch.log"
    hooks = tmp_path / "hooks.log"
    # the hook records every run and fails for v0002
    hook = (
        f'echo "$NTP_WATCH_VERSION $NTP_WATCH_DIR" >> {hooks}; '
        f'test "$NTP_WATCH_VERSION" != v0002 || exit 3'
    )
    argv = _slurm_argv(tmp_path, out, "--on-change", hook)
    n = {i: f"{c.tag}n{i}" for i in range(1, 17)}
    proc = _start(argv, c.env(), log)
    try:
        _wait("v0001", lambda: _versions(out) == [1], proc, log)
        assert os.readlink(out / "current") == "v0001"
        _check_version(out, 1)

        _scontrol(c, n[3], "drain")
        _wait("v0002", lambda: 2 in _versions(out), proc, log)
        assert os.readlink(out / "current") == "v0002"
        _check_version(out, 2)
        assert _event_hosts(_summary(out, 2), "fail") == {n[3]}
        # the failing hook is recorded, not retried for its own version
        _wait(
            "v0002's hook",
            lambda: any(r["kind"] == "hook" and r["version"] == 2 for r in _journal(out)),
            proc,
            log,
        )
        assert [r["exit"] for r in _journal(out) if r["kind"] == "hook"] == [0, 3]

        _scontrol(c, n[5], "down")
        _wait("v0003", lambda: 3 in _versions(out), proc, log)
        assert _event_hosts(_summary(out, 3), "fail") == {n[5]}
        _wait(
            "v0003's hook",
            lambda: any(r["kind"] == "hook" and r["version"] == 3 for r in _journal(out)),
            proc,
            log,
        )
        assert "v0003: --on-change failed" not in log.read_text()

        # kill -9, the cluster changes while the watch is away, a restart catches up
        proc.kill()
        proc.wait(timeout=120)
        _scontrol(c, n[3], "resume")
        _scontrol(c, n[5], "resume")
        proc = _start(argv, c.env(), log)

        def all_back() -> int:  # the last version, once one has every GPU healthy
            v = _versions(out)
            return v[-1] if v[-1] > 3 and _summary(out, v[-1])["healthy_gpus"] == 128 else 0

        # a DOWN node returns when its slurmd registers again: the two hosts may come
        # back in one reading or in two (then maybe one version, maybe two)
        k = _wait("every host back", all_back, proc, log)
        repaired = {
            n.split(":")[0]
            for r in _journal(out)
            if r["kind"] == "observe"
            for e in r["events"]
            if e["kind"] == "repair"
            for n in e["nodes"]
        }
        assert repaired == {n[3], n[5]}
        _check_version(out, k)

        # kill -9 again; the cluster is the one published: no new version, no hook rerun
        _wait(
            "the last version's hook",
            lambda: any(r["kind"] == "hook" and r["version"] == k for r in _journal(out)),
            proc,
            log,
        )
        proc.kill()
        proc.wait(timeout=120)
        proc = _start(argv, c.env(), log)
        _wait(
            "two polls after the restart",
            lambda: _status(out).get("pid") == proc.pid and _status(out).get("polls", 0) >= 2,
            proc,
            log,
        )
        every = list(range(1, k + 1))
        assert _versions(out) == every
        starts = [r["version"] for r in _journal(out) if r["kind"] == "hook-start"]
        assert starts == every
        ran = [ln.split()[0] for ln in hooks.read_text().splitlines()]
        assert ran == [f"v{v:04d}" for v in every]

        _scontrol(c, n[9], "fail")
        _wait("a version for the FAIL", lambda: k + 1 in _versions(out), proc, log)
        assert _event_hosts(_summary(out, k + 1), "fail") == {n[9]}
        _scontrol(c, n[9], "resume")
        _wait("a version for the resume", lambda: k + 2 in _versions(out), proc, log)
        assert _event_hosts(_summary(out, k + 2), "repair") == {n[9]}
        last = f"v{k + 2:04d}"
        status = _wait(
            "status of the last version",
            lambda: (s := _status(out)).get("last_version") == last and s,
            proc,
            log,
        )
        assert status["events_pending"] == [] and status["state"] == "watching"
    finally:
        code = _stop(proc)
    assert code == 0, log.read_text()[-2000:]
    assert _status(out)["state"] == "stopped"
    assert os.readlink(out / "current") == last
    assert not list(out.glob(".v*.tmp"))
    assert "Traceback" not in log.read_text()


def test_slurm_flapping_node_is_held_out(cluster: SlurmCluster, tmp_path: Path) -> None:
    c = cluster
    out = tmp_path / "out"
    log = tmp_path / "watch.log"
    node = f"{c.tag}n7"
    argv = _slurm_argv(tmp_path, out, "--flap-hold", "3600", "--flap-count", "2")
    proc = _start(argv, c.env(), log)
    try:
        _wait("v0001", lambda: _versions(out) == [1], proc, log)
        for want, state in ((2, "drain"), (3, "resume"), (4, "drain")):
            _scontrol(c, node, state)
            _wait(f"v{want:04d}", lambda w=want: w in _versions(out), proc, log)  # type: ignore[misc]
        _scontrol(c, node, "resume")  # second failure within the hold: held out
        held = _wait("the node held out", lambda: _status(out).get("held_out"), proc, log)
        assert {g.split(":")[0] for g in held} == {node}
        holds = [r["held_out"] for r in _journal(out) if r["kind"] == "hold"]
        assert holds == [held]
        assert "are up again but held out" in log.read_text()
        polls = _status(out)["polls"]
        _wait("two more polls", lambda: _status(out).get("polls", 0) >= polls + 2, proc, log)
        assert _versions(out) == [1, 2, 3, 4]
        assert os.readlink(out / "current") == "v0004"
    finally:
        code = _stop(proc, signal.SIGINT)
    assert code == 0, log.read_text()[-2000:]


# --- Kubernetes: a kubectl stand-in replays recorded snapshots --------------------------------


def _k8s_snapshot(change: Callable[[dict[str, Any]], None] | None, path: Path) -> None:
    data = json.loads((K8S / "nodes.json").read_text())
    if change is not None:
        change(data)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # the stand-in never reads half a snapshot


def _node(data: dict[str, Any], name: str) -> dict[str, Any]:
    node: dict[str, Any] = next(i for i in data["items"] if i["metadata"]["name"] == name)
    return node


def _not_ready(name: str) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        for cond in _node(data, name)["status"]["conditions"]:
            if cond["type"] == "Ready":
                cond["status"] = "False"

    return change


def test_k8s_watch_replays_snapshots(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    snap = tmp_path / "nodes.json"
    _k8s_snapshot(None, snap)
    kubectl = bindir / "kubectl"
    kubectl.write_text(f'#!/bin/sh\ncat "{snap}"\n')
    kubectl.chmod(0o755)
    smi = tmp_path / "smi"
    shutil.copytree(K8S / "nvidia-smi", smi)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "out"
    log = tmp_path / "watch.log"
    speeds = tmp_path / "speeds.json"
    argv = [
        "k8s",
        "--job",
        str(K8S / "job.json"),
        "--out",
        str(out),
        "--nvidia-smi",
        str(smi),
        "--tdp-w",
        "700",
        "--interval",
        "0.2",
        "--speeds",
        str(speeds),
    ]
    speeds.write_text("{}")
    proc = _start(argv, env, log)
    try:
        _wait("v0001", lambda: _versions(out) == [1], proc, log)
        _k8s_snapshot(_not_ready("dgx-h100-01"), snap)
        _wait("v0002", lambda: 2 in _versions(out), proc, log)
        assert _event_hosts(_summary(out, 2), "fail") == {"dgx-h100-01"}
        _check_version(out, 2, launch=False)  # 31 healthy GPUs: no GPU for an inactive rank
        _k8s_snapshot(None, snap)
        _wait("v0003", lambda: 3 in _versions(out), proc, log)
        assert _event_hosts(_summary(out, 3), "repair") == {"dgx-h100-01"}
        # a straggler detector reports a slow host: a speed event, re-planned
        speeds.write_text(json.dumps({"dgx-h100-02": 0.5}))

        def speed_seen() -> list[dict[str, Any]]:
            return [
                e for r in _journal(out) if r["kind"] == "observe" for e in r["events"]
                if e["kind"] == "speed"
            ]  # fmt: skip

        ev = _wait("the speed event", speed_seen, proc, log)
        assert [e["speed"] for e in ev] == [0.5]
        assert {n.split(":")[0] for n in ev[0]["nodes"]} == {"dgx-h100-02"}
        # (here the same replicas stay best: no version; the slow host keeps its place)
        _wait("the re-plan", lambda: "speed 0.5: the same replicas" in log.read_text(), proc, log)
        assert _versions(out) == [1, 2, 3]
        # a power limit changes in a host's nvidia-smi file: a fresh solve
        xml = smi / "dgx-h100-02.xml"
        text = xml.read_text()
        assert "<current_power_limit>" in text
        xml.write_text(
            re.sub(r"<current_power_limit>[^<]*<", "<current_power_limit>600.00 W<", text)
        )
        _wait("v0004", lambda: 4 in _versions(out), proc, log)
        assert "power" in _summary(out, 4)["change"]
        assert "fresh solve" in _summary(out, 4)["how"]
        # an unchanged cluster publishes nothing
        polls = _status(out)["polls"]
        _wait("three more polls", lambda: _status(out).get("polls", 0) >= polls + 3, proc, log)
        assert _versions(out) == [1, 2, 3, 4]
    finally:
        code = _stop(proc)
    assert code == 0, log.read_text()[-2000:]


def _fake_kubectl(tmp: Path, monkeypatch: pytest.MonkeyPatch, body: str | None = None) -> Path:
    """A kubectl stand-in first on PATH that prints ``tmp/nodes.json`` (or runs ``body``)."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    snap = tmp / "nodes.json"
    _k8s_snapshot(None, snap)
    kubectl = bindir / "kubectl"
    kubectl.write_text(f"#!/bin/sh\n{body or f'cat {snap}'}\n")
    kubectl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return snap


def _k8s(out: Path, *extra: str) -> list[str]:
    return [
        "watch",
        "k8s",
        "--job",
        str(K8S / "job.json"),
        "--out",
        str(out),
        "--nvidia-smi",
        str(K8S / "nvidia-smi"),
        "--tdp-w",
        "700",
        "--interval",
        "0.05",
        *extra,
    ]


def _one_error(capsys: pytest.CaptureFixture[str], pattern: str) -> None:
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("ntp-opt: error: ")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), err
    assert "Traceback" not in err


def test_watch_errors_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ntp_opt.app.cli import main

    out = tmp_path / "out"
    _fake_kubectl(tmp_path, monkeypatch, "echo 'no route to the API server' >&2; exit 1")
    assert main(_k8s(out, "--max-polls", "1")) == 2  # nothing published yet: fatal
    _one_error(capsys, r"kubectl get nodes -o json: failed .*no route to the API server")
    assert main(_k8s(out, "--flap-count", "0")) == 2
    _one_error(capsys, r"--flap-count: must be at least 1")
    (tmp_path / "file").write_text("")
    assert main(_k8s(tmp_path / "file")) == 2
    _one_error(capsys, r"--out .*file: not a directory")
    # a second watch on a directory another one holds
    import fcntl

    fd = os.open(out / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert main(_k8s(out, "--max-polls", "1")) == 2
        _one_error(capsys, r"another ntp-opt watch publishes there")
    finally:
        os.close(fd)


def test_outage_after_a_version_is_logged_and_survived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ntp_opt.app.cli import main

    out = tmp_path / "out"
    _fake_kubectl(tmp_path, monkeypatch)
    assert main(_k8s(out, "--max-polls", "1")) == 0
    _fake_kubectl(tmp_path, monkeypatch, "echo 'connection refused' >&2; exit 1")
    assert main(_k8s(out, "--max-polls", "3")) == 0
    err = capsys.readouterr().err
    assert err.count("reading the cluster failed (plan kept)") == 1  # once, not per poll
    assert _status(out)["last_error"] and os.readlink(out / "current") == "v0001"


def test_restart_after_kill9_at_the_worst_moments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torn journal line; current swapped but not journalled; a hook never started."""
    from ntp_opt.app.cli import main

    out = tmp_path / "out"
    hooks = tmp_path / "hooks.log"
    hook = ["--on-change", f"echo $NTP_WATCH_VERSION >> {hooks}"]
    _fake_kubectl(tmp_path, monkeypatch)
    assert main(_k8s(out, "--max-polls", "1", *hook)) == 0
    assert _versions(out) == [1] and hooks.read_text().split() == ["v0001"]
    # kill -9 while v0002 was published: its directory renamed, current swapped,
    # the journal line torn half-way, its hook never started
    shutil.copytree(out / "v0001", out / "v0002")
    os.symlink("v0002", out / ".cur")
    os.replace(out / ".cur", out / "current")
    with open(out / "journal.jsonl", "a") as f:
        f.write('{"kind": "publish", "vers')
    shutil.copytree(out / "v0001", out / ".v0003.tmp")  # and a half-written next one
    assert main(_k8s(out, "--max-polls", "2", *hook)) == 0
    assert _versions(out) == [1, 2]  # v0002 adopted (recovered), nothing new
    assert [r.get("recovered") for r in _journal(out) if r["kind"] == "publish"] == [None, True]
    assert hooks.read_text().split() == ["v0001", "v0002"]
    assert not (out / ".v0003.tmp").exists()
    assert main(_k8s(out, "--max-polls", "2", *hook)) == 0  # no hook runs twice
    assert hooks.read_text().split() == ["v0001", "v0002"]


def test_a_hanging_hook_is_killed_and_the_watch_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ntp_opt.app.cli import main

    out = tmp_path / "out"
    _fake_kubectl(tmp_path, monkeypatch)
    argv = _k8s(out, "--max-polls", "3", "--on-change", "sleep 600", "--hook-timeout", "0.2")
    assert main(argv) == 0
    assert [(r["version"], r["exit"]) for r in _journal(out) if r["kind"] == "hook"] == [(1, -1)]
    assert _status(out)["polls"] == 3


def test_losing_every_host_publishes_the_paused_job_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ntp_opt.app.cli import main

    out = tmp_path / "out"
    snap = _fake_kubectl(tmp_path, monkeypatch)
    assert main(_k8s(out, "--max-polls", "1")) == 0

    def all_down(data: dict[str, Any]) -> None:
        for i in range(1, 9):
            _not_ready(f"dgx-h100-0{i}")(data)

    _k8s_snapshot(all_down, snap)
    assert main(_k8s(out, "--max-polls", "4")) == 0
    assert _versions(out) == [1, 2]  # once, not once a poll
    s = _summary(out, 2)
    assert s["replicas"] == 0 and s["goodput_after"] == 0 and s["launch"] is None
    assert "the job is paused" in capsys.readouterr().err
    _k8s_snapshot(None, snap)  # the hosts come back: the job runs again
    assert main(_k8s(out, "--max-polls", "1")) == 0
    assert _versions(out) == [1, 2, 3] and _summary(out, 3)["replicas"] == 2


def test_a_signal_during_a_change_abandons_the_version(tmp_path: Path) -> None:
    """SIGTERM/SIGINT set ``stop``: the version being made is dropped, current stays whole."""
    from ntp_opt.app.watch import Settings, Watcher

    inst = load_instance(ROOT / "instances" / "default.json")
    a = inst.arrays
    failed = inst.with_health(a.healthy & (np.arange(a.n_gpus) != np.flatnonzero(a.healthy)[0]))
    readings = [inst, failed]
    lines: list[str] = []
    w = Watcher(lambda: readings.pop(0), Settings(out=tmp_path / "out"), log=lines.append)

    w.poll()
    assert _versions(w.out) == [1]
    real = w.read

    def read_then_signal() -> Any:
        got = real()
        w.stop.set()  # the signal lands while the change is being re-planned
        return got

    w.read = read_then_signal
    w.poll()
    w.journal.close()
    assert _versions(w.out) == [1] and os.readlink(w.out / "current") == "v0001"
    assert not list(w.out.glob(".v*")) and not (w.out / "v0002").exists()


# --- nvidia-smi files: parsed again only when they change ------------------------------------


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count :func:`read_xml` calls per file name (the parser behind the cache)."""
    from ntp_opt.app.importers import nvidia_smi

    counts: dict[str, int] = {}
    real = nvidia_smi.read_xml

    def spy(path: str | Path) -> Any:
        counts[Path(path).name] = counts.get(Path(path).name, 0) + 1
        return real(path)

    monkeypatch.setattr(nvidia_smi, "read_xml", spy)
    return counts


def test_watch_parses_an_unchanged_nvidia_smi_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ntp_opt.app.cli import main

    counts = _count_parses(monkeypatch)
    _fake_kubectl(tmp_path, monkeypatch)
    assert main(_k8s(tmp_path / "out", "--max-polls", "4")) == 0
    assert _status(tmp_path / "out")["polls"] == 4
    assert counts == {"dgx-h100-01.xml": 1, "dgx-h100-02.xml": 1}  # not once a poll


def test_xml_cache_rereads_changed_touched_new_and_removed_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ntp_opt.app.importers.cli import load_job
    from ntp_opt.app.importers.k8s import import_k8s
    from ntp_opt.app.importers.nvidia_smi import XmlCache
    from ntp_opt.model.files import instance_to_dict
    from ntp_opt.model.instance import Instance

    counts = _count_parses(monkeypatch)
    smi = tmp_path / "smi"
    shutil.copytree(K8S / "nvidia-smi", smi)
    one, two = smi / "dgx-h100-01.xml", smi / "dgx-h100-02.xml"
    for i, f in enumerate((one, two)):  # explicit times: no dependence on the clock
        os.utime(f, ns=(1_000_000_000_000 + i, 1_000_000_000_000 + i))
    job = load_job(str(K8S / "job.json"))
    cache = XmlCache()

    def read(use: XmlCache | None = cache) -> Instance:
        graph = import_k8s(
            K8S / "nodes.json", nvidia_smi=smi, nvidia_smi_cache=use, warn=lambda m: None
        )
        return Instance("k8s", graph, job, {}, copy_graph=False)

    def parses() -> dict[str, int]:
        seen = dict(counts)
        counts.clear()
        return seen

    first = read()
    assert parses() == {one.name: 1, two.name: 1}
    for _ in range(3):
        again = read()
        assert diff(first, again).empty
    assert parses() == {}  # unchanged: never parsed again
    # touched (same bytes, a new mtime): parsed again, nothing changed
    os.utime(one, ns=(2_000_000_000_000, 2_000_000_000_000))
    assert diff(first, read()).empty
    assert parses() == {one.name: 1}
    # a new power limit in the same size and mtime, but another inode (renamed over it)
    text = two.read_text()
    new = text.replace("<current_power_limit>700.00 W<", "<current_power_limit>600.00 W<")
    assert new != text and len(new) == len(text)
    st = two.stat()
    tmp = smi / "dgx-h100-02.xml.tmp"
    tmp.write_text(new)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    tmp.replace(two)
    changed = read()
    assert parses() == {two.name: 1}
    d = diff(first, changed)
    assert set(d.power) - {"racks"} == {f"dgx-h100-02:gpu{i}" for i in range(8)}
    # the cached reading is the reading without a cache (the same instance, the same events)
    uncached = read(None)
    assert instance_to_dict(changed) == instance_to_dict(uncached)
    assert diff(first, uncached) == d
    parses()
    # removed: noticed (the reading is the uncached one without that file); back: parsed
    saved = one.read_bytes()
    one.unlink()
    gone = read()
    assert parses() == {} and len(cache) == 1
    assert instance_to_dict(gone) == instance_to_dict(read(None))
    parses()
    one.write_bytes(saved)
    back = read()
    assert parses() == {one.name: 1}
    assert diff(changed, back).empty
    # the reader's checks still apply to a cached file: swapped for a FIFO, refused
    from ntp_opt.model.files import InputError

    one.unlink()
    os.mkfifo(one)
    with pytest.raises(InputError, match=r"dgx-h100-01\.xml.*not a regular file \(a FIFO\)"):
        read()
    assert len(cache) == 1  # the FIFO's entry is gone, the other file's kept
