"""The ``ntp-opt gen`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ntp_opt.app.cli.common import (
    make_console,
    validation_text,
)
from ntp_opt.model import hardware, topology
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    InputError,
    caps,
    check_cluster,
    save_instance,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.safeio import check_target

if TYPE_CHECKING:
    import networkx as nx

MAX_NAME = 200
"""Longest instance name (the instance file schema's limit)."""


_GEN_FLAGS = {
    "tp": "--tp",
    "pp": "--pp",
    "dp": "--dp",
    "global_batch": "--global-batch",
    "seq_time_s": "--seq-time",
    "batch_policy": "--batch-policy",
}


def run(args: argparse.Namespace) -> int:
    check_target(args.output)  # refuse an unsafe output before any work
    name = args.name if args.name is not None else Path(args.output).name.split(".")[0]
    if not name or len(name) > MAX_NAME:
        where = "--name" if args.name is not None else f"{args.output}: the file name"
        raise ValueError(
            f"{where}: an instance name has 1 to {MAX_NAME} characters, got {len(name)}"
            + ("" if args.name is not None else " (give --name)")
        )
    if args.gpus > caps.MAX_NODES:  # an instance file holds at most MAX_NODES nodes
        raise ValueError(f"--gpus: at most {caps.MAX_NODES} GPUs fit in an instance file")
    graph, meta = _cluster(args)
    if graph.number_of_nodes() > caps.MAX_NODES:
        raise ValueError(
            f"--gpus: the cluster has {graph.number_of_nodes()} nodes with its trays, domains "
            f"and racks; an instance file holds at most {caps.MAX_NODES}"
        )
    try:  # what gen writes must load: check the values the flags produced
        check_cluster(graph, args.output)
    except InputError as err:
        raise ValueError(f"not written: {str(err).splitlines()[0]} (check the flags)") from None
    job = _job(args, graph)
    instance = Instance(name, graph, job, meta)
    save_instance(instance, args.output)
    s = instance.summary()
    make_console().print(
        f"wrote {echo(args.output)}: {s['gpus']} GPUs ({s['failed']} failed, {s['stragglers']} "
        f"stragglers), {s['domains']} domains, job TP{job.tp} x PP{job.pp} x DP{job.dp}, "
        f"B={job.global_batch} ({job.batch_policy})"
    )
    return 0


def _cluster(args: argparse.Namespace) -> tuple[nx.Graph, dict[str, Any]]:
    """The cluster the flags describe (power, failures, stragglers) and its ``meta``."""
    kw: dict[str, Any] = {"rack_power_factor": args.rack_power_factor}
    board = hardware.product(args.product) if args.product else None
    if args.tdp_w is not None:
        kw["tdp_w"] = args.tdp_w
    elif board is not None:
        kw["tdp_w"] = board.tdp_w
    if board is not None and kw["tdp_w"] > board.max_power_w:
        raise ValueError(
            f"--tdp-w {kw['tdp_w']:g} is above the {board.name} maximum power limit "
            f"{board.max_power_w:g} W"
        )
    graph = topology.build(args.builder, args.gpus, **kw)
    meta: dict[str, Any] = {
        "builder": args.builder,
        "gpus": args.gpus,
        "seed": args.seed,
        "rack_power_factor": args.rack_power_factor,
    }
    if board is not None:
        # every board accepts at most the product's maximum power limit (docs/model.md, spec v1.1)
        for _, d in graph.nodes(data=True):
            if d["kind"] == "gpu":
                d["max_power_w"] = board.max_power_w
        meta["product"] = board.key
    if args.fail_fraction is not None or args.fail_count is not None:
        failed = topology.fail_random(
            graph,
            fraction=args.fail_fraction,
            count=args.fail_count,
            unit=args.fail_unit,
            seed=args.seed,
        )
        meta["failed"] = {"unit": args.fail_unit, "count": len(failed)}
    if args.stragglers:
        topology.add_stragglers(
            graph, count=args.stragglers, speed=args.straggler_speed, seed=args.seed + 1
        )
        meta["stragglers"] = {"count": args.stragglers, "speed": args.straggler_speed}
    if args.p_fail:
        topology.set_p_fail(graph, args.p_fail)
    return graph, meta


def _job(args: argparse.Namespace, graph: nx.Graph) -> Job:
    """The job of the flags (DP by default as many replicas as the domains hold)."""
    domains = topology.domains(graph)
    per_domain = graph.nodes[domains[0]]["size"] // args.tp if domains else 0
    dp = args.dp if args.dp is not None else max(1, len(domains) * per_domain // args.pp)
    try:
        return Job(
            tp=args.tp,
            pp=args.pp,
            dp=dp,
            global_batch=args.global_batch if args.global_batch is not None else 16 * dp,
            batch_policy=args.batch_policy,
            seq_time_s=args.seq_time,
        )
    except ValidationError as err:
        raise ValueError(validation_text(err, _GEN_FLAGS)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_parser(sub: Any) -> None:
    """The ``ntp-opt gen`` subcommand."""
    g = sub.add_parser("gen", help="write an instance from a cluster builder and a job")
    g.add_argument(
        "--builder",
        choices=sorted(topology.BUILDERS),
        default="nvl32",
        help="cluster kind (default nvl32)",
    )
    g.add_argument(
        "--gpus", type=_positive_int, required=True, help="number of GPUs (whole domains)"
    )
    g.add_argument("--fail-fraction", type=float, help="fraction of GPUs (or trays) failed")
    g.add_argument("--fail-count", type=int, help="number of GPUs (or trays) failed")
    g.add_argument("--fail-unit", choices=["gpu", "tray"], default="gpu")
    g.add_argument("--stragglers", type=int, default=0, help="number of slow GPUs")
    g.add_argument("--straggler-speed", type=float, default=0.8)
    g.add_argument("--p-fail", type=float, default=0.0, help="per-GPU failure probability")
    g.add_argument(
        "--rack-power-factor",
        type=float,
        default=1.0,
        help="rack budget as a multiple of its GPUs' TDP (default 1.0)",
    )
    g.add_argument(
        "--tdp-w",
        type=float,
        help="GPU power limit when not boosted, in watts (default: the product's, else "
        "the builder's)",
    )
    g.add_argument(
        "--product",
        choices=sorted(hardware.PRODUCTS),
        help="GPU product (ntp_opt.model.hardware): its board power as tdp_w and its maximum "
        "power limit as every GPU's max_power_w (default: none, the builder's TDP and "
        "boost up to 1 + max_boost)",
    )
    g.add_argument("--tp", type=_positive_int, required=True, help="nominal TP degree")
    g.add_argument("--pp", type=_positive_int, default=1, help="pipeline stages per replica")
    g.add_argument(
        "--dp", type=_positive_int, help="replicas (default: as many as the cluster holds)"
    )
    g.add_argument(
        "--global-batch", type=_positive_int, help="sequences per step (default 16 x dp)"
    )
    g.add_argument("--batch-policy", choices=["fixed", "elastic"], default="fixed")
    g.add_argument("--seq-time", type=float, default=1.0, help="seconds per sequence (c)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--name", help="instance name (default: output file stem)")
    g.add_argument("-o", "--output", required=True, help="instance file (.json or .json.gz)")
    g.set_defaults(func=run)
