"""``ntp-opt multi``: plan a training job and serving fleets together.

Registered by :func:`add_parser` in :mod:`ntp_opt.app.cli`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from ntp_opt.model.files import load_instance
from ntp_opt.model.safeio import check_target
from ntp_opt.multi.files import load_workloads, save_multi_plan
from ntp_opt.multi.milp import solve_multi
from ntp_opt.multi.static import solve_static
from ntp_opt.multi.validate import MultiEvaluation
from ntp_opt.multi.workloads import MultiInstance


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
        save_multi_plan(multi, res.plan, args.output, inputs=[args.instance, args.workloads])
        con.print(f"wrote {args.output}")
    return 0


def add_parser(sub: Any) -> None:
    """Add the ``multi`` sub-command to ``ntp-opt``'s sub-parsers."""
    m = sub.add_parser(
        "multi", help="plan a training job and serving fleets together (docs/workloads.md)"
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
