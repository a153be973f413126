"""The ``ntp-opt replan`` sub-command: :func:`add_parser` and :func:`run`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from ntp_opt.app.cli.common import (
    make_console,
)
from ntp_opt.model.echo import echo
from ntp_opt.model.files import (
    InputError,
    load_instance,
    load_plan,
    read_json,
    save_instance,
    save_plan,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.safeio import check_target
from ntp_opt.rules.validate import evaluate


def parse_event(text: str) -> dict[str, Any]:
    """``fail:NODE[,NODE...]``, ``repair:NODE[,...]`` or ``speed:NODE[,...]=SPEED``."""
    kind, sep, rest = text.partition(":")
    if not sep or kind not in ("fail", "repair", "speed") or not rest:
        raise ValueError(
            f"--event {text!r}: expected fail:NODE[,NODE], repair:NODE[,NODE] or "
            "speed:NODE[,NODE]=SPEED"
        )
    speed = None
    if kind == "speed":
        rest, eq, value = rest.rpartition("=")
        if not eq:
            raise ValueError(f"--event {text!r}: a speed event ends with =SPEED")
        try:
            speed = float(value)
        except ValueError:
            raise ValueError(f"--event {text!r}: speed {value!r} is not a number") from None
    event: dict[str, Any] = {"kind": kind, "nodes": [n for n in rest.split(",") if n]}
    if speed is not None:
        event["speed"] = speed
    return event


def load_events(path: str) -> list[Any]:
    """Read a replan events file: a JSON list of ``{"kind", "nodes", "speed"?}``.

    Raises
    ------
    InputError
        Naming the file and the event (``[i].nodes``) of every problem.
    """
    from ntp_opt.workflows.replan import ClusterEvent

    data = read_json(Path(path))
    if not isinstance(data, list):
        raise InputError(path, [("", f"expected a JSON list of events, got {_kind(data)}")])
    events: list[Any] = []
    problems: list[tuple[str, str]] = []
    for i, e in enumerate(data):
        if not isinstance(e, dict):
            problems.append((f"[{i}]", f'expected an object {{"kind", "nodes"}}, got {_kind(e)}'))
            continue
        nodes = e.get("nodes")
        if not isinstance(nodes, list):
            problems.append((f"[{i}].nodes", f"expected a list of node ids, got {_kind(nodes)}"))
            continue
        bad = [n for n in nodes if isinstance(n, bool) or not isinstance(n, str | int)]
        if bad:
            problems.append(
                (f"[{i}].nodes", f"node ids are strings or integers, got {_kind(bad[0])}")
            )
            continue
        speed = e.get("speed")
        if speed is not None and (isinstance(speed, bool) or not isinstance(speed, int | float)):
            problems.append((f"[{i}].speed", f"expected a number, got {_kind(speed)}"))
            continue
        try:
            events.append(ClusterEvent.from_dict(e))
        except ValueError as err:
            problems.append((f"[{i}]", str(err)))
    if problems:
        raise InputError(path, problems)
    return events


def _kind(x: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }
    return "null" if x is None else names.get(type(x), f"a {type(x).__name__}")


def run(args: argparse.Namespace) -> int:
    from ntp_opt.rules.validate import PlanError, check
    from ntp_opt.workflows.replan import ClusterEvent, replan

    inputs = [p for p in (args.instance, args.plan, args.events) if p]
    outputs = [p for p in (args.output, args.instance_out) if p]
    for target in outputs:  # refuse unsafe outputs before any work
        check_target(target, inputs)
    if len(outputs) == 2 and Path(outputs[0]).resolve() == Path(outputs[1]).resolve():
        raise ValueError(f"{args.output}: -o and --instance-out name the same file")
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise ValueError(f"--tolerance: must be a finite number >= 0, got {args.tolerance!r}")
    instance = load_instance(args.instance)
    plan = load_plan(args.plan)
    try:
        check(instance, plan)
    except PlanError as err:
        raise ValueError(f"{args.plan}: not a valid running plan: {err}") from None
    events: list[Any] = []
    if args.events:
        events.extend(load_events(args.events))
    for text in args.event or []:
        try:
            events.append(ClusterEvent.from_dict(parse_event(text)))
        except ValueError as err:
            msg = str(err)
            raise ValueError(
                msg if msg.startswith("--event") else f"--event {text!r}: {msg}"
            ) from None
    try:
        out = replan(instance, plan, events, tolerance=args.tolerance, mode=args.mode)
    except PlanError:
        raise
    except ValueError as err:
        where = args.events or "--event"
        raise ValueError(f"{where}: {err}") from None
    con = make_console()
    con.print(
        f"{echo(instance.name)}: kept the {out.choice} plan, {out.moved} GPUs move; "
        f"relative goodput {out.relative_goodput:.6f} "
        f"(local {out.local_goodput * _rel(instance):.6f}"
        + (
            f", global {out.global_goodput * _rel(instance):.6f} moving {out.global_moved}"
            if out.global_goodput is not None
            else ""
        )
        + f"), bound {out.bound * _rel(instance):.6f}, gap {100 * out.gap:.3f} %, "
        f"{1000 * out.runtime_s:.0f} ms",
        markup=False,
    )
    before = evaluate(instance, plan)
    if before.feasible and out.relative_goodput > before.relative_goodput * (1 + 1e-9):
        con.print(
            f"relative goodput rose from {before.relative_goodput:.6f}: the re-plan also "
            "improves on the running plan where that was below the optimum, and failed "
            "GPUs free rack and site power to boost the others",
            markup=False,
        )
    if out.relative_goodput > 1.0 + 1e-9:
        con.print(
            "relative goodput > 1: power boost can beat the failure-free job at nominal "
            "power, the 1.0 reference (docs/model.md)",
            markup=False,
        )
    if args.output:
        save_plan(out.plan, args.output, inputs=inputs)
        con.print(f"wrote {echo(args.output)}")
    if args.instance_out:
        save_instance(out.instance, args.instance_out, inputs=inputs)
        con.print(f"wrote {echo(args.instance_out)}")
    elif args.output:
        con.print(
            f"note: {echo(args.output)} is a plan for the cluster after the events: validate or "
            "evaluate it against that instance, which --instance-out FILE writes "
            f"({echo(args.instance)} does not know about the events)",
            markup=False,
        )
    return 0


def _rel(instance: Instance) -> float:
    return instance.job.seq_time_s / instance.job.dp


def add_parser(sub: Any) -> None:
    """The ``ntp-opt replan`` subcommand."""
    rp = sub.add_parser(
        "replan", help="re-plan a running plan after failures, repairs or stragglers"
    )
    rp.add_argument("instance", help="the instance the plan was made for")
    rp.add_argument("plan", help="the running plan")
    rp.add_argument(
        "--event",
        action="append",
        metavar="EVENT",
        help="fail:NODE[,NODE], repair:NODE[,NODE] or speed:NODE[,NODE]=SPEED "
        "(GPU or tray ids; repeatable, applied after --events)",
    )
    rp.add_argument(
        "--events", metavar="FILE", help='JSON list of {"kind", "nodes", "speed"?} events'
    )
    rp.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="relative goodput traded to avoid migration (default 0.001)",
    )
    rp.add_argument("--mode", choices=["auto", "local", "global"], default="auto")
    rp.add_argument("-o", "--output", help="write the new plan here")
    rp.add_argument("--instance-out", help="write the instance after the events here")
    rp.set_defaults(func=run)
