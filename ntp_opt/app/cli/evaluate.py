"""The ``ntp-opt evaluate`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ntp_opt.app.cli.common import (
    make_console,
)
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    load_instance,
    load_plan,
)
from ntp_opt.rules.validate import Evaluation, evaluate


def _print_eval(ev: Evaluation, as_json: bool) -> None:
    if as_json:
        data = {
            **ev.as_metrics(),
            "feasible": ev.feasible,
            "violations": [str(v) for v in ev.violations],
        }
        print(json.dumps(data, indent=1))
        return
    con = make_console()
    con.print(f"feasible: {'yes' if ev.feasible else 'NO'}")
    con.print(f"relative goodput: {ev.relative_goodput:.6f}")
    con.print(f"goodput: {ev.goodput:.6g} sequences/s, step time {ev.step_time:.6g} s")
    con.print(
        f"replicas: {ev.n_replicas} ({ev.n_reduced} below nominal TP), "
        f"local batches sum to {ev.total_batch}, {ev.gpus_used} GPUs used"
    )
    con.print(f"site power: {ev.site_power_w / 1e3:.3f} kW")
    for v in ev.violations:
        con.print(f"  {echo(v, None)}")


def run(args: argparse.Namespace) -> int:
    instance = load_instance(args.instance)
    ev = evaluate(instance, load_plan(args.plan))
    _print_eval(ev, args.json)
    return 0 if ev.feasible else 1


def add_parser(sub: Any) -> None:
    """The ``ntp-opt evaluate`` subcommand."""
    e = sub.add_parser("evaluate", help="recompute a plan's goodput and power")
    e.add_argument("instance")
    e.add_argument("plan")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(func=run)
