"""The ``ntp-opt info`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
from typing import Any

from ntp_opt.app.cli.common import (
    instance_line,
    make_console,
)
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
    limited = int((a.max_power < a.tdp * (1 + job.max_boost)).sum())
    if limited:
        fixed = int((instance.max_multiplier <= 1.0).sum())
        con.print(
            f"  board power limits (max_power_w) below tdp_w x (1 + max_boost) on {limited} "
            f"GPUs; {fixed} of them cannot boost at all"
        )
    return 0


def add_parser(sub: Any) -> None:
    """The ``ntp-opt info`` subcommand."""
    i = sub.add_parser("info", help="summarise an instance file")
    i.add_argument("instance")
    i.set_defaults(func=run)
