"""The ``ntp-opt`` command line.

Every sub-command reads and writes the JSON formats of :mod:`ntp_opt.files`.
Bad input ends with one line ``ntp-opt: error: FILE: FIELD: message`` and exit
status 2; an infeasible plan given to ``validate`` exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ntp_opt.model import files, hardware, topology
from ntp_opt.model.files import (
    InputError,
    json_schema,
    load_instance,
    load_plan,
    read_json,
    save_instance,
    save_plan,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.safeio import check_target
from ntp_opt.rules.validate import Evaluation, evaluate
from ntp_opt.solve import EXACT, PLANNERS, POLICIES, Result, solve

EPILOG = """\
examples:
  ntp-opt gen --builder nvl32 --gpus 4096 --fail-fraction 0.002 --tp 32 --pp 8 \\
      --global-batch 256 -o my.json       write an instance
  ntp-opt import slurm --topology topology.yaml --nodes nodes.txt \\
      --job job.json -o my.json           from a real cluster (also: import k8s)
  ntp-opt info my.json                       what is in it
  ntp-opt solve my.json --policy ntp-pw -o plan.json
  ntp-opt compare my.json                    every policy side by side
  ntp-opt validate my.json plan.json         exit 1 if the plan breaks a rule
  ntp-opt evaluate my.json plan.json --json  recomputed goodput
  ntp-opt schema instance                    the JSON Schema of instance files
  ntp-opt export --to megatron-ntp plan.json --instance my.json -o launch/
  ntp-opt serve --port 8000                  HTTP/JSON service on 127.0.0.1
  ntp-opt plot my.json plan.json -o plan.html  a picture of the plan
