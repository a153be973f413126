"""The ``ntp-opt info`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
from typing import Any

from ntp_opt.app.cli.common import (
    MAX_LINE,
    instance_line,
    make_console,
)
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    load_instance,
)


def run(args: argparse.Namespace) -> int:
    instance = load_instance(args.instance)
    con = make_console()
    con.print(instance_line(instance))
    job = instance.job
    con.print(
        f"  tp_allowed {list(job.allowed)}, tp_min {job.min_tp}, dp_max {job.replicas_max}, "
        f"max_local_batch {job.local_batch_max}, power_exponent {job.power_exponent}, "
        f"max_boost {job.max_boost}, reshard_overhead {job.reshard_overhead}"
    )
    a = instance.arrays
    con.print(
        f"  site budget {a.site_budget / 1e3:.1f} kW, GPU TDP total {a.tdp.sum() / 1e3:.1f} kW"
    )
    for line in _budget_lines(instance):
        con.print(echo(line, MAX_LINE))
    limited = int((a.max_power < a.tdp * (1 + job.max_boost)).sum())
    if limited:
        fixed = int((instance.max_multiplier <= 1.0).sum())
        con.print(
            f"  board power limits (max_power_w) below tdp_w x (1 + max_boost) on {limited} "
            f"GPUs; {fixed} of them cannot boost at all"
        )
    return 0


def _budget_lines(instance: Any, shown: int = 4) -> list[str]:
    """Where the rack budgets came from: racks grouped by their ``budget_source``.

    Only for imported instances (``meta.source``): reading the attribute builds the
    graph, which other instances are spared.
    """
    if instance.meta.get("source") not in ("slurm", "k8s"):
        return []
    g = instance.cluster
    by_source: dict[str, int] = {}
    for r in instance.arrays.rack_ids:
        d = g.nodes[r]
        src = d.get("budget_source") or (
            "power_budget_w given in the file"
            if d.get("power_budget_w") is not None
            else "sum of its GPUs' tdp_w (default)"
        )
        by_source[src] = by_source.get(src, 0) + 1
    ranked = sorted(by_source.items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [f"  rack budgets: {n} rack(s): {src}" for src, n in ranked[:shown]]
    if len(ranked) > shown:
        lines.append(f"  rack budgets: {sum(n for _, n in ranked[shown:])} more rack(s) ...")
    meta = instance.meta
    if "tdp_w_option" in meta and any("--tdp-w" in src for src in by_source):
        mx = meta.get("max_power_w_option")
        lines.append(
            f"  --tdp-w {meta['tdp_w_option']:g} W stated the power of GPUs of unknown product"
            + (f" (--max-power-w {mx:g} W)" if mx is not None else " (no boost)")
        )
    return lines


def add_parser(sub: Any) -> None:
    """The ``ntp-opt info`` subcommand."""
    i = sub.add_parser("info", help="summarise an instance file")
    i.add_argument("instance")
    i.set_defaults(func=run)
