"""Replay a demand trace: the re-planner against the static partition and the MILP.

:func:`replay` runs a :class:`~ntp_opt.workflows.multi.demand.DemandTrace` with
the re-planner (:func:`~ntp_opt.workflows.multi.replanner.replan_multi`) and
with two baselines, the static partition
(:func:`~ntp_opt.workflows.multi.static.solve_static`, sized for each fleet's
peak demand) and :func:`~ntp_opt.planners.multi.solve_multi` from scratch at
every step, and reports per step what ``ntp-opt/replay@1`` holds
(``docs/workloads.md``); :func:`summary` sums a planner up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ntp_opt.model.files import InputError, write_json
from ntp_opt.model.instance import Instance
from ntp_opt.model.workloads import MultiInstance, MultiPlan, Workloads
from ntp_opt.planners.multi import solve_multi
from ntp_opt.rules.multi import MultiEvaluation, evaluate_multi
from ntp_opt.workflows.events import apply_events
from ntp_opt.workflows.multi.demand import DemandStep, DemandTrace
from ntp_opt.workflows.multi.migration import (
    Moves,
    ReplayOptions,
    migration_loss,
    moves,
    with_demand,
)
from ntp_opt.workflows.multi.replanner import SHARE_RULES, replan_multi
from ntp_opt.workflows.multi.static import solve_static

REPLAY_FORMAT = "ntp-opt/replay@1"
#: Planners of :func:`replay`, in report order.
PLANNERS: tuple[str, ...] = ("replay", "static", "resolve")


@dataclass
class _Track:
    """One planner's state along the trace."""

    plan: MultiPlan | None = None
    reference: dict[str, float] = field(default_factory=dict)
    value: float | None = None


