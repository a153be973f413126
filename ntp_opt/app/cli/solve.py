"""The ``ntp-opt solve`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ntp_opt.app.cli.common import (
    MAX_LINE,
    THREADS_PER_CORE,
    fitted_tables,
    fmt,
    instance_line,
    loading,
    make_console,
    status_console,
    stop_on_signals,
    stopped_status,
    threads_arg,
)
from ntp_opt.model.control import SolveProgress
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    load_instance,
    save_plan,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.safeio import check_target
from ntp_opt.planners.registry import REGISTRY
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


#: Columns of the summary table, by priority: the first :data:`KEPT` always show.
COLUMNS = (
    "policy",
    "rel. goodput",
    "rel. bound",
    "gap",
    "status",
    "time s",
    "goodput seq/s",
    "GPUs used",
    "replicas",
    "reduced",
    "power kW",
)
KEPT = 5


def summary_tables(rows: list[tuple[str, Result]], instance: Instance, width: int) -> list[Table]:
    """The policies' results as tables at most ``width`` columns wide.

    Policy, relative goodput, relative bound, gap and status always show in
    the first table; the other columns follow while they fit, the rest in
    tables below it (:func:`ntp_opt.app.cli.common.fitted_tables`).
    """
    job = instance.job
    cells = []
    for name, res in rows:
        status = str(res.status) + ("" if res.limit == "none" else f" ({res.limit})")
        ev = res.evaluation
        if ev is None:  # infeasible: no plan at all
            cells.append([name, "-", "-", "-", status, f"{res.runtime_s:.3f}", *["-"] * 5])
            continue
        cells.append(
            [
                name,
                fmt(res.relative_objective),
                "-" if res.bound is None else fmt(res.bound * job.seq_time_s / job.dp),
                "-" if res.gap is None else f"{res.gap:.1e}",
                status,
                f"{res.runtime_s:.3f}",
                fmt(res.objective, 2),
                str(ev.gpus_used),
                str(ev.n_replicas),
                str(ev.n_reduced),
                f"{ev.site_power_w / 1e3:.1f}",
            ]
        )
    title = f"{echo(instance.name)}: policies"
    return fitted_tables(title, COLUMNS, cells, width, KEPT, left=("status",))


def _explain_goodput(con: Console, rows: list[tuple[str, Result]]) -> None:
    """A footnote when a relative goodput above 1.0 would puzzle the reader."""
    if any((res.relative_objective or 0.0) > 1.0 + 1e-9 for _, res in rows):
        con.print(
            "relative goodput > 1: power boost (and, under elastic, a larger global "
            "batch) can beat the failure-free job at nominal power, which is the 1.0 "
            "reference (docs/model.md)",
            markup=False,
        )


def _explain_stops(con: Console, rows: list[tuple[str, Result]], time_limit: float) -> None:
    """A line per planner stopped by its time limit: the plan is valid, its proof is not done."""
    for name, res in rows:
        if res.limit != "time_limit":
            continue
        gap = "no bound" if res.gap is None else f"gap {res.gap:.1e}"
        what = "valid, not proven optimal" if res.plan is not None else "no plan found"
        con.print(
            f"{name}: stopped at the {time_limit:g} s time limit ({gap}; {what}): "
            "a longer --time-limit may do better"
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
            line += "; no bound (ws_bound=False, docs/risk.md)"
        else:
            line += (
                f", bound {fmt(res.bound * scale)}, gap {res.gap or 0.0:.1e}:"
                " the table's bound and gap are for it"
            )
        con.print(line, markup=False)


class StatusLine:
    """The live status line of one running solve (``ntp-opt solve`` on a terminal).

    :meth:`update` is the solve's progress callback; rendering reads the
    clock, so the elapsed time moves between reports. Goodputs are shown
    relative (1.0 = the failure-free job), as in the table.

    Parameters
    ----------
    planner
        Planner name.
    scale
        Goodput (sequences/s) to relative goodput.
    time_limit
        Shown as ``of N s`` for planners that use it, else ``None``.
    position
        ``"[2/5] "`` when several policies run, else ``""``.
    clock
        Seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        planner: str,
        scale: float,
        time_limit: float | None,
        position: str = "",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.planner = planner
        self.scale = scale
        self.time_limit = time_limit
        self.position = position
        self.clock = clock
        self.start = clock()
        self.progress: SolveProgress | None = None

    def update(self, progress: SolveProgress) -> None:
        """Take a progress report (the callback of :func:`ntp_opt.solve.solve`)."""
        self.progress = progress

    def text(self) -> str:
        """``[2/5] optimal  12 s of 60 s  incumbent 0.8806  bound 0.8807  gap 1.1e-04``."""
        elapsed = self.clock() - self.start
        limit = "" if self.time_limit is None else f" of {self.time_limit:g} s"
        parts = [f"{self.position}{self.planner}", f"{elapsed:.0f} s{limit}"]
        p = self.progress
        if p is None or p.incumbent is None:
            parts.append("no plan yet")
        else:
            parts.append(f"incumbent {fmt(p.incumbent * self.scale)}")
        if p is not None and p.bound is not None:
            parts.append(f"bound {fmt(p.bound * self.scale)}")
        if p is not None and p.gap is not None:
            parts.append(f"gap {p.gap:.1e}")
        return "  ".join(parts) + "  Ctrl-C: stop"

    def __rich__(self) -> Text:
        return Text(self.text(), no_wrap=True, overflow="ellipsis")


