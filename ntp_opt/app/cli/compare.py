"""The ``ntp-opt compare`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

from ntp_opt.app.cli.common import (
    fitted_tables,
    fmt,
    make_console,
    progress_bar,
    stop_on_signals,
    stopped_status,
)
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    load_instance,
)
from ntp_opt.solve import EXACT, PLANNERS, POLICIES, solve

EXACT_NAMES = set(EXACT)


def run(args: argparse.Namespace) -> int:
    con = make_console()
    policies = args.planners.split(",") if args.planners else list(POLICIES)
    unknown = [p for p in policies if p not in PLANNERS]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(PLANNERS)}")
    cells: list[list[str]] = []
    cancel = threading.Event()
    above_one = False
    with (
        stop_on_signals(cancel) as received,
        progress_bar(args.quiet, transient=True, terminal_only=True) as bar,
    ):
        task = bar.add_task("compare", total=len(args.instances) * len(policies))
        for path in args.instances:
            bar.update(task, description=f"{echo(Path(path).name, 60)}: loading")
            start = time.perf_counter()
            instance = load_instance(path)
            load_s = time.perf_counter() - start
            values = []
            for p in policies:
                bar.update(task, description=f"{echo(Path(path).name, 60)}: {p}")
                res = solve(instance, p, time_limit=args.time_limit, cancel=cancel)
                mark = "" if res.status != "feasible" or p not in EXACT_NAMES else "*"
                values.append(fmt(res.relative_objective) + mark)
                above_one = above_one or (res.relative_objective or 0.0) > 1.0 + 1e-9
                bar.advance(task)
                if cancel.is_set():
                    break
            values += ["-"] * (len(policies) - len(values))
            s = instance.summary()
            cells.append([echo(s["name"]), *values, str(s["gpus"]), str(s["failed"])])
            if args.verbose:
                con.print(f"{echo(path)}: loaded in {load_s:.2f} s")
            if cancel.is_set():
                break
    # instance and policies first; GPUs and failed move below when the terminal is narrow
    headers = ["instance", *policies, "GPUs", "failed"]
    title = "relative goodput (1.0 = no failures)"
    for table in fitted_tables(title, headers, cells, con.width, 1 + len(policies)):
        con.print(table)
    con.print(
        "* exact planner: best plan found, not proven optimal "
        "(time limit, Ctrl-C, or outside its exact scope: see docs/milp.md and `solve --log`)"
    )
    if above_one:
        con.print(
            "relative goodput > 1: power boost (and, under elastic, a larger global "
            "batch) can beat the failure-free job at nominal power, the 1.0 reference",
            markup=False,
        )
    if cancel.is_set():
        return stopped_status(received)
    return 0


def add_parser(sub: Any) -> None:
    """The ``ntp-opt compare`` subcommand."""
    c = sub.add_parser("compare", help="relative goodput of several planners on instances")
    c.add_argument("instances", nargs="+")
    c.add_argument("--planners", help=f"comma-separated (default {','.join(POLICIES)})")
    # the option's name before issue 34, kept for old scripts
    c.add_argument("--policies", dest="planners", help=argparse.SUPPRESS)
    c.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds per exact solve (default 60)"
    )
    c.add_argument("-v", "--verbose", action="store_true")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
    c.set_defaults(func=run)
