"""The ``ntp-opt solve`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

from ntp_opt.app.cli.common import (
    fmt,
    instance_line,
    loading,
    make_console,
    stop_on_signals,
    stopped_status,
)
from ntp_opt.model.files import (
    load_instance,
    save_plan,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.safeio import check_target
from ntp_opt.solve import PLANNERS, POLICIES, Result, solve


@contextlib.contextmanager
def _stream_log(enabled: bool) -> Iterator[None]:
    """While inside, the ``ntp_opt`` loggers write to stderr (``--log``)."""
    if not enabled:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("ntp_opt")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _summary_table(rows: list[tuple[str, Result]], instance: Instance) -> Table:
    table = Table(title=f"{instance.name}: policies", title_justify="left")
    job = instance.job
    for col in (
        "policy",
        "rel. goodput",
        "rel. bound",
        "gap",
        "goodput seq/s",
        "replicas",
        "reduced",
        "GPUs used",
        "power kW",
        "status",
        "time s",
    ):
        table.add_column(col, justify="left" if col in ("policy", "status") else "right")
    for name, res in rows:
        ev = res.evaluation
        if ev is None:  # infeasible: no plan at all
            table.add_row(name, *["-"] * 8, str(res.status), f"{res.runtime_s:.3f}")
            continue
        table.add_row(
            name,
            fmt(res.relative_objective),
            "-" if res.bound is None else fmt(res.bound * job.seq_time_s / job.dp),
            "-" if res.gap is None else f"{res.gap:.1e}",
            fmt(res.objective, 2),
            str(ev.n_replicas),
            str(ev.n_reduced),
            str(ev.gpus_used),
            f"{ev.site_power_w / 1e3:.1f}",
            str(res.status) + ("" if res.limit == "none" else f" ({res.limit})"),
            f"{res.runtime_s:.3f}",
        )
    return table


def _explain_goodput(con: Console, rows: list[tuple[str, Result]]) -> None:
    """A footnote when a relative goodput above 1.0 would puzzle the reader."""
    if any((res.relative_objective or 0.0) > 1.0 + 1e-9 for _, res in rows):
        con.print(
            "relative goodput > 1: power boost (and, under elastic, a larger global "
            "batch) can beat the failure-free job at nominal power, which is the 1.0 "
            "reference (docs/model.md)",
            markup=False,
        )


def _explain_expected(con: Console, rows: list[tuple[str, Result]], instance: Instance) -> None:
    """A line per planner whose bound and gap are for the expected goodput (risk-aware)."""
    job = instance.job
    for name, res in rows:
        if res.expected_objective is None or res.plan is None:
            continue
        m = res.plan.metrics
        scale = job.seq_time_s / job.dp
        line = (
            f"{name}: expected goodput after recourse {fmt(res.expected_objective * scale)}"
            f" (rel., {m.get('saa_method')} over {m.get('saa_samples')} scenarios)"
        )
        if res.bound is None:
            line += "; no wait-and-see bound (off by default on large problems, docs/risk.md)"
        else:
            line += (
                f", wait-and-see bound {fmt(res.bound * scale)}, gap {res.gap or 0.0:.1e}:"
                " the table's bound and gap are for it"
            )
        con.print(line, markup=False)


def run(args: argparse.Namespace) -> int:
    if args.policy == "all" and args.output:
        raise ValueError(
            "-o/--output writes one plan: name one --policy (see `ntp-opt compare` "
            "for every policy side by side)"
        )
    if args.output:  # refuse an unsafe output before any work
        check_target(args.output, [args.instance])
    with loading():
        instance = load_instance(args.instance)
    con = make_console()
    con.print(instance_line(instance))
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    if args.policy == "all":
        con.print(
            f"--policy all runs the {len(POLICIES)} policies of docs/model.md section 5: "
            f"{', '.join(POLICIES)} (any of the {len(PLANNERS)} planners by name: "
            "--policy NAME)",
            markup=False,
        )
    rows = []
    cancel = threading.Event()
    with _stream_log(args.log), stop_on_signals(cancel) as received:
        for name in policies:
            res = solve(
                instance,
                name,
                time_limit=args.time_limit,
                seed=args.seed,
                threads=args.threads,
                cancel=cancel,
            )
            if res.reason:
                con.print(f"{name}: {res.reason}", markup=False)
            rows.append((name, res))
            if cancel.is_set():
                break  # Ctrl-C or SIGTERM: no further policy
    con.print(_summary_table(rows, instance))
    _explain_goodput(con, rows)
    _explain_expected(con, rows, instance)
    if args.output:
        plan = rows[0][1].plan
        if plan is None:
            raise ValueError(f"{args.instance}: {rows[0][1].reason}")
        save_plan(plan, args.output, inputs=[args.instance])
        con.print(f"wrote {args.output}")
    if cancel.is_set():
        return stopped_status(received)
    return 0


def add_parser(sub: Any) -> None:
    """The ``ntp-opt solve`` subcommand."""
    s = sub.add_parser("solve", help="plan an instance with a policy")
    s.add_argument("instance")
    s.add_argument(
        "--policy",
        default="ntp-pw",
        choices=[*PLANNERS, "all"],
        help="planner (default ntp-pw, the quick heuristic; Python's solve() defaults to "
        f"optimal); 'all' runs the policies {','.join(POLICIES)}",
    )
    s.add_argument("-o", "--output", help="write the plan here")
    s.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds for exact planners (default 60)"
    )
    s.add_argument("--threads", type=int, default=1, help="backend threads (1: deterministic)")
    s.add_argument(
        "--log",
        action="store_true",
        help="stream progress (incumbent, bound, gap) and the exact search log to stderr",
    )
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=run)
