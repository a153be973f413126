"""``ntp-opt import slurm|k8s``: write an instance file from a real cluster's descriptions.

Registered by :func:`add_parser` in :mod:`ntp_opt.app.cli`. Warnings go to stderr;
bad input raises :class:`ntp_opt.model.files.InputError` (exit 2, nothing written).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ntp_opt.app.cli.common import warn
from ntp_opt.app.importers.compose import MAX_WATTS, PowerDefault
from ntp_opt.app.importers.k8s import DEFAULT_TOLERATED, KubectlOutput, import_k8s, run_kubectl
from ntp_opt.app.importers.slurm import NVLINK_CHOICES, import_slurm
from ntp_opt.app.importers.slurm_nodes import ALLOW_KINDS, Source, scontrol
from ntp_opt.model.files import (
    InputError,
    check_cluster,
    read_json,
    save_instance,
    validation_problems,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.safeio import check_target
from ntp_opt.model.topology import TopologyError


def load_job(path: str | Path) -> Job:
    """Read a job file: the ``job`` object of an instance file (or a whole instance file).

    Parameters
    ----------
    path : str or Path
        The JSON file.

    Returns
    -------
    Job
        The validated job.

    Raises
    ------
    ntp_opt.model.files.InputError
        Naming the file and the field.
    """
    p = Path(path)
    data = read_json(p)
    prefix = ""
    if isinstance(data, dict) and "format" in data and "job" in data:
        data, prefix = data["job"], "job."
    if not isinstance(data, dict):
        raise InputError(str(p), [("", "expected a JSON object (the job of an instance file)")])
    try:
        return Job.model_validate(data)
    except ValidationError as err:
        raise InputError(str(p), [(prefix + f, m) for f, m in validation_problems(err)]) from None


def _warn(msg: str) -> None:
    warn(msg)


def watts_arg(text: str) -> float:
    """``--tdp-w`` / ``--max-power-w``: watts, 1 to :data:`MAX_WATTS`."""
    try:
        w = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected watts, got {text!r}") from None
    if not 1.0 <= w <= MAX_WATTS:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_WATTS:g} W, got {text}")
    return w


def seconds_arg(text: str) -> float:
    """A duration option (``--kubectl-timeout``, ``watch --interval``): seconds in (0, 86400]."""
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < t <= 86400:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 86400, got {text}")
    return t


def _power(args: argparse.Namespace) -> PowerDefault | None:
    if args.max_power_w is not None and args.tdp_w is None:
        raise InputError("--max-power-w", [("", "needs --tdp-w (the nominal power it bounds)")])
    if args.tdp_w is None:
        return None
    if args.max_power_w is not None and args.max_power_w < args.tdp_w:
        raise InputError(
            "--max-power-w", [("", f"{args.max_power_w:g} W is below --tdp-w {args.tdp_w:g} W")]
        )
    return PowerDefault(args.tdp_w, args.max_power_w)


def _inputs(args: argparse.Namespace) -> list[str]:
    """Every file the import reads (the output may be none of them)."""
    files = [args.job, args.nodes, getattr(args, "topology", None)]
    if args.nvidia_smi:
        try:
            with os.scandir(args.nvidia_smi) as entries:
                files += [e.path for e in entries]
        except OSError:
            pass  # the reader reports an unreadable directory
    return [f for f in files if f]


def _slurm_sources(args: argparse.Namespace) -> tuple[str | Source, str | Source]:
    """``(topology, nodes)``: the files given, or scontrol's output with ``--live``."""
    if not args.live:
        missing = [o for o, v in (("--topology", args.topology), ("--nodes", args.nodes)) if not v]
        if missing:
            raise ValueError(f"import slurm: {' and '.join(missing)} required (or --live)")
        return args.topology, args.nodes
    if args.nodes:
        raise ValueError("import slurm: --live runs scontrol show node; --nodes is a saved file")
    nodes = scontrol("show", "node", "--oneliner", "--future")
    topology = args.topology or scontrol("show", "topology")
    return topology, nodes


