"""The ``ntp-opt watch`` sub-command: :func:`add_parser` and :func:`run` (docs/watch.md)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ntp_opt.app.watch import HOOK_TIMEOUT_S, Settings, Watcher, stop_on_signals
from ntp_opt.app.watch_diff import DEFAULT_FLAP_COUNT, DEFAULT_FLAP_HOLD_S
from ntp_opt.model.instance import Instance

if TYPE_CHECKING:
    from ntp_opt.app.importers.compose import PowerDefault
    from ntp_opt.app.importers.nvidia_smi import XmlCache
    from ntp_opt.model.job import Job


def seconds_arg(text: str) -> float:
    """``--interval`` and the other durations: as ``ntp-opt import`` reads them."""
    from ntp_opt.app.importers.cli import seconds_arg as read

    return read(text)


def watts_arg(text: str) -> float:
    """``--tdp-w`` / ``--max-power-w``: as ``ntp-opt import`` reads them."""
    from ntp_opt.app.importers.cli import watts_arg as read

    return read(text)


def _reader(args: argparse.Namespace) -> Callable[[], Instance]:
    """A function that reads the cluster now (the importers on live sources)."""
    from ntp_opt.app.importers.cli import load_job
    from ntp_opt.app.importers.compose import PowerDefault
    from ntp_opt.app.importers.nvidia_smi import XmlCache

    job = load_job(args.job)
    power = PowerDefault(args.tdp_w, args.max_power_w) if args.tdp_w is not None else None
    if args.max_power_w is not None and power is None:
        raise ValueError("--max-power-w: only with --tdp-w")
    name = Path(args.out).name or "watch"
    # an nvidia-smi file is parsed again only when it changes
    live = _LiveReader(args, job, power, name, XmlCache())
    read = live.read_slurm if args.source == "slurm" else live.read_k8s
    if not args.speeds:
        return read
    return live.read_with_speeds


@dataclass
class _LiveReader:
    """Reads the cluster from Slurm or Kubernetes, each warning once (not once a poll)."""

    args: argparse.Namespace
    job: Job
    power: PowerDefault | None
    name: str
    smi_cache: XmlCache
    seen: set[str] = field(default_factory=set)

    def warn(self, msg: str) -> None:
        """Print a warning the first time it is given."""
        if msg not in self.seen:
            self.seen.add(msg)
            print(f"ntp-opt watch: warning: {msg}", flush=True, file=sys.stderr)

    def read_slurm(self) -> Instance:
        """The cluster from ``scontrol`` now."""
        from ntp_opt.app.importers.slurm import import_slurm
        from ntp_opt.app.importers.slurm_nodes import scontrol

        args, name = self.args, self.name
        nodes = scontrol("show", "node", "--oneliner", "--future")
        topology = args.topology or scontrol("show", "topology")
        graph = import_slurm(
            topology,
            nodes,
            nvidia_smi=args.nvidia_smi,
            nvidia_smi_cache=self.smi_cache,
            name=name,
            warn=self.warn,
            nvlink=args.nvlink,
            allow=tuple(args.allow or ()),
            power=self.power,
        )
        return Instance(name, graph, self.job, {"source": "slurm", "watch": True}, copy_graph=False)

    def read_k8s(self) -> Instance:
        """The cluster from ``kubectl`` now."""
        from ntp_opt.app.importers.k8s import DEFAULT_TOLERATED, import_k8s, run_kubectl

        args, name = self.args, self.name
        out = run_kubectl(args.context, timeout=args.kubectl_timeout)
        graph = import_k8s(
            out,
            nvidia_smi=args.nvidia_smi,
            nvidia_smi_cache=self.smi_cache,
            rack_label=args.rack_label,
            tolerate=DEFAULT_TOLERATED + tuple(args.tolerate or ()),
            name=name,
            warn=self.warn,
            power=self.power,
        )
        return Instance(name, graph, self.job, {"source": "k8s", "watch": True}, copy_graph=False)

    def read_with_speeds(self) -> Instance:
        """The cluster now with the speeds of the ``--speeds`` file."""
        read = self.read_slurm if self.args.source == "slurm" else self.read_k8s
        return with_speeds(read(), self.args.speeds)


def with_speeds(instance: Instance, path: str) -> Instance:
    """``instance`` with the speeds of the ``--speeds`` file (a straggler detector's output).

    The file is a JSON object: GPU id or host name -> relative speed in (0, 1];
    GPUs it does not name run at 1. It is re-read at every poll.

    Raises
    ------
    InputError
        Naming the file and the key of every problem.
    """
    from ntp_opt.model.files import InputError, read_json

    data = read_json(Path(path))
    if not isinstance(data, dict):
        raise InputError(path, [("", "expected an object {GPU id or host: speed}")])
    a = instance.arrays
    hosts: dict[str, list[int]] = {}
    g = instance.cluster
    for i, gid in enumerate(a.gpu_ids):
        hosts.setdefault(str(g.nodes[gid].get("host", "")), []).append(i)
    speed = np.ones(a.n_gpus)
    problems = []
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            problems.append((key, f"expected a speed in (0, 1], got {value!r}"))
        elif key in a.gpu_index:
            speed[a.gpu_index[key]] = value
        elif key in hosts:
            speed[hosts[key]] = value
        else:
            problems.append((key, "not a GPU or host of the cluster"))
    if problems:
        raise InputError(path, problems)
    return instance.with_health(None, speed)


def run(args: argparse.Namespace) -> int:
    """Run ``ntp-opt watch``."""
    from ntp_opt.solve import PLANNERS

    if args.planner not in PLANNERS:
        raise ValueError(f"--planner: unknown planner {args.planner!r} ({', '.join(PLANNERS)})")
    if args.flap_count < 1:
        raise ValueError(f"--flap-count: must be at least 1, got {args.flap_count}")
    if args.max_polls is not None and args.max_polls < 1:
        raise ValueError(f"--max-polls: must be at least 1, got {args.max_polls}")
    if not (math.isfinite(args.tolerance) and 0 <= args.tolerance < 1):
        raise ValueError(f"--tolerance: must be a number in [0, 1), got {args.tolerance!r}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: not a directory")
    read = _reader(args)
    settings = Settings(
        out=out,
        interval=args.interval,
        planner=args.planner,
        time_limit=args.time_limit,
        mode=args.mode,
        tolerance=args.tolerance,
        hook=args.on_change,
        flap_hold=args.flap_hold,
        flap_count=args.flap_count,
        max_polls=args.max_polls,
        hook_timeout=args.hook_timeout,
        placeholder_hosts=tuple(h for h in (args.placeholder_hosts or "").split(",") if h),
    )
    watcher = Watcher(read, settings)
    with stop_on_signals(watcher):
        return watcher.run()


def add_parser(sub: Any) -> None:
    """The ``ntp-opt watch`` sub-command (``slurm`` and ``k8s``)."""
    from ntp_opt.app.importers.slurm import NVLINK_CHOICES
    from ntp_opt.app.importers.slurm_nodes import ALLOW_KINDS

    w = sub.add_parser(
        "watch",
        help="follow a live cluster, re-plan on every health change, publish plans (docs/watch.md)",
    )
    src = w.add_subparsers(dest="source", required=True, metavar="SOURCE")
    s = src.add_parser("slurm", help="scontrol show node/topology (scontrol on PATH, SLURM_CONF)")
    s.add_argument(
        "--topology",
        metavar="FILE",
        help="topology.yaml/topology.conf (default: scontrol show topology each poll)",
    )
    s.add_argument("--nvlink", choices=NVLINK_CHOICES, help="as for ntp-opt import slurm")
    s.add_argument(
        "--allow",
        action="append",
        choices=list(ALLOW_KINDS),
        metavar="KIND",
        help="as for ntp-opt import slurm",
    )
    _common_options(s)
    k = src.add_parser("k8s", help="kubectl get nodes -o json (kubectl on PATH)")
    k.add_argument("--context", help="kubectl context (default: the current one)")
    k.add_argument("--kubectl-timeout", type=seconds_arg, default=60.0, metavar="S")
    k.add_argument("--rack-label", help="as for ntp-opt import k8s")
    k.add_argument("--tolerate", action="append", metavar="KEY", help="as for ntp-opt import k8s")
    _common_options(k)


def _common_options(p: argparse.ArgumentParser) -> None:
    """The options of both sources, in the order ``--help`` lists them."""
    _input_options(p)
    _planning_options(p)
    _change_options(p)
    _run_options(p)
    p.set_defaults(func=run)


def _input_options(p: argparse.ArgumentParser) -> None:
    """The job, the output directory, nvidia-smi files and the poll interval."""
    p.add_argument("--job", required=True, help="job file (the job object of an instance)")
    p.add_argument("--out", required=True, metavar="DIR", help="versions, journal, status")
    p.add_argument(
        "--nvidia-smi",
        metavar="DIR",
        help="directory of <host>.xml, listed every poll; a file is re-read when it changes",
    )
    p.add_argument(
        "--interval", type=seconds_arg, default=10.0, metavar="S", help="seconds (default 10)"
    )


def _planning_options(p: argparse.ArgumentParser) -> None:
    """The planner of fresh solves and the re-planner's mode and tolerance."""
    p.add_argument(
        "--planner",
        default="fast",
        metavar="P",
        help="planner of fresh solves (default fast; see ntp-opt solve --help)",
    )
    p.add_argument("--policy", dest="planner", help=argparse.SUPPRESS)  # before issue 34
    p.add_argument(
        "--time-limit",
        type=seconds_arg,
        default=60.0,
        metavar="S",
        help="seconds a fresh solve may take (default 60)",
    )
    p.add_argument("--mode", choices=["auto", "local", "global"], default="auto")
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="relative goodput traded to avoid migration (default 0.001)",
    )