"""


EXACT_NAMES = set(EXACT)
MAX_NAME = 200
"""Longest instance name (the instance file schema's limit)."""

#: Exit status after Ctrl-C (128 + SIGINT); the best plan found is still written.
INTERRUPTED_EXIT = 130


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


def _progress_bar(quiet: bool) -> Any:
    """A rich progress bar with ETA on stderr; disabled when quiet or not a terminal."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=quiet or not console.is_terminal,
        transient=True,
    )


def _interrupted_note() -> None:
    print("ntp-opt: interrupted: the best plan found so far is kept", file=sys.stderr)


def _console() -> Console:
    # Wide enough for the tables when the output is a file or a pipe.
    con = Console(highlight=False)
    if not con.is_terminal:
        con = Console(highlight=False, width=160)
    return con


def _fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


_GEN_FLAGS = {
    "tp": "--tp",
    "pp": "--pp",
    "dp": "--dp",
    "global_batch": "--global-batch",
    "seq_time_s": "--seq-time",
    "batch_policy": "--batch-policy",
}


def _cmd_gen(args: argparse.Namespace) -> int:
    check_target(args.output)  # refuse an unsafe output before any work
    name = args.name if args.name is not None else Path(args.output).name.split(".")[0]
    if not name or len(name) > MAX_NAME:
        where = "--name" if args.name is not None else f"{args.output}: the file name"
        raise ValueError(
            f"{where}: an instance name has 1 to {MAX_NAME} characters, got {len(name)}"
            + ("" if args.name is not None else " (give --name)")
        )
    if args.gpus > files.MAX_NODES:  # an instance file holds at most MAX_NODES nodes
        raise ValueError(f"--gpus: at most {files.MAX_NODES} GPUs fit in an instance file")
    kw: dict[str, Any] = {"rack_power_factor": args.rack_power_factor}
    board = hardware.product(args.product) if args.product else None
    if args.tdp_w is not None:
        kw["tdp_w"] = args.tdp_w
    elif board is not None:
        kw["tdp_w"] = board.tdp_w
    if board is not None and kw["tdp_w"] > board.max_power_w:
        raise ValueError(
            f"--tdp-w {kw['tdp_w']:g} is above the {board.name} maximum power limit "
            f"{board.max_power_w:g} W"
        )
    graph = topology.build(args.builder, args.gpus, **kw)
    meta: dict[str, Any] = {
        "builder": args.builder,
        "gpus": args.gpus,
        "seed": args.seed,
        "rack_power_factor": args.rack_power_factor,
    }
    if board is not None:
        # every board accepts at most the product's maximum power limit (docs/model.md, spec v1.1)
        for _, d in graph.nodes(data=True):
            if d["kind"] == "gpu":
                d["max_power_w"] = board.max_power_w
        meta["product"] = board.key
    if args.fail_fraction is not None or args.fail_count is not None:
        failed = topology.fail_random(
            graph,
            fraction=args.fail_fraction,
            count=args.fail_count,
            unit=args.fail_unit,
            seed=args.seed,
        )
        meta["failed"] = {"unit": args.fail_unit, "count": len(failed)}
    if args.stragglers:
        topology.add_stragglers(
            graph, count=args.stragglers, speed=args.straggler_speed, seed=args.seed + 1
        )
        meta["stragglers"] = {"count": args.stragglers, "speed": args.straggler_speed}
    if args.p_fail:
        topology.set_p_fail(graph, args.p_fail)
    if graph.number_of_nodes() > files.MAX_NODES:
        raise ValueError(
            f"--gpus: the cluster has {graph.number_of_nodes()} nodes with its trays, domains "
            f"and racks; an instance file holds at most {files.MAX_NODES}"
        )
    try:  # what gen writes must load: check the values the flags produced
        files.check_cluster(graph, args.output)
    except InputError as err:
        raise ValueError(f"not written: {str(err).splitlines()[0]} (check the flags)") from None
    domains = topology.domains(graph)
    per_domain = graph.nodes[domains[0]]["size"] // args.tp if domains else 0
    dp = args.dp if args.dp is not None else max(1, len(domains) * per_domain // args.pp)
    try:
        job = Job(
            tp=args.tp,
            pp=args.pp,
            dp=dp,
            global_batch=args.global_batch if args.global_batch is not None else 16 * dp,
            batch_policy=args.batch_policy,
            seq_time_s=args.seq_time,
        )
    except ValidationError as err:
        raise ValueError(_validation_text(err, _GEN_FLAGS)) from None
    instance = Instance(name, graph, job, meta)
    save_instance(instance, args.output)
    s = instance.summary()
    _console().print(
        f"wrote {args.output}: {s['gpus']} GPUs ({s['failed']} failed, {s['stragglers']} "
        f"stragglers), {s['domains']} domains, job TP{job.tp} x PP{job.pp} x DP{job.dp}, "
        f"B={job.global_batch} ({job.batch_policy})"
    )
    return 0


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
            _fmt(res.relative_objective),
            "-" if res.bound is None else _fmt(res.bound * job.seq_time_s / job.dp),
            "-" if res.gap is None else f"{res.gap:.1e}",
            _fmt(res.objective, 2),
            str(ev.n_replicas),
            str(ev.n_reduced),
            str(ev.gpus_used),
            f"{ev.site_power_w / 1e3:.1f}",
            str(res.status) + ("" if res.limit == "none" else f" ({res.limit})"),
            f"{res.runtime_s:.3f}",
        )
    return table


def _instance_line(instance: Instance) -> str:
    s = instance.summary()
    return (
        f"{s['name']}: {s['gpus']} GPUs in {s['domains']} domains / {s['racks']} racks, "
        f"{s['failed']} failed, {s['stragglers']} stragglers; job TP{s['tp']} x PP{s['pp']} "
        f"x DP{s['dp']}, global batch {s['global_batch']} ({s['batch_policy']})"
    )


def _cmd_info(args: argparse.Namespace) -> int:
    instance = load_instance(args.instance)
    con = _console()
    con.print(_instance_line(instance))
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


def _explain_goodput(con: Console, rows: list[tuple[str, Result]]) -> None:
    """A footnote when a relative goodput above 1.0 would puzzle the reader."""
    if any((res.relative_objective or 0.0) > 1.0 + 1e-9 for _, res in rows):
        con.print(
            "relative goodput > 1: power boost (and, under elastic, a larger global "
            "batch) can beat the failure-free job at nominal power, which is the 1.0 "
            "reference (docs/model.md)",
            markup=False,
        )


def _cmd_solve(args: argparse.Namespace) -> int:
    if args.policy == "all" and args.output:
        raise ValueError(
            "-o/--output writes one plan: name one --policy (see `ntp-opt compare` "
            "for every policy side by side)"
        )
    if args.output:  # refuse an unsafe output before any work
        check_target(args.output, [args.instance])
    instance = load_instance(args.instance)
    con = _console()
    con.print(_instance_line(instance))
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
    with _stream_log(args.log):
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
                break  # Ctrl-C: no further policy
    con.print(_summary_table(rows, instance))
    _explain_goodput(con, rows)
    if args.output:
        plan = rows[0][1].plan
        if plan is None:
            raise ValueError(f"{args.instance}: {rows[0][1].reason}")
        save_plan(plan, args.output, inputs=[args.instance])
        con.print(f"wrote {args.output}")
    if cancel.is_set():
        _interrupted_note()
        return INTERRUPTED_EXIT
    return 0


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


def _cmd_replan(args: argparse.Namespace) -> int:
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
    con = _console()
    con.print(
        f"{instance.name}: kept the {out.choice} plan, {out.moved} GPUs move; relative goodput "
        f"{out.relative_goodput:.6f} (local {out.local_goodput * _rel(instance):.6f}"
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
        con.print(f"wrote {args.output}")
    if args.instance_out:
        save_instance(out.instance, args.instance_out, inputs=inputs)
        con.print(f"wrote {args.instance_out}")
    elif args.output:
        con.print(
            f"note: {args.output} is a plan for the cluster after the events: validate or "
            "evaluate it against that instance, which --instance-out FILE writes "
            f"({args.instance} does not know about the events)",
            markup=False,
        )
    return 0


def _rel(instance: Instance) -> float:
    return instance.job.seq_time_s / instance.job.dp


def _cmd_compare(args: argparse.Namespace) -> int:
    con = _console()
    policies = args.policies.split(",") if args.policies else list(POLICIES)
    unknown = [p for p in policies if p not in PLANNERS]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(PLANNERS)}")
    table = Table(title="relative goodput (1.0 = no failures)", title_justify="left")
    table.add_column("instance")
    table.add_column("GPUs", justify="right")
    table.add_column("failed", justify="right")
    for p in policies:
        table.add_column(p, justify="right")
    cancel = threading.Event()
    above_one = False
    with _progress_bar(args.quiet) as bar:
        task = bar.add_task("compare", total=len(args.instances) * len(policies))
        for path in args.instances:
            bar.update(task, description=f"{Path(path).name}: loading")
            start = time.perf_counter()
            instance = load_instance(path)
            load_s = time.perf_counter() - start
            values = []
            for p in policies:
                bar.update(task, description=f"{Path(path).name}: {p}")
                res = solve(instance, p, time_limit=args.time_limit, cancel=cancel)
                mark = "" if res.status != "feasible" or p not in EXACT_NAMES else "*"
                values.append(_fmt(res.relative_objective) + mark)
                above_one = above_one or (res.relative_objective or 0.0) > 1.0 + 1e-9
                bar.advance(task)
                if cancel.is_set():
                    break
            values += ["-"] * (len(policies) - len(values))
            s = instance.summary()
            table.add_row(s["name"], str(s["gpus"]), str(s["failed"]), *values)
            if args.verbose:
                con.print(f"{path}: loaded in {load_s:.2f} s")
            if cancel.is_set():
                break
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
        _interrupted_note()
        return INTERRUPTED_EXIT
    return 0


def _print_eval(ev: Evaluation, as_json: bool) -> None:
    if as_json:
        data = {
            **ev.as_metrics(),
            "feasible": ev.feasible,
            "violations": [str(v) for v in ev.violations],
        }
        print(json.dumps(data, indent=1))
        return
    con = _console()
    con.print(f"feasible: {'yes' if ev.feasible else 'NO'}")
    con.print(f"relative goodput: {ev.relative_goodput:.6f}")
    con.print(f"goodput: {ev.goodput:.6g} sequences/s, step time {ev.step_time:.6g} s")
    con.print(
        f"replicas: {ev.n_replicas} ({ev.n_reduced} below nominal TP), "
        f"local batches sum to {ev.total_batch}, {ev.gpus_used} GPUs used"
    )
    con.print(f"site power: {ev.site_power_w / 1e3:.3f} kW")
    for v in ev.violations:
        con.print(f"  {v}")


def _cmd_validate(args: argparse.Namespace) -> int:
    instance = load_instance(args.instance)
    plan = load_plan(args.plan)
    ev = evaluate(instance, plan)
    if ev.feasible:
        print(
            f"{args.plan}: valid plan for {instance.name} "
            f"(relative goodput {ev.relative_goodput:.6f})"
        )
        return 0
    print(f"{args.plan}: {len(ev.violations)} violation(s):")
    for v in ev.violations:
        print(f"  {v}")
    return 1


def _cmd_evaluate(args: argparse.Namespace) -> int:
    instance = load_instance(args.instance)
    ev = evaluate(instance, load_plan(args.plan))
    _print_eval(ev, args.json)
    return 0 if ev.feasible else 1


def _cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(args.kind), indent=2))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from ntp_opt.app.bench import run_bench, summary, update_best_known

    planners = args.planners.split(",") if args.planners else list(POLICIES)
    seeds = [int(x) for x in args.seeds.split(",")]
    timeout = args.timeout if args.timeout is not None else args.time_limit + 60.0
    best_known: Path | Literal["auto"] | None = (
        None if args.no_best_known else Path(args.best_known) if args.best_known else "auto"
    )
    workers = args.workers if args.workers is not None else (None if args.backend == "ray" else 1)
    if args.backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError("--backend ray needs ray: pip install 'ntp-opt[ray]'") from None
    rows = run_bench(
        [Path(p) for p in args.paths],
        planners,
        seeds,
        Path(args.output),
        time_limit=args.time_limit,
        timeout=timeout,
        workers=workers,
        progress=not args.quiet and Console(stderr=True).is_terminal,
        backend=args.backend,
        ray_address=args.ray_address,
        best_known=None,
    )
    print(summary(rows))
    print(f"wrote {Path(args.output) / 'results.jsonl'}, summary.md and plots")
    if best_known is not None:
        for table, changes in update_best_known(rows, best_known).items():
            print(f"{table}: {len(changes)} improvement{'s' if len(changes) != 1 else ''}")
            for line in changes:
                print(f"  {line}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ntp_opt.app.export import equal_batch, export_megatron, power_only
    from ntp_opt.planners.megatron import MegatronError
    from ntp_opt.rules.validate import PlanError

    instance = load_instance(args.instance)
    plan = load_plan(args.plan)
    hosts = [h for h in (args.placeholder_hosts or "").split(",") if h]
    try:
        if args.equal_batch:
            before = plan.metrics.get("relative_goodput")
            plan = equal_batch(instance, plan)
            print(
                f"equal local batch {plan.replicas[0].local_batch if plan.replicas else 0}: "
                f"relative goodput {before} -> {plan.metrics.get('relative_goodput')}"
            )
        if args.to == "power-limits":
            written = power_only(instance, plan, args.output, inputs=[args.plan, args.instance])
            print(f"wrote {', '.join(written)} in {args.output}")
            return 0
        ex = export_megatron(
            instance,
            plan,
            args.output,
            reorder=args.reorder,
            placeholder_hosts=hosts,
            placeholder_gpus=args.placeholder_gpus,
            inputs=[args.plan, args.instance],
        )
    except (PlanError, MegatronError) as err:
        violations = err.violations
        v = violations[0]
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        print(f"ntp-opt: error: {args.plan}: {v.rule}: {v.message}{more}", file=sys.stderr)
        return 2
    print(f"wrote {len(ex.files)} files in {args.output} (see {args.output}/LAUNCH.md)")
    if ex.torchrun_note:
        print(f"note: {ex.torchrun_note}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    import io

    from ntp_opt.app.plot import plan_html
    from ntp_opt.model.safeio import atomic_write

    out = Path(args.output)
    kind = out.suffix.lower().lstrip(".")
    if kind not in ("svg", "png", "pdf", "html"):
        raise ValueError(f"{out}: -o must end in .svg, .png, .pdf or .html")
    from ntp_opt.app.plot import plan_layout

    instance = load_instance(args.instance)
    plan = load_plan(args.plan)
    diff = load_plan(args.diff) if args.diff is not None else None
    for file, p in ((args.plan, plan), (args.diff, diff)):
        try:
            if p is not None:
                plan_layout(instance, p)  # every GPU must be in the instance
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from None
    inputs = [args.instance, args.plan] + ([args.diff] if args.diff is not None else [])
    if kind == "html":
        atomic_write(out, plan_html(instance, plan, diff), inputs)
    else:
        try:
            import matplotlib

            matplotlib.use("Agg")
        except ImportError:
            raise ValueError(
                f"{out}: writing .{kind} needs matplotlib: pip install 'ntp-opt[plot]' "
                "(.html needs nothing)"
            ) from None
        import matplotlib.pyplot as plt

        from ntp_opt.app.plot import plan_figure

        fig = plan_figure(instance, plan, diff)
        buf = io.BytesIO()
        fig.savefig(buf, format=kind, dpi=args.dpi)
        plt.close(fig)
        atomic_write(out, buf.getvalue(), inputs)
    print(f"wrote {out}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from ntp_opt.app.service import serve
    except ImportError as err:
        raise ValueError(f"serve needs {err.name}: pip install 'ntp-opt[serve]'") from None
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"ntp-opt: warning: listening on {args.host}, not loopback", file=sys.stderr)
    from ntp_opt.app.service import DEFAULT_ALLOWED_HOSTS, Limits

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: {args.port} is not a port number (0-65535)")
    limits = Limits(
        max_body_bytes=int(args.max_body_mb * 1024**2),
        max_time_limit=args.max_time_limit,
        max_concurrent=args.max_concurrent,
        max_requests=args.max_requests,
        memory_bytes=int(args.max_memory_mb * 1024**2),
        body_timeout=args.body_timeout,
        request_timeout=args.request_timeout,
        allowed_hosts=tuple(args.allow_host or DEFAULT_ALLOWED_HOSTS),
    )
    serve(args.host, args.port, limits=limits)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 0..65535, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``ntp-opt: error: ...``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ntp-opt: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ntp-opt`` (exposed for docs and tests)."""
    parser = _Parser(
        prog="ntp-opt",
        description=(
            "Plan LLM training with nonuniform tensor parallelism on a GPU cluster "
            "that has failed, slow or risky GPUs."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for add in (
        _add_gen,
        _add_info,
        _add_solve,
        _add_replan,
        _add_compare,
        _add_validate,
        _add_evaluate,
        _add_schema,
        _add_bench,
        _add_export,
        _add_plot,
        _add_serve,
    ):
        add(sub)

    from ntp_opt.multi.cli import add_parser as add_multi_parser

    add_multi_parser(sub)
    from ntp_opt.app.importers.cli import add_parser as add_import_parser

    add_import_parser(sub)
    return parser


def _add_gen(sub: Any) -> None:
    """The ``ntp-opt gen`` subcommand."""
    g = sub.add_parser("gen", help="write an instance from a cluster builder and a job")
    g.add_argument(
        "--builder",
        choices=sorted(topology.BUILDERS),
        default="nvl32",
        help="cluster kind (default nvl32)",
    )
    g.add_argument(
        "--gpus", type=_positive_int, required=True, help="number of GPUs (whole domains)"
    )
    g.add_argument("--fail-fraction", type=float, help="fraction of GPUs (or trays) failed")
    g.add_argument("--fail-count", type=int, help="number of GPUs (or trays) failed")
    g.add_argument("--fail-unit", choices=["gpu", "tray"], default="gpu")
    g.add_argument("--stragglers", type=int, default=0, help="number of slow GPUs")
    g.add_argument("--straggler-speed", type=float, default=0.8)
    g.add_argument("--p-fail", type=float, default=0.0, help="per-GPU failure probability")
    g.add_argument(
        "--rack-power-factor",
        type=float,
        default=1.0,
        help="rack budget as a multiple of its GPUs' TDP (default 1.0)",
    )
    g.add_argument(
        "--tdp-w",
        type=float,
        help="GPU power limit when not boosted, in watts (default: the product's, else "
        "the builder's)",
    )
    g.add_argument(
        "--product",
        choices=sorted(hardware.PRODUCTS),
        help="GPU product (ntp_opt.hardware): its board power as tdp_w and its maximum "
        "power limit as every GPU's max_power_w (default: none, the builder's TDP and "
        "boost up to 1 + max_boost)",
    )
    g.add_argument("--tp", type=_positive_int, required=True, help="nominal TP degree")
    g.add_argument("--pp", type=_positive_int, default=1, help="pipeline stages per replica")
    g.add_argument(
        "--dp", type=_positive_int, help="replicas (default: as many as the cluster holds)"
    )
    g.add_argument(
        "--global-batch", type=_positive_int, help="sequences per step (default 16 x dp)"
    )
    g.add_argument("--batch-policy", choices=["fixed", "elastic"], default="fixed")
    g.add_argument("--seq-time", type=float, default=1.0, help="seconds per sequence (c)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--name", help="instance name (default: output file stem)")
    g.add_argument("-o", "--output", required=True, help="instance file (.json or .json.gz)")
    g.set_defaults(func=_cmd_gen)


def _add_info(sub: Any) -> None:
    """The ``ntp-opt info`` subcommand."""
    i = sub.add_parser("info", help="summarise an instance file")
    i.add_argument("instance")
    i.set_defaults(func=_cmd_info)


def _add_solve(sub: Any) -> None:
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
    s.set_defaults(func=_cmd_solve)


def _add_replan(sub: Any) -> None:
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
    rp.set_defaults(func=_cmd_replan)


def _add_compare(sub: Any) -> None:
    """The ``ntp-opt compare`` subcommand."""
    c = sub.add_parser("compare", help="relative goodput of several policies on instances")
    c.add_argument("instances", nargs="+")
    c.add_argument("--policies", help=f"comma-separated (default {','.join(POLICIES)})")
    c.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds per exact solve (default 60)"
    )
    c.add_argument("-v", "--verbose", action="store_true")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
    c.set_defaults(func=_cmd_compare)


def _add_validate(sub: Any) -> None:
    """The ``ntp-opt validate`` subcommand."""
    v = sub.add_parser("validate", help="check a plan against every rule; exit 1 if broken")
    v.add_argument("instance")
    v.add_argument("plan")
    v.set_defaults(func=_cmd_validate)


def _add_evaluate(sub: Any) -> None:
    """The ``ntp-opt evaluate`` subcommand."""
    e = sub.add_parser("evaluate", help="recompute a plan's goodput and power")
    e.add_argument("instance")
    e.add_argument("plan")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(func=_cmd_evaluate)


def _add_schema(sub: Any) -> None:
    """The ``ntp-opt schema`` subcommand."""
    sc = sub.add_parser("schema", help="print the JSON Schema of instance or plan files")
    sc.add_argument("kind", choices=["instance", "plan"])
    sc.set_defaults(func=_cmd_schema)


def _add_bench(sub: Any) -> None:
    """The ``ntp-opt bench`` subcommand."""
    b = sub.add_parser("bench", help="run planners x seeds on many instances; resumable")
    b.add_argument("paths", nargs="+", help="instance files or directories of them")
    b.add_argument("--planners", help=f"comma-separated (default {','.join(POLICIES)})")
    b.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
    b.add_argument("-o", "--output", default="bench-results", help="output directory")
    b.add_argument(
        "--time-limit", type=float, default=30.0, help="seconds per exact solve (default 30)"
    )
    b.add_argument(
        "--timeout", type=float, help="hard seconds per run, then killed (default time limit + 60)"
    )
    b.add_argument(
        "--workers",
        type=int,
        help="runs in flight at once (default 1; with --backend ray the cluster's CPUs)",
    )
    b.add_argument(
        "--backend",
        choices=["process", "ray"],
        default="process",
        help="local process pool (default) or a Ray cluster (needs ntp-opt[ray])",
    )
    b.add_argument(
        "--ray-address",
        help="ray.init address for --backend ray ('auto': this machine's cluster; "
        "default: a new local Ray)",
    )
    bk = b.add_mutually_exclusive_group()
    bk.add_argument(
        "--best-known",
        metavar="PATH",
        help="best-known table to update (default: best_known.json beside the instance "
        "files or one folder up, e.g. instances/best_known.json, if it exists)",
    )
    bk.add_argument(
        "--no-best-known", action="store_true", help="do not update any best-known table"
    )
    b.set_defaults(func=_cmd_bench)


def _add_export(sub: Any) -> None:
    """The ``ntp-opt export`` subcommand."""
    x = sub.add_parser("export", help="write a plan's launch configuration for a runtime")
    x.add_argument("plan", help="plan file")
    x.add_argument(
        "--to",
        choices=["megatron-ntp", "power-limits"],
        required=True,
        help="megatron-ntp: Megatron-LM NTP config, launchers and power limits "
        "(docs/export.md); power-limits: only the nvidia-smi scripts",
    )
    x.add_argument("--instance", required=True, help="the plan's instance file")
    x.add_argument("-o", "--output", required=True, help="output directory")
    x.add_argument("--reorder", action="store_true", help="move reduced replicas first")
    x.add_argument(
        "--uniform-batch",
        action="store_true",
        help="accepted for compatibility: one local batch is now always required",
    )
    x.add_argument(
        "--equal-batch",
        action="store_true",
        help="give every replica the same local batch first (the smallest; fixed: B / replicas)",
    )
    x.add_argument(
        "--placeholder-hosts",
        metavar="H1,H2,...",
        help="hosts outside the plan that may run the inactive (placeholder) ranks",
    )
    x.add_argument(
        "--placeholder-gpus",
        type=int,
        metavar="N",
        help="GPUs per placeholder host (default: the most GPUs of one cluster host)",
    )
    x.set_defaults(func=_cmd_export)


def _add_plot(sub: Any) -> None:
    """The ``ntp-opt plot`` subcommand."""
    pl = sub.add_parser(
        "plot", help="draw a plan: GPU map and rack power (.svg/.png) or an HTML page"
    )
    pl.add_argument("instance", help="instance file")
    pl.add_argument("plan", help="plan file")
    pl.add_argument(
        "-o",
        "--output",
        required=True,
        help="FILE.svg, FILE.png, FILE.pdf (matplotlib) or FILE.html (self-contained page)",
    )
    pl.add_argument("--diff", metavar="OLD_PLAN", help="earlier plan: mark the GPUs that moved")
    pl.add_argument("--dpi", type=int, default=110, help="resolution of a .png (default 110)")
    pl.set_defaults(func=_cmd_plot)


def _add_serve(sub: Any) -> None:
    """The ``ntp-opt serve`` subcommand."""
    sv = sub.add_parser(
        "serve", help="HTTP/JSON service: solve, replan, validate, evaluate, export"
    )
    sv.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1, loopback)")
    sv.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    sv.add_argument(
        "--max-body-mb", type=float, default=64.0, help="largest request body, MiB (default 64)"
    )
    sv.add_argument(
        "--max-time-limit",
        type=float,
        default=60.0,
        help="cap on a solve's time limit, seconds (default 60)",
    )
    sv.add_argument(
        "--max-concurrent",
        type=int,
        default=2,
        help="worker processes computing at once (default 2)",
    )
    sv.add_argument(
        "--max-requests",
        type=int,
        default=8,
        help="requests admitted at once; more get 503 with Retry-After (default 8)",
    )
    sv.add_argument(
        "--max-memory-mb",
        type=float,
        default=1024.0,
        help="memory budget: a quarter for bodies, the rest split between workers (default 1024)",
    )
    sv.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds to receive a request body; slower gets 408 (default 30)",
    )
    sv.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="seconds a non-solve request may take before its worker is killed (default 120)",
    )
    sv.add_argument(
        "--allow-host",
        action="append",
        metavar="NAME",
        help="Host header name to accept (repeatable; '*' any; default loopback names)",
    )
    sv.set_defaults(func=_cmd_serve)