@contextlib.contextmanager
def _live(status: StatusLine | None) -> Iterator[Callable[[SolveProgress], None] | None]:
    """While inside, ``status`` is redrawn on stderr; yields the solve's callback."""
    if status is None:
        yield None
        return
    live = Live(
        status,
        console=status_console(),
        refresh_per_second=4,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    with live:
        yield status.update


def run(args: argparse.Namespace) -> int:
    if args.planner == "all" and args.output:
        raise ValueError(
            "-o/--output writes one plan: name one --planner (see `ntp-opt compare` "
            "for every policy side by side)"
        )
    if args.output:  # refuse an unsafe output before any work
        check_target(args.output, [args.instance])
    with loading():
        instance = load_instance(args.instance)
    con = make_console()
    con.print(instance_line(instance))
    policies = list(POLICIES) if args.planner == "all" else [args.planner]
    if args.planner == "all":
        con.print(
            f"--planner all runs the {len(POLICIES)} policies of docs/model.md section 5: "
            f"{', '.join(POLICIES)} (any of the {len(PLANNERS)} planners by name: "
            "--planner NAME)",
            markup=False,
        )
    rows = []
    cancel = threading.Event()
    live = not args.log and status_console().is_terminal  # piped stderr: nothing extra
    scale = instance.job.seq_time_s / instance.job.dp
    with _stream_log(args.log), stop_on_signals(cancel) as received:
        for k, name in enumerate(policies):
            status = None
            if live:
                limit = args.time_limit if REGISTRY[name].uses_time_limit else None
                where = f"[{k + 1}/{len(policies)}] " if len(policies) > 1 else ""
                status = StatusLine(name, scale, limit, where)
            with _live(status) as callback:
                res = solve(
                    instance,
                    name,
                    time_limit=args.time_limit,
                    seed=args.seed,
                    threads=args.threads,
                    callback=callback,
                    cancel=cancel,
                )
            if res.reason:
                con.print(f"{name}: {echo(res.reason, MAX_LINE)}")
            rows.append((name, res))
            if cancel.is_set():
                break  # Ctrl-C or SIGTERM: no further policy
    for table in summary_tables(rows, instance, con.width):
        con.print(table)
    _explain_goodput(con, rows)
    _explain_stops(con, rows, args.time_limit)
    _explain_expected(con, rows, instance)
    if args.output:
        plan = rows[0][1].plan
        if plan is None:
            raise ValueError(f"{args.instance}: {rows[0][1].reason}")
        save_plan(plan, args.output, inputs=[args.instance])
        con.print(f"wrote {echo(args.output)}")
    if cancel.is_set():
        return stopped_status(received)
    return 0


def add_parser(sub: Any) -> None:
    """The ``ntp-opt solve`` subcommand."""
    s = sub.add_parser("solve", help="plan an instance with a planner")
    s.add_argument("instance")
    s.add_argument(
        "--planner",
        default="ntp-pw",
        choices=[*PLANNERS, "all"],
        help="planner (default ntp-pw, the quick heuristic; Python's solve() defaults to "
        f"optimal); 'all' runs the policies {','.join(POLICIES)}",
    )
    # the option's name before issue 34, kept for old scripts
    s.add_argument("--policy", dest="planner", choices=[*PLANNERS, "all"], help=argparse.SUPPRESS)
    s.add_argument("-o", "--output", help="write the plan here")
    s.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds for exact planners (default 60)"
    )
    s.add_argument(
        "--threads",
        type=threads_arg,
        default=1,
        help=f"backend threads (1: deterministic; at most {THREADS_PER_CORE} per usable core)",
    )
    s.add_argument(
        "--log",
        action="store_true",
        help="stream progress (incumbent, bound, gap) and the exact search log to stderr",
    )
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=run)