def cmd_import(args: argparse.Namespace) -> int:
    """Run ``ntp-opt import``."""
    inputs = _inputs(args)
    check_target(args.output, inputs)  # refuse an unsafe output before any work
    power = _power(args)
    job = load_job(args.job)
    name = args.name or Path(args.output).name.split(".")[0]
    if args.source == "slurm":
        topology, nodes = _slurm_sources(args)
        graph = import_slurm(
            topology,
            nodes,
            nvidia_smi=args.nvidia_smi,
            name=name,
            warn=_warn,
            topology_name=args.topology_name,
            nvlink=args.nvlink,
            allow=tuple(args.allow or ()),
            power=power,
        )
        meta: dict[str, Any] = {
            "source": "slurm",
            "topology": topology.name if isinstance(topology, Source) else topology,
            "nodes": nodes.name if isinstance(nodes, Source) else nodes,
        }
    else:
        tolerate = DEFAULT_TOLERATED + tuple(args.tolerate or ())
        k8s_nodes: str | KubectlOutput = args.nodes
        if args.context is not None and not args.live:
            raise InputError("--context", [("", "only used with --live")])
        if args.live:
            k8s_nodes = run_kubectl(args.context, timeout=args.kubectl_timeout)
        graph = import_k8s(
            k8s_nodes,
            nvidia_smi=args.nvidia_smi,
            rack_label=args.rack_label,
            tolerate=tolerate,
            name=name,
            warn=_warn,
            power=power,
        )
        meta = {"source": "k8s", "nodes": args.nodes}
        if isinstance(k8s_nodes, KubectlOutput):
            meta["nodes"] = k8s_nodes.source
    if args.nvidia_smi:
        meta["nvidia_smi"] = args.nvidia_smi
    if power is not None:
        meta["tdp_w_option"] = power.tdp_w
        if power.max_power_w is not None:
            meta["max_power_w_option"] = power.max_power_w
    try:
        instance = Instance(name, graph, job, meta, copy_graph=False)
    except TopologyError as err:  # the job does not fit the cluster the sources describe
        raise InputError(str(args.job), [("", p) for p in err.problems]) from None
    check_cluster(graph, f"not written: {args.output}")  # never a file the loader refuses
    save_instance(instance, args.output, inputs=inputs)
    s = instance.summary()
    trays = sum(1 for _, k in graph.nodes(data="kind") if k == "tray")
    print(
        f"wrote {args.output}: {s['gpus']} GPUs ({s['failed']} failed) on {trays} hosts, "
        f"{s['domains']} NVLink domains, {s['racks']} racks"
    )
    return 0


def add_parser(sub: Any) -> None:
    """Add the ``import`` sub-command to ``ntp-opt``'s sub-parsers."""
    imp = sub.add_parser(
        "import", help="write an instance from Slurm or Kubernetes output (docs/import.md)"
    )
    src = imp.add_subparsers(dest="source", required=True, metavar="SOURCE")
    _slurm_options(
        src.add_parser("slurm", help="topology/block or tree + scontrol show node --oneliner")
    )
    _k8s_options(src.add_parser("k8s", help="kubectl get nodes -o json"))


def _common_options(p: argparse.ArgumentParser) -> None:
    """The options of both sources: nvidia-smi, job, name, unknown power, output."""
    p.add_argument("--nvidia-smi", metavar="DIR", help="directory of <host>.xml (nvidia-smi -q -x)")
    p.add_argument("--job", required=True, help="job file (the job object of an instance)")
    p.add_argument("--name", help="instance name (default: output file stem)")
    p.add_argument(
        "--tdp-w",
        type=watts_arg,
        metavar="W",
        help="nominal power of GPUs of unknown product without nvidia-smi output "
        "(otherwise refused)",
    )
    p.add_argument(
        "--max-power-w",
        type=watts_arg,
        metavar="W",
        help="largest power limit of those GPUs' boards (default: --tdp-w, no boost)",
    )
    p.add_argument("-o", "--output", required=True, help="instance file to write")
    p.set_defaults(func=cmd_import)


def _slurm_options(s: argparse.ArgumentParser) -> None:
    """The options of ``ntp-opt import slurm``."""
    s.add_argument(
        "--topology", help="topology.yaml, topology.conf or scontrol show topology output"
    )
    s.add_argument("--nodes", help="scontrol show node --oneliner output")
    s.add_argument(
        "--live",
        action="store_true",
        help="run scontrol show node/topology (the scontrol on PATH, SLURM_CONF) instead",
    )
    s.add_argument("--topology-name", help="block topology to use (topology.yaml with several)")
    s.add_argument(
        "--nvlink",
        choices=NVLINK_CHOICES,
        help="tree topology: NVLink domain = each host, or each leaf switch (default: host "
        "when every host has 8 GPUs, else required)",
    )
    s.add_argument(
        "--allow",
        action="append",
        choices=list(ALLOW_KINDS),
        metavar="KIND",
        help="count nodes in this kind of state as usable: "
        + "; ".join(f"{k}: {why}" for k, why in ALLOW_KINDS.items())
        + " (repeatable)",
    )
    _common_options(s)


def _k8s_options(k: argparse.ArgumentParser) -> None:
    """The options of ``ntp-opt import k8s``."""
    how = k.add_mutually_exclusive_group(required=True)
    how.add_argument("--nodes", help="kubectl get nodes -o json output")
    how.add_argument(
        "--live", action="store_true", help="run kubectl get nodes -o json (kubectl on PATH)"
    )
    k.add_argument("--context", help="kubectl context for --live (default: the current one)")
    k.add_argument(
        "--kubectl-timeout",
        type=seconds_arg,
        default=60.0,
        metavar="S",
        help="seconds kubectl may take with --live (default 60)",
    )
    k.add_argument(
        "--rack-label",
        help="node label naming the rack (default: topology.kubernetes.io/rack or "
        "cloud.google.com/gce-topology-subblock, else one rack per NVLink domain)",
    )
    k.add_argument(
        "--tolerate",
        action="append",
        metavar="KEY",
        help="taint key the job tolerates, besides nvidia.com/gpu (repeatable)",
    )
    _common_options(k)