def _figures(
    ev: MultiEvaluation, mv: Moves, loss: float, cpu: float, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """A planner's figures at one step, as ``ntp-opt/replay@1`` holds them."""
    return {
        "weighted_goodput": ev.weighted_goodput,
        "migration_loss": loss,
        "served": {k: f.served for k, f in ev.fleets.items()},
        "training_relative_goodput": ev.training.relative_goodput,
        "gpus_moved": mv.gpus,
        "training_gpus_moved": mv.training_gpus,
        "replicas_started": mv.started,
        "replicas_stopped": mv.stopped,
        "decision_cpu_s": cpu,
        "feasible": ev.feasible,
        "violations": [v.rule for v in ev.violations],
        **extra,
    }


def _peak(trace: DemandTrace, workloads: Workloads) -> dict[str, float]:
    """Each fleet's peak demand over the trace."""
    peak: dict[str, float] = {}
    for d in trace.demands(workloads):
        for k, v in d.items():
            peak[k] = max(peak.get(k, 0.0), v)
    return peak


@dataclass
class _Run:
    """What every step of one replay plans with, and the cluster's current health."""

    multi: MultiInstance
    opts: ReplayOptions
    time_limit: float
    seed: int
    peak: dict[str, float]
    instance: Instance
    static_instance: MultiInstance | None = None


def _replay_step(
    run: _Run, tr: _Track, now: MultiInstance, demand: dict[str, float]
) -> tuple[MultiPlan, MultiEvaluation, dict[str, Any]]:
    """The re-planner's step: the first plan by the MILP, then :func:`replan_multi`."""
    if tr.plan is None:
        res = solve_multi(now, time_limit=run.time_limit, seed=run.seed)
        if res.plan is None or res.evaluation is None:
            raise ValueError(f"no first plan: {res.status} ({res.reason})")
        tr.reference = dict(demand)
        tr.value = res.evaluation.weighted_goodput
        return res.plan, res.evaluation, {"replanned": True, "reason": "first plan"}
    dec = replan_multi(
        now, tr.plan, reference=tr.reference, reference_value=tr.value, options=run.opts
    )
    if dec.reason not in ("deadband", "margin"):
        tr.reference = dict(demand)
        tr.value = dec.evaluation.weighted_goodput
    extra = {"replanned": dec.replanned, "reason": dec.reason, "option": dec.option}
    return dec.plan, dec.evaluation, extra


def _static_step(
    run: _Run, tr: _Track, step: DemandStep, now: MultiInstance
) -> tuple[MultiPlan, MultiEvaluation, dict[str, Any]]:
    """The static partition's step: sized for the peak demand, re-made after health events."""
    if run.static_instance is None or step.events:
        run.static_instance = with_demand(
            MultiInstance(run.instance, run.multi.workloads), run.peak
        )
        plan, _ = solve_static(run.static_instance, time_limit=run.time_limit, seed=run.seed)
        plan = MultiPlan(plan.training, plan.serving, {"policy": "static"})
    else:
        assert tr.plan is not None
        plan = tr.plan
    return plan, evaluate_multi(now, plan), {}


def _resolve_step(
    run: _Run, k: int, now: MultiInstance
) -> tuple[MultiPlan, MultiEvaluation, dict[str, Any]]:
    """The MILP from scratch."""
    res = solve_multi(now, time_limit=run.time_limit, seed=run.seed)
    if res.plan is None or res.evaluation is None:
        raise ValueError(f"step {k}: no plan: {res.status} ({res.reason})")
    return res.plan, res.evaluation, {"status": str(res.status)}


def _planner_step(
    run: _Run,
    name: str,
    tr: _Track,
    k: int,
    step: DemandStep,
    now: MultiInstance,
    demand: dict[str, float],
) -> dict[str, Any]:
    """One planner's decision at step ``k`` and its figures (CPU time, moves, loss)."""
    t0 = time.process_time()
    if name == "replay":
        plan, ev, extra = _replay_step(run, tr, now, demand)
    elif name == "static":
        plan, ev, extra = _static_step(run, tr, step, now)
    else:
        plan, ev, extra = _resolve_step(run, k, now)
    cpu = time.process_time() - t0
    structural = [v for v in ev.violations if v.rule not in SHARE_RULES]
    if structural:
        raise RuntimeError(f"{name} plan at step {k} broke rules (bug): {structural[:3]}")
    mv = moves(tr.plan, plan, run.instance)
    loss = migration_loss(now, tr.plan, plan, ev.training.relative_goodput, run.opts.cost)
    tr.plan = MultiPlan(plan.training, plan.serving, {})
    return _figures(ev, mv, loss, cpu, extra)


def replay(
    multi: MultiInstance,
    trace: DemandTrace,
    *,
    options: ReplayOptions | None = None,
    planners: Iterable[str] = PLANNERS,
    time_limit: float = 60.0,
    seed: int = 0,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    source: str = "<demand>",
) -> list[dict[str, Any]]:
    """Replay ``trace`` on ``multi`` with the re-planner and the baselines.

    Parameters
    ----------
    multi
        The instance (cluster, training job) and workloads (base demand).
    trace
        The demand trace (its fleet names must be ``multi``'s).
    options
        :class:`~ntp_opt.workflows.multi.migration.ReplayOptions` of the re-planner.
    planners
        Which of :data:`PLANNERS` to run: ``replay`` (first plan by
        :func:`~ntp_opt.planners.multi.solve_multi`, then
        :func:`~ntp_opt.workflows.multi.replanner.replan_multi`),
        ``static`` (the static partition sized for each fleet's peak demand over
        the trace, re-made only after health events) and ``resolve``
        (:func:`~ntp_opt.planners.multi.solve_multi` at every step, no migration cost).
    time_limit, seed
        For :func:`~ntp_opt.planners.multi.solve_multi` and
        :func:`~ntp_opt.workflows.multi.static.solve_static`.
    on_step
        Called with each step's record as soon as it is complete (to write it).
    source
        The trace's file name, for errors.

    Returns
    -------
    list of dict
        Per step: ``time_s``, ``demand``, ``events`` and, per planner, the figures of
        ``ntp-opt/replay@1`` (``docs/workloads.md``).
    """
    opts = options or ReplayOptions()
    todo = list(planners)
    unknown = [p for p in todo if p not in PLANNERS]
    if unknown:
        raise ValueError(f"planners: unknown {unknown} (known: {list(PLANNERS)})")
    trace.check_fleets(multi.workloads, source)
    run = _Run(multi, opts, time_limit, seed, _peak(trace, multi.workloads), multi.instance)
    tracks = {p: _Track() for p in todo}
    records: list[dict[str, Any]] = []
    for k, (step, demand) in enumerate(
        zip(trace.steps, trace.demands(multi.workloads), strict=True)
    ):
        if step.events:
            try:
                run.instance = apply_events(run.instance, step.events)
            except ValueError as err:
                raise InputError(source, [(f"steps[{k}].events", str(err))]) from None
        now = with_demand(MultiInstance(run.instance, multi.workloads), demand)
        rec: dict[str, Any] = {
            "step": k,
            "time_s": step.time_s,
            "demand": demand,
            "events": len(step.events),
        }
        for name in todo:
            rec[name] = _planner_step(run, name, tracks[name], k, step, now, demand)
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    return records


def summary(records: list[dict[str, Any]], planner: str, skip_first: bool = True) -> dict[str, Any]:
    """Means and totals of one planner over a replay (the first step, the initial
    placement, is left out of moves and decision times when ``skip_first``)."""
    rows = [r[planner] for r in records if planner in r]
    later = rows[1:] if skip_first and len(rows) > 1 else rows
    times = [float(r["time_s"]) for r in records if planner in r]
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    step = span / (len(times) - 1) if len(times) > 1 else 1.0
    # the mean weighted goodput over the trace (each step holds until the next; the last
    # for one mean step), less the migration losses spread over the same time
    lost = sum(x["migration_loss"] for x in later)
    fleets = list(rows[0]["served"]) if rows else []
    cpu = sorted(x["decision_cpu_s"] for x in later)
    return {
        "mean_weighted_goodput": float(np.mean([x["weighted_goodput"] for x in rows])),
        "mean_net_weighted_goodput": float(np.mean([x["weighted_goodput"] for x in rows]))
        - lost / (span + step),
        "mean_served": {f: float(np.mean([x["served"][f] for x in rows])) for f in fleets},
        "mean_training_relative_goodput": float(
            np.mean([x["training_relative_goodput"] for x in rows])
        ),
        "gpus_moved_total": int(sum(x["gpus_moved"] for x in later)),
        "gpus_moved_per_step": float(np.mean([x["gpus_moved"] for x in later])) if later else 0.0,
        "median_decision_cpu_s": float(np.median(cpu)) if cpu else 0.0,
        "max_decision_cpu_s": float(max(cpu)) if cpu else 0.0,
        "steps_infeasible": sum(1 for x in rows if not x["feasible"]),
    }


def replay_document(
    multi: MultiInstance,
    trace_meta: Mapping[str, Any],
    options: ReplayOptions,
    records: list[dict[str, Any]],
    planners: Iterable[str],
    complete: bool,
) -> dict[str, Any]:
    """The ``ntp-opt/replay@1`` document of ``records``."""
    names = list(planners)
    return {
        "format": REPLAY_FORMAT,
        "instance": multi.name,
        "complete": complete,
        "options": {
            "serving_start_s": options.cost.serving_start_s,
            "serving_stop_s": options.cost.serving_stop_s,
            "training_restart_s": options.cost.training_restart_s,
            "horizon_s": options.cost.horizon_s,
            "deadband": options.deadband,
            "tolerance": options.tolerance,
            "margin": options.margin,
            "migration": options.migration,
        },
        "trace": dict(trace_meta),
        "summary": {p: summary(records, p) for p in names} if records else {},
        "steps": records,
    }


def write_replay(
    path: str | os.PathLike[str],
    document: Mapping[str, Any],
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Write a replay document atomically (never onto one of ``inputs``)."""
    write_json(dict(document), Path(path), inputs)
