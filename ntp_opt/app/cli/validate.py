"""The ``ntp-opt validate`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
from typing import Any

from ntp_opt.app.cli.common import MAX_LINE
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    load_instance,
    load_plan,
)
from ntp_opt.rules.validate import evaluate


def run(args: argparse.Namespace) -> int:
    instance = load_instance(args.instance)
    plan = load_plan(args.plan)
    ev = evaluate(instance, plan)
    if ev.feasible:
        print(
            f"{echo(args.plan)}: valid plan for {echo(instance.name)} "
            f"(relative goodput {ev.relative_goodput:.6f})"
        )
        return 0
    print(f"{echo(args.plan)}: {len(ev.violations)} violation(s):")
    for v in ev.violations:
        print(f"  {echo(v, MAX_LINE)}")
    return 1


def add_parser(sub: Any) -> None:
    """The ``ntp-opt validate`` subcommand."""
    v = sub.add_parser("validate", help="check a plan against every rule; exit 1 if broken")
    v.add_argument("instance")
    v.add_argument("plan")
    v.set_defaults(func=run)
