"""A real Slurm on one machine: munge, one slurmctld and one ``slurmd -N NAME`` per emulated node.

Used by ``tests/app/test_slurm_launch.py`` (a session fixture) and by hand::

    python tests/slurm_cluster.py start DIR [--nodes 4] [--gpus 4] [--spares 1]
    export SLURM_CONF=DIR/etc/slurm.conf        # start prints this line
    sinfo; srun -N1 hostname ...
    python tests/slurm_cluster.py stop DIR

Everything lives under ``DIR``: the munge key, socket and seed, ``slurm.conf``,
``gres.conf`` and ``topology.conf``, the state and spool directories, logs and
pid files, and ``dev/nvidia0..`` placeholder files that back the ``gpu`` gres
(``AutoDetect=off``; nothing opens them). The daemons run in the foreground as
children of the starter in a session of their own; their process ids are written
to ``DIR/cluster.json`` and only those processes are stopped (SIGTERM, then
SIGKILL), after checking that each id still names the daemon started with this
directory. Ports are free ports picked at start (slurmctld and one per node,
``NodeName=... NodeHostname=localhost NodeAddr=127.0.0.1 Port=...``), node and
cluster names carry a random tag, so two clusters on one machine do not collide.

Readiness is polled, not slept for: ``munge -n | unmunge`` until the socket
answers, ``scontrol ping`` until slurmctld is UP, ``sinfo`` until every node is
idle; each wait is bounded by a number of polls and fails early, with the end of
the daemon's log, when the daemon has exited.

The node set: ``nodes`` GPU nodes (``gpu:<gpus>``) under one switch ``nvl0`` of
``topology/tree`` (Slurm 22.05 has no ``topology/block``; the tests give ntp-opt's
importer a block-form file of the same nodes, see :meth:`SlurmCluster.write_block_topology`),
and ``spares`` GPU nodes under a second switch ``spare0``: hosts outside the NVLink
block that may run the inactive (placeholder) ranks of an NTP launch.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import getpass
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Programs the cluster needs (Debian: slurmctld, slurmd, slurm-client, munge).
PROGRAMS = (
    "munged",
    "munge",
    "unmunge",
    "slurmctld",
    "slurmd",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
    "srun",
)
#: Debian packages that provide them.
PACKAGES = "slurmctld slurmd slurm-client munge"
#: Upper bound on readiness polls per wait (``POLL_S`` apart): a bound, not a tuned delay.
MAX_POLLS = 1200
POLL_S = 0.1
STATE_FILE = "cluster.json"


class ClusterError(RuntimeError):
    """The cluster could not be started (the message ends with the daemon's log)."""


def missing_programs() -> list[str]:
    """Programs of :data:`PROGRAMS` not on ``PATH`` (``/usr/sbin`` included)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [p for p in PROGRAMS if shutil.which(p, path=path) is None]


def _program(name: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    found = shutil.which(name, path=path)
    if found is None:
        raise ClusterError(f"{name} not found: install {PACKAGES}")
    return found


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking for SIGTERM when the parent thread ends (Linux), or ``None``.

    ``prctl`` is looked up here, in the parent: the child, forked from a process
    that may run other threads, only calls it.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG

    return preexec


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that were free on 127.0.0.1 a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SlurmCluster:
    """One Slurm cluster under ``root`` (see the module docstring).

    Attributes
    ----------
    root
        Directory holding everything of the cluster.
    nodes
        Number of GPU nodes in the NVLink block.
    gpus
        GPUs (``gpu`` gres) per node.
    spares
        GPU nodes outside the block.
    leaves
        Leaf switches the block nodes are spread over (``nvl0``, ``nvl1``, ...; in
        order, as evenly as they divide); ``nvl0`` alone by default.
    future
        Nodes configured ``State=FUTURE`` (no slurmd; under a leaf ``fut0``).
    short
        The last ``short`` block nodes have one GPU less in ``gres.conf`` than
        ``slurm.conf`` says: they register with fewer resources (a missing GPU).
    admin
        ``RebootProgram``, ``SuspendProgram`` and ``ResumeProgram`` are ``/bin/true``
        (power saving after an hour idle): ``scontrol reboot`` and
        ``state=power_down`` work without touching the machine.
    tag
        Random tag in the cluster's and nodes' names.
    pids, ports
        Process id and port of every daemon (``munged``, ``slurmctld``, ``slurmd-NODE``).
    tie_to_parent
        The daemons get SIGTERM when the thread that started them ends (Linux
        ``PR_SET_PDEATHSIG``): a test run that is killed leaves no cluster behind.
        Off for ``start`` by hand, whose starter exits at once.
    """

    root: Path
    nodes: int = 4
    gpus: int = 4
    spares: int = 1
    leaves: int = 1
    future: int = 0
    short: int = 0
    admin: bool = False
    tag: str = field(default_factory=lambda: "t" + secrets.token_hex(3))
    pids: dict[str, int] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    tie_to_parent: bool = False
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    # --- names and paths -------------------------------------------------------------

    @property
    def block_nodes(self) -> list[str]:
        """Names of the nodes in the NVLink block."""
        return [f"{self.tag}n{i}" for i in range(1, self.nodes + 1)]

    @property
    def spare_nodes(self) -> list[str]:
        """Names of the nodes outside the block."""
        return [f"{self.tag}s{i}" for i in range(1, self.spares + 1)]

    @property
    def future_nodes(self) -> list[str]:
        """Names of the ``State=FUTURE`` nodes (no slurmd)."""
        return [f"{self.tag}f{i}" for i in range(1, self.future + 1)]

    @property
    def all_nodes(self) -> list[str]:
        """Every node that runs a slurmd."""
        return self.block_nodes + self.spare_nodes

    def leaf_nodes(self) -> dict[str, list[str]]:
        """Leaf switch name -> its block nodes (``nvl0`` ...)."""
        n, k = len(self.block_nodes), max(1, self.leaves)
        cuts = [n * i // k for i in range(k + 1)]
        return {f"nvl{i}": self.block_nodes[cuts[i] : cuts[i + 1]] for i in range(k)}

    @property
    def short_nodes(self) -> list[str]:
        """Block nodes whose gres.conf lacks one GPU."""
        return self.block_nodes[len(self.block_nodes) - self.short :] if self.short else []

    @property
    def conf(self) -> Path:
        """``slurm.conf`` (``SLURM_CONF``)."""
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def env(self) -> dict[str, str]:
        """The environment for Slurm's commands against this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if k != "SLURM_CONF":
                del env[k]
        return env

    def run(
        self,
        *argv: str,
        check: bool = True,
        cwd: str | os.PathLike[str] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command against this cluster (text output captured, 300 s hang guard)."""
        env = {**self.env(), **(extra_env or {})}
        return subprocess.run(
            list(argv), env=env, cwd=cwd, capture_output=True, text=True, check=check, timeout=300
        )

    # --- configuration -------------------------------------------------------------

    def write_config(self) -> None:
        """Write the key, the device files and every configuration file."""
        for sub in ("etc", "munge", "state", "spool", "log", "run", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o600)
        for d in range(self.gpus):
            (self.root / "dev" / f"nvidia{d}").touch()
        ports = free_ports(1 + len(self.all_nodes))
        self.ports = {"slurmctld": ports[0], **dict(zip(self.all_nodes, ports[1:], strict=True))}
        user = getpass.getuser()
        r = self.root
        lines = [
            f"ClusterName={self.tag}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={self.ports['slurmctld']}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            f"PlugStackConfig={r}/etc/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "GresTypes=gpu",
            "TopologyPlugin=topology/tree",
            "SlurmdParameters=config_overrides",
            "SchedulerType=sched/builtin",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "SlurmdTimeout=300",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=300",
        ]
        if self.admin:
            lines += [
                "RebootProgram=/bin/true",
                "SuspendProgram=/bin/true",
                "ResumeProgram=/bin/true",
                "SuspendTime=3600",
                "SuspendTimeout=2",
                "ResumeTimeout=300",
            ]
        for name in self.all_nodes:
            lines.append(
                f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 "
                f"Port={self.ports[name]} CPUs={self.gpus} Gres=gpu:{self.gpus} State=UNKNOWN"
            )
        for name in self.future_nodes:
            lines.append(f"NodeName={name} CPUs={self.gpus} Gres=gpu:{self.gpus} State=FUTURE")
        lines.append(f"PartitionName={self.tag} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        (r / "etc" / "slurm.conf").write_text("\n".join(lines) + "\n")
        (r / "etc" / "plugstack.conf").write_text("")
        (r / "etc" / "cgroup.conf").write_text("")
        gres = ["AutoDetect=off"]
        last = self.gpus - 1
        for name in self.all_nodes + self.future_nodes:
            top = last - 1 if name in self.short_nodes else last
            gres.append(f"NodeName={name} Name=gpu File={r}/dev/nvidia[0-{top}]")
        (r / "etc" / "gres.conf").write_text("\n".join(gres) + "\n")
        switches = [f"SwitchName={s} Nodes={','.join(n)}" for s, n in self.leaf_nodes().items()]
        if self.spare_nodes:
            switches.append(f"SwitchName=spare0 Nodes={','.join(self.spare_nodes)}")
        if self.future_nodes:
            switches.append(f"SwitchName=fut0 Nodes={','.join(self.future_nodes)}")
        if len(switches) > 1:
            names = ",".join(line.split()[0].split("=")[1] for line in switches)
            switches.append(f"SwitchName=top Switches={names}")
        (r / "etc" / "topology.conf").write_text("\n".join(switches) + "\n")

    def write_block_topology(self, path: Path) -> None:
        """The same NVLink block in topology/block form (``BlockName=nvl0 Nodes=...``)."""
        path.write_text(f"BlockName=nvl0 Nodes={','.join(self.block_nodes)}\n")

    # --- processes -----------------------------------------------------------------

    def _spawn(self, key: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{key}.out", "ab")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
                preexec_fn=_parent_death_signal() if self.tie_to_parent else None,
            )
        finally:
            log.close()
        self.pids[key] = proc.pid
        self._procs[key] = proc
        self._save()

    def _save(self) -> None:
        state = {
            "tag": self.tag,
            "nodes": self.nodes,
            "gpus": self.gpus,
            "spares": self.spares,
            "leaves": self.leaves,
            "future": self.future,
            "short": self.short,
            "admin": self.admin,
            "pids": self.pids,
            "ports": self.ports,
        }
        tmp = self.root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        tmp.replace(self.root / STATE_FILE)

    @classmethod
    def load(cls, root: Path) -> SlurmCluster:
        """The cluster a previous :meth:`start` wrote to ``root``."""
        state = json.loads((root / STATE_FILE).read_text())
        return cls(
            root=root,
            nodes=state["nodes"],
            gpus=state["gpus"],
            spares=state["spares"],
            leaves=state.get("leaves", 1),
            future=state.get("future", 0),
            short=state.get("short", 0),
            admin=state.get("admin", False),
            tag=state["tag"],
            pids={k: int(v) for k, v in state["pids"].items()},
            ports={k: int(v) for k, v in state["ports"].items()},
        )

    def _ours(self, key: str, pid: int) -> bool:
        """``pid`` still runs the daemon ``key`` started for this directory (not a reused id)."""
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        marker = str(self.munge_socket if key == "munged" else self.conf).encode()
        return marker in cmd

    def _alive(self, key: str) -> bool:
        proc = self._procs.get(key)
        if proc is not None:  # started by this process: its exit status says it all
            return proc.poll() is None
        pid = self.pids.get(key)
        return pid is not None and self._ours(key, pid)

    def _signal(self, key: str, sig: int) -> None:
        try:
            os.kill(self.pids[key], sig)
        except ProcessLookupError:  # exited since the check
            pass

    def running(self) -> list[str]:
        """The daemons of this cluster that still run (by the recorded process ids)."""
        return [k for k in self.pids if self._alive(k)]

    def _log_tail(self, key: str) -> str:
        texts = []
        for name in (f"{key}.out", f"{key}.log"):
            p = self.root / "log" / name
            if p.exists():
                texts.append(
                    f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                )
        return "\n".join(texts)

    def _wait(self, what: str, keys: list[str], ready: object) -> None:
        """Poll ``ready()`` until true; fail when a daemon of ``keys`` exits or after MAX_POLLS."""
        for _ in range(MAX_POLLS):
            if ready():  # type: ignore[operator]
                return
            for k in keys:
                if not self._alive(k):
                    raise ClusterError(f"{k} exited while waiting for {what}\n{self._log_tail(k)}")
            time.sleep(POLL_S)
        tails = "\n".join(self._log_tail(k) for k in keys)
        raise ClusterError(f"{what}: not ready after {MAX_POLLS} polls\n{tails}")

    def _munge_ok(self) -> bool:
        if not self.munge_socket.exists():
            return False
        sock = f"--socket={self.munge_socket}"
        cred = subprocess.run(
            [_program("munge"), sock, "-n"], capture_output=True, check=False, timeout=60
        )
        if cred.returncode != 0:
            return False
        back = subprocess.run(
            [_program("unmunge"), sock],
            input=cred.stdout,
            capture_output=True,
            check=False,
            timeout=60,
        )
        return back.returncode == 0

    def _ctld_ok(self) -> bool:
        out = self.run(_program("scontrol"), "ping", check=False)
        return out.returncode == 0 and "UP" in out.stdout

    def node_states(self) -> dict[str, str]:
        """Node name -> state (``sinfo -N``, long state names, lower case)."""
        out = self.run(_program("sinfo"), "-h", "-N", "-o", "%N %T", check=False)
        states: dict[str, str] = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def _nodes_idle(self) -> bool:
        """Every node idle; a ``short`` node registered (refused as invalid, not unknown)."""
        states = self.node_states()
        short = set(self.short_nodes)
        return all(
            states.get(n) == "idle" if n not in short else states.get(n) in ("inval", "drained")
            for n in self.all_nodes
        )

    def start(self, attempts: int = 3) -> None:
        """Write the configuration and start munged, slurmctld and the slurmds; wait for idle.

        A port taken between :func:`free_ports` and the daemon's bind ("Address
        already in use" in its log) starts everything again with new ports and a
        new tag, up to ``attempts`` times; any other failure raises at once.

        Raises
        ------
        ClusterError
            When a daemon exits or is not ready after :data:`MAX_POLLS` polls
            (the message ends with its log); the daemons started are stopped.
        """
        for attempt in range(attempts):
            try:
                self._start_once()
                return
            except ClusterError as err:
                self.stop()
                if attempt + 1 == attempts or "already in use" not in str(err):
                    raise
            for sub in ("state", "spool", "run"):
                shutil.rmtree(self.root / sub, ignore_errors=True)
            self.tag = "t" + secrets.token_hex(3)
            self.pids, self._procs = {}, {}

    def _start_once(self) -> None:
        self.write_config()
        self._save()
        self._spawn(
            "munged",
            [
                _program("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={self.root / 'munge' / 'munge.key'}",
                f"--pid-file={self.root / 'run' / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
        )
        self._wait("munged", ["munged"], self._munge_ok)
        self._spawn("slurmctld", [_program("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait("slurmctld", ["munged", "slurmctld"], self._ctld_ok)
        for name in self.all_nodes:
            self._spawn(
                f"slurmd-{name}", [_program("slurmd"), "-D", "-N", name, "-f", str(self.conf)]
            )
        keys = ["munged", "slurmctld", *(f"slurmd-{n}" for n in self.all_nodes)]
        self._wait("every node idle", keys, self._nodes_idle)

    def cancel_jobs(self) -> None:
        """Cancel this cluster's jobs and wait (bounded) until none is left."""
        if not self._alive("slurmctld"):
            return
        self.run(_program("scancel"), f"--partition={self.tag}", check=False)
        for _ in range(MAX_POLLS):
            out = self.run(_program("squeue"), "-h", "-o", "%i", check=False)
            if out.returncode != 0 or not out.stdout.strip():
                return
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Cancel the jobs, then stop every daemon this cluster started, by process id."""
        try:
            self.cancel_jobs()
        except (OSError, subprocess.SubprocessError, ClusterError):
            pass
        order = [k for k in self.pids if k.startswith("slurmd-")] + ["slurmctld", "munged"]
        for group in (order[:-2], order[-2:-1], order[-1:]):
            live = [k for k in group if k in self.pids and self._alive(k)]
            for k in live:
                self._signal(k, signal.SIGTERM)
            for _ in range(MAX_POLLS):
                live = [k for k in live if self._alive(k)]
                if not live:
                    break
                time.sleep(POLL_S)
            for k in live:
                self._signal(k, signal.SIGKILL)
                if k in self._procs:
                    self._procs[k].wait(timeout=60)
        self.pids = {k: v for k, v in self.pids.items() if self._alive(k)}
        self._save()


@contextlib.contextmanager
def running(path: Path, **options: Any) -> Iterator[SlurmCluster]:
    """A started :class:`SlurmCluster` for a pytest fixture, stopped on leaving.

    A missing Slurm, or a cluster that does not start, fails the test with
    ``CI=true`` (and a start failure as root) and skips it elsewhere with a
    hint. ``options`` go to :class:`SlurmCluster`.
    """
    import pytest  # only the tests need it; the module runs by hand without

    ci = os.environ.get("CI") == "true"
    if missing := missing_programs():
        msg = f"Slurm is not installed (missing {' '.join(missing)})"
        if ci:
            pytest.fail(f"CI=true but {msg}: .ci/run installs {PACKAGES}")
        pytest.skip(f"{msg}: apt-get install {PACKAGES}; runs in CI")
    cluster = SlurmCluster(path, **options)
    try:
        cluster.start()
    except ClusterError as err:
        cluster.stop()
        if ci or os.geteuid() == 0:
            pytest.fail(f"the test cluster did not start: {err}")
        pytest.skip(f"the test cluster did not start as a normal user (try as root): {err}")
    try:
        yield cluster
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    """``start DIR`` / ``stop DIR`` (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="slurm_cluster.py", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--leaves", type=int, default=1)
    ap.add_argument("--future", type=int, default=0)
    ap.add_argument("--short", type=int, default=0)
    ap.add_argument("--admin", action="store_true")
    args = ap.parse_args(argv)
    root = args.dir.resolve()
    state = root / STATE_FILE
    if args.action == "stop":
        if not state.exists():
            print(
                f"slurm_cluster.py: {state} does not exist: no cluster started there",
                file=sys.stderr,
            )
            return 2
        SlurmCluster.load(root).stop()
        print(f"stopped the cluster in {root}")
        return 0
    if state.exists() and (live := SlurmCluster.load(root).running()):
        print(f"slurm_cluster.py: {root} runs {', '.join(live)}: stop it first", file=sys.stderr)
        return 2
    if missing := missing_programs():
        print(f"missing: {' '.join(missing)}; install {PACKAGES}", file=sys.stderr)
        return 2
    root.mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(
        root,
        nodes=args.nodes,
        gpus=args.gpus,
        spares=args.spares,
        leaves=args.leaves,
        future=args.future,
        short=args.short,
        admin=args.admin,
    )
    t0 = time.monotonic()
    try:
        cluster.start()
    except ClusterError as err:
        cluster.stop()
        print(f"slurm_cluster.py: {err}", file=sys.stderr)
        return 1
    print(f"started {', '.join(cluster.all_nodes)} in {time.monotonic() - t0:.1f} s")
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