def _change_options(p: argparse.ArgumentParser) -> None:
    """The hook, the flap hysteresis and the straggler speeds."""
    p.add_argument(
        "--on-change",
        metavar="CMD",
        help="shell command run once per published version (NTP_WATCH_VERSION, "
        "NTP_WATCH_DIR, NTP_WATCH_SUMMARY)",
    )
    p.add_argument(
        "--flap-hold",
        type=seconds_arg,
        default=DEFAULT_FLAP_HOLD_S,
        metavar="S",
        help=f"hold a flapping GPU out until it stays up this long "
        f"(default {DEFAULT_FLAP_HOLD_S:g})",
    )
    p.add_argument(
        "--flap-count",
        type=int,
        default=DEFAULT_FLAP_COUNT,
        metavar="N",
        help=f"failures within --flap-hold that make a GPU flapping (default {DEFAULT_FLAP_COUNT})",
    )
    p.add_argument(
        "--speeds",
        metavar="FILE",
        help="JSON {GPU id or host: speed in (0, 1]} from a straggler detector, re-read "
        "every poll (unnamed GPUs run at 1)",
    )


def _run_options(p: argparse.ArgumentParser) -> None:
    """Placeholder hosts, the poll count, unknown GPUs' power and the hook's time limit."""
    p.add_argument(
        "--placeholder-hosts",
        metavar="H1,H2",
        help="hosts outside the cluster for inactive ranks (as for export megatron)",
    )
    p.add_argument(
        "--max-polls", type=int, metavar="N", help="stop after N readings (default: never)"
    )
    p.add_argument("--tdp-w", type=watts_arg, metavar="W", help="as for ntp-opt import")
    p.add_argument("--max-power-w", type=watts_arg, metavar="W", help="as for ntp-opt import")
    p.add_argument(
        "--hook-timeout",
        type=seconds_arg,
        default=HOOK_TIMEOUT_S,
        metavar="S",
        help=f"seconds --on-change may run before it is killed (default {HOOK_TIMEOUT_S:g})",
    )
