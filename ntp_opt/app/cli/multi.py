"""``ntp-opt multi``: plan a training job and serving fleets together.

``ntp-opt multi INSTANCE WORKLOADS`` plans one snapshot; ``ntp-opt multi replay
INSTANCE WORKLOADS TRACE -o OUT`` follows a demand trace with the re-planner and
the baselines (:mod:`ntp_opt.workflows.multi.replay`); ``ntp-opt multi trace
WORKLOADS --shape SHAPE -o OUT`` draws a demand trace
(:mod:`ntp_opt.workflows.multi.demand`).
Registered by :func:`add_parser` in :mod:`ntp_opt.app.cli`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from ntp_opt.model.files import load_instance
from ntp_opt.model.files.workloads import load_workloads, save_multi_plan
from ntp_opt.model.safeio import check_target
from ntp_opt.model.workloads import MultiInstance
from ntp_opt.planners.multi import solve_multi
from ntp_opt.rules.multi import MultiEvaluation, with_training_metrics
from ntp_opt.workflows.multi.demand import SHAPES, generate_demand, load_demand, save_demand
from ntp_opt.workflows.multi.migration import MigrationCost, ReplayOptions
from ntp_opt.workflows.multi.replay import (
    PLANNERS,
    replay,
    replay_document,
    summary,
    write_replay,
)
from ntp_opt.workflows.multi.static import solve_static

#: ``multi replay`` rewrites its output after every step up to this many steps, then
#: every :data:`WRITE_EVERY` steps (and always when interrupted or done).
WRITE_ALL = 200
WRITE_EVERY = 25


def _row(name: str, ev: MultiEvaluation, status: str, seconds: float) -> list[str]:
    cells = [name, f"{ev.weighted_goodput:.4f}", f"{ev.training.relative_goodput:.4f}"]
    cells += [f"{f.served:.4f} ({f.replicas})" for f in ev.fleets.values()]
    cells += [str(ev.idle_healthy), status, f"{seconds:.1f}"]
    return cells


def cmd_multi(args: argparse.Namespace) -> int:
    """Run ``ntp-opt multi``."""
    if args.output:
        check_target(args.output, [args.instance, args.workloads])  # refuse before solving
    multi = MultiInstance(load_instance(args.instance), load_workloads(args.workloads))
    con = Console(highlight=False, width=160)
    table = Table(title=f"{multi.name}: weighted goodput")
    for col in ("planner", "W", "training", *[f.name for f in multi.workloads.serving]):
        table.add_column(col)
    for col in ("idle GPUs", "status", "s"):
        table.add_column(col)
    res = solve_multi(
        multi,
        time_limit=args.time_limit,
        seed=args.seed,
        share_domains=not args.whole_domains,
    )
    if res.evaluation is None or res.plan is None:
        raise ValueError(f"{args.instance}: no plan: {res.status} ({res.reason})")
    gap = "" if res.gap is None else f", gap {res.gap:.1e}"
    table.add_row(*_row("milp", res.evaluation, f"{res.status}{gap}", res.runtime_s))
    if args.static:
        t0 = time.perf_counter()
        _, ev = solve_static(multi, time_limit=args.time_limit, seed=args.seed)
        ok = "feasible" if ev.feasible else "breaks a min share"
        table.add_row(*_row("static", ev, ok, time.perf_counter() - t0))
    con.print(table)
    if args.output:
        plan = with_training_metrics(multi, res.plan)
        save_multi_plan(plan, args.output, inputs=[args.instance, args.workloads])
        con.print(f"wrote {args.output}")
    return 0


@dataclass
class _ReplayOutput:
    """The replay report being written step by step, and the console lines."""

    output: str
    inputs: list[str]
    multi: MultiInstance
    meta: Mapping[str, Any]
    options: ReplayOptions
    planners: list[str]
    con: Console
    records: list[dict[str, Any]] = field(default_factory=list)

    def write(self, complete: bool) -> None:
        """Write the report of the steps done so far."""
        doc = replay_document(
            self.multi, self.meta, self.options, self.records, self.planners, complete
        )
        write_replay(self.output, doc, self.inputs)

    def on_step(self, rec: dict[str, Any]) -> None:
        """Keep a finished step, write it (at first every one), print its line."""
        self.records.append(rec)
        if len(self.records) <= WRITE_ALL or len(self.records) % WRITE_EVERY == 0:
            self.write(False)  # finished steps are on disk even if the process is killed
        cells = [
            f"{p} W {rec[p]['weighted_goodput']:.4f} moved {rec[p]['gpus_moved']}"
            for p in self.planners
        ]
        self.con.print(f"step {rec['step']} t={rec['time_s']:g}s: " + "; ".join(cells))


def cmd_replay(args: argparse.Namespace) -> int:
    """Run ``ntp-opt multi replay``."""
    inputs = [args.instance, args.workloads, args.trace]
    check_target(args.output, inputs)  # refuse before any work
    planners = [p for p in args.planners.split(",") if p]
    unknown = [p for p in planners if p not in PLANNERS]
    if unknown or not planners:
        raise ValueError(f"--planners: {args.planners!r}: choose among {','.join(PLANNERS)}")
    options = ReplayOptions(
        MigrationCost(
            args.serving_start_s, args.serving_stop_s, args.training_restart_s, args.horizon_s
        ),
        deadband=args.deadband,
        tolerance=args.tolerance,
        margin=args.margin,
        migration=not args.no_migration,
    )
    multi = MultiInstance(load_instance(args.instance), load_workloads(args.workloads))
    trace = load_demand(args.trace)
    trace.check_fleets(multi.workloads, args.trace)
    con = Console(highlight=False, width=160)
    out = _ReplayOutput(args.output, inputs, multi, trace.meta, options, planners, con)
    records = out.records
    write, on_step = out.write, out.on_step
    try:
        replay(
            multi,
            trace,
            options=options,
            planners=planners,
            time_limit=args.time_limit,
            seed=args.seed,
            on_step=on_step,
            source=args.trace,
        )
    except BaseException:  # Ctrl-C, SIGTERM, an error: keep every finished step
        if records:
            write(False)
        raise
    write(True)
    table = Table(title=f"{multi.name}: replay of {len(records)} steps")
    for col in ("planner", "mean W", "net W", "GPUs moved", "per step", "median CPU s"):
        table.add_column(col)
    for p in planners:
        s = summary(records, p)
        table.add_row(
            p,
            f"{s['mean_weighted_goodput']:.4f}",
            f"{s['mean_net_weighted_goodput']:.4f}",
            str(s["gpus_moved_total"]),
            f"{s['gpus_moved_per_step']:.1f}",
            f"{s['median_decision_cpu_s']:.3f}",
        )
    con.print(table)
    con.print(f"wrote {args.output}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """Run ``ntp-opt multi trace``."""
    check_target(args.output, [args.workloads])
    workloads = load_workloads(args.workloads)
    trace = generate_demand(
        workloads,
        args.shape,
        steps=args.steps,
        step_s=args.step_s,
        seed=args.seed,
        noise=args.noise,
    )
    save_demand(trace, args.output, [args.workloads])
    print(f"wrote {args.output} ({len(trace.steps)} steps, shape {args.shape})")
    return 0


def _replay_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("instance", help="instance file (cluster and training job)")
    p.add_argument("workloads", help="workloads file (format ntp-opt/workloads@1)")
    p.add_argument("trace", help="demand trace (format ntp-opt/demand@1)")
    p.add_argument("-o", "--output", required=True, help="replay report (ntp-opt/replay@1)")
    p.add_argument(
        "--planners",
        default=",".join(PLANNERS),
        help=f"comma-separated, among {','.join(PLANNERS)} (default all)",
    )
    p.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds per MILP solve (default 60)"
    )
    p.add_argument("--seed", type=int, default=0)
    d = MigrationCost()
    o = ReplayOptions()
    p.add_argument(
        "--serving-start-s",
        type=float,
        default=d.serving_start_s,
        help=f"seconds a started replica serves nothing (default {d.serving_start_s:g})",
    )
    p.add_argument(
        "--serving-stop-s",
        type=float,
        default=d.serving_stop_s,
        help=f"seconds of a stopped replica's work lost (default {d.serving_stop_s:g})",
    )
    p.add_argument(
        "--training-restart-s",
        type=float,
        default=d.training_restart_s,
        help=f"training time lost when its GPUs change (default {d.training_restart_s:g})",
    )
    p.add_argument(
        "--horizon-s",
        type=float,
        default=d.horizon_s,
        help=f"seconds a move pays off over (default {d.horizon_s:g})",
    )
    p.add_argument(
        "--deadband",
        type=float,
        default=o.deadband,
        help=f"relative demand change ignored (default {o.deadband:g})",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=o.tolerance,
        help=f"W lost inside the deadband before re-planning (default {o.tolerance:g})",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=o.margin,
        help=f"weighted goodput a re-plan must gain net (default {o.margin:g})",
    )
    p.add_argument(
        "--no-migration", action="store_true", help="no migration cost or hysteresis (an ablation)"
    )
    p.set_defaults(func=cmd_replay, command="multi")


def _trace_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("workloads", help="workloads file: the fleets and their base demand")
    p.add_argument("--shape", choices=SHAPES, required=True)
    p.add_argument("--steps", type=int, default=48, help="number of steps (default 48)")
    p.add_argument("--step-s", type=float, default=1800.0, help="seconds per step (default 1800)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", type=float, default=0.03, help="log-normal sigma (default 0.03)")
    p.add_argument("-o", "--output", required=True, help="demand trace (ntp-opt/demand@1)")
    p.set_defaults(func=cmd_trace, command="multi")


@dataclass(frozen=True)
class _Dispatch:
    """``multi``'s ``parse_known_args``: 'replay' / 'trace' first go to that sub-command's
    parser, anything else to the snapshot planner's."""

    subs: dict[str, argparse.ArgumentParser]
    plain: Callable[..., tuple[argparse.Namespace, list[str]]]

    def __call__(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse ``args`` with the parser its first word names."""
        if args and args[0] in self.subs:
            return self.subs[args[0]].parse_known_args(list(args[1:]), namespace)
        return self.plain(args, namespace)


def add_parser(sub: Any) -> None:
    """Add the ``multi`` sub-command to ``ntp-opt``'s sub-parsers."""
    m = sub.add_parser(
        "multi",
        help="plan a training job and serving fleets together (docs/workloads.md)",
        description=(
            "Plan a training job and serving fleets together. Also: 'ntp-opt multi replay "
            "INSTANCE WORKLOADS TRACE -o OUT' (follow a demand trace) and 'ntp-opt multi "
            "trace WORKLOADS --shape SHAPE -o OUT' (draw one); see their --help."
        ),
    )
    m.add_argument("instance", help="instance file (cluster and training job)")
    m.add_argument("workloads", help="workloads file (format ntp-opt/workloads@1)")
    m.add_argument("--time-limit", type=float, default=60.0, help="seconds (default 60)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--static", action="store_true", help="also run the static partition")
    m.add_argument(
        "--whole-domains", action="store_true", help="no serving inside training domains"
    )
    m.add_argument("-o", "--output", help="write the plan (ntp-opt/multi-plan@1)")
    m.set_defaults(func=cmd_multi)
    kinds = {
        "replay": ("follow a demand trace: re-planner, static partition, MILP", _replay_parser),
        "trace": ("draw a seeded demand trace (ntp-opt/demand@1)", _trace_parser),
    }
    subs: dict[str, argparse.ArgumentParser] = {}
    for name, (text, build) in kinds.items():
        p = type(m)(prog=f"{m.prog} {name}", description=text)
        build(p)
        subs[name] = p
    setattr(m, "parse_known_args", _Dispatch(subs, m.parse_known_args))  # noqa: B010