class _Terminated(BaseException):
    """Raised by the SIGTERM handler so that every ``finally`` (temp files) runs."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def _validation_text(err: ValidationError, flags: dict[str, str] | None = None) -> str:
    problems = err.errors(include_url=False)
    first = problems[0]
    field = ".".join(str(x) for x in first["loc"])
    field = (flags or {}).get(field, field)
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{field}: {msg}{more}" if field else f"{msg}{more}"


def _error_text(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    if isinstance(err, KeyError) and err.args:
        return str(err.args[0])
    return str(err)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ntp-opt``; returns the exit status.

    SIGTERM and SIGINT end the command cleanly (exit 143 / 130): the
    temporary file of a save in progress is removed, no output is left
    half-written (``serve`` handles its own signals).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = None
    if args.command != "serve" and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        status: int = args.func(args)
        return status
    except BrokenPipeError:
        # the reader went away (`ntp-opt schema instance | head`): stop quietly, and
        # point stdout at /dev/null so that the exit flush does not complain either
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 141  # 128 + SIGPIPE, as for a process killed by the signal
    except (InputError, topology.TopologyError) as err:
        if isinstance(err, InputError):
            first = str(err).splitlines()[0]
        else:
            first = f"invalid cluster topology: {err.problems[0] if err.problems else err}"
        n = len(err.problems)
        more = f" (and {n - 1} more problem{'s' if n > 2 else ''})" if n > 1 else ""
        print(f"ntp-opt: error: {first}{more}", file=sys.stderr)
        return 2
    except ValidationError as err:  # a model built from flags: no pydantic URLs
        print(f"ntp-opt: error: {_validation_text(err)}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as err:
        lines = _error_text(err).splitlines() or [type(err).__name__]
        more = f" (and {len(lines) - 1} more lines)" if len(lines) > 1 else ""
        print(f"ntp-opt: error: {lines[0]}{more}", file=sys.stderr)  # always one line
        return 2
    except KeyboardInterrupt:
        print("ntp-opt: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except _Terminated:
        print("ntp-opt: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
