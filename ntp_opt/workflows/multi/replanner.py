"""Fleets that follow demand: re-plan from the running plan, with migration cost and hysteresis.

:func:`replan_multi` is the incremental re-planner. From the running
:class:`~ntp_opt.model.workloads.MultiPlan` and the new demand (and health) it
builds a few *training options* (keep the training plan, repaired in place
when a GPU under it failed; every replica at each allowed TP degree; one or
two replicas fewer when the batch policy allows it) and, for each, fills the
serving fleets greedily by marginal weighted goodput per GPU:

* a fleet short of its demand *wants* replicas (its most GPU-efficient degree
  among those :func:`~ntp_opt.rules.multi.usable` on the
  fastest GPUs: at least ``min_tp``, meeting the latency target; a smaller one
  for the last bit of demand), each worth ``w_i r / D_i`` less the start cost; a
  fleet below its minimum share wants them first;
* every running replica has a *price*: what stopping it loses (nothing for
  capacity above its fleet's demand, ``w_j r / D_j`` otherwise) plus the stop cost;
* wants, best gain per GPU first, go to the NVLink domain where opening their
  degree's GPUs is cheapest (free GPUs first, then the cheapest replicas), if the
  gain exceeds that price; when no domain opens cheaply enough, replicas of
  smaller degree of other fleets move into free fragments of other domains at
  their start and stop cost (compaction);
* a replica whose latency target some healthy GPU misses goes only where the
  fastest free GPUs meet it (:mod:`ntp_opt.workflows.multi.fill`), and compaction
  does not move it; a running replica that no longer counts (late after a speed change, or
  below ``min_tp``) is stopped, which forces a re-plan.

Each option is scored ``W - migration cost / horizon_s``
(:class:`~ntp_opt.workflows.multi.migration.MigrationCost`); the best one
replaces the running plan only when it beats keeping the plan by ``margin``
(:class:`~ntp_opt.workflows.multi.migration.ReplayOptions`), and no option is
even built while every fleet's demand stays within ``deadband`` of the demand
of the last re-plan, the plan has lost at most ``tolerance`` of its weighted
goodput, and no health event touched the plan (hysteresis). The chosen plan is validated by
:func:`~ntp_opt.rules.multi.evaluate_multi`: a broken rule other than a minimum
share (which demand above the cluster's capacity may force) is a bug and raises.

The options are :func:`~ntp_opt.workflows.multi.context.training_options`, the
greedy :func:`~ntp_opt.workflows.multi.fill.fill`, the costs
:mod:`ntp_opt.workflows.multi.migration`; :func:`ntp_opt.workflows.multi.replay.replay`
follows a demand trace with this re-planner and two baselines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.workloads import MultiInstance, MultiPlan, ServingReplica
from ntp_opt.rules.multi import MultiEvaluation, evaluate_multi, usable
from ntp_opt.workflows.multi.context import (
    Filled,
    Rep,
    ReplanContext,
    training_options,
    training_plan,
)
from ntp_opt.workflows.multi.fill import fill, keep_only
from ntp_opt.workflows.multi.migration import ReplayOptions

#: Rules a plan may break when demand outgrows the cluster (reported, not fatal).
SHARE_RULES = frozenset({"min-fraction", "min-replicas", "training-min"})


@dataclass(frozen=True)
class Decision:
    """Outcome of :func:`replan_multi`.

    Attributes
    ----------
    plan
        The plan to run (validated), with the validator's figures as metrics.
    evaluation
        Its :class:`~ntp_opt.rules.multi.MultiEvaluation`.
    replanned
        Whether it differs from the running plan.
    reason
        ``"deadband"`` (demand inside the deadband: no option built), ``"margin"``
        (no option beat the running plan by the margin after its migration cost),
        ``"replanned"`` or ``"forced"`` (a health event or a broken minimum share).
    option
        The training option chosen.
    """

    plan: MultiPlan
    evaluation: MultiEvaluation
    replanned: bool
    reason: str
    option: str


def _to_plan(ctx: ReplanContext, filled: Filled, running: MultiPlan) -> MultiPlan:
    """The plan of ``filled`` (the running training plan if the option keeps it)."""
    a = ctx.a
    option = filled.option
    training = running.training if not option.changed else training_plan(ctx, option)
    serving = tuple(
        ServingReplica(
            ctx.fleets[r.fleet].name,
            r.tp,
            a.domain_ids[r.domain],
            tuple(a.gpu_ids[g] for g in r.gpus),
        )
        for r in filled.reps
    )
    return MultiPlan(training, serving, {"policy": "replay", "option": filled.option.name})


def _kept(ctx: ReplanContext, running: MultiPlan) -> tuple[list[Rep], bool]:
    """The running serving replicas that still run, and whether any lost a GPU."""
    a = ctx.a
    names = {f.name: i for i, f in enumerate(ctx.fleets)}
    out = []
    lost = False
    index, healthy, speed = a.gpu_index, ctx.healthy_l, ctx.speed_l
    for rep in running.serving:
        i = names.get(rep.workload)
        gs = tuple(index[g] for g in rep.gpus)
        if i is None or rep.tp not in ctx.fleets[i].throughput:
            lost = True
            continue
        if not all(healthy[g] for g in gs):
            lost = True
            continue
        slowest = min(speed[g] for g in gs)
        if not usable(ctx.fleets[i], rep.tp, slowest):
            lost = True  # below min_tp, or late since a speed change: it serves nothing
            continue
        rate = ctx.fleets[i].rate(rep.tp, slowest)
        out.append(Rep(i, rep.tp, int(a.domain_index[rep.domain]), gs, rate, False))
    return out, lost


def replan_multi(
    multi: MultiInstance,
    running: MultiPlan,
    *,
    reference: Mapping[str, float] | None = None,
    reference_value: float | None = None,
    options: ReplayOptions | None = None,
) -> Decision:
    """Re-plan ``multi`` (its current demand and health) from the ``running`` plan.

    Parameters
    ----------
    multi
        The instance after any health events, with the fleets' current demand.
    running
        The plan that runs (made for an earlier demand, maybe on GPUs that failed since).
    reference
        Each fleet's demand when ``running`` was made (the deadband's reference);
        ``None``: no deadband.
    reference_value
        The weighted goodput of ``running`` when it was made; the deadband holds
        only while the plan has lost at most ``tolerance`` of it (``None``: not checked).
    options
        :class:`ReplayOptions` (default: the documented defaults).

    Returns
    -------
    Decision
        Its plan breaks no rule of :func:`~ntp_opt.rules.multi.evaluate_multi`
        but, when demand outgrows the cluster, a minimum share.
    """
    opts = options or ReplayOptions()
    ctx = ReplanContext(multi, opts)
    kept, lost = _kept(ctx, running)
    serving_gpus = np.zeros(ctx.a.n_gpus, dtype=bool)
    for r in kept:
        serving_gpus[list(r.gpus)] = True
    base = training_options(ctx, running.training, serving_gpus, base_only=True)[0]
    keep = keep_only(ctx, base, kept)
    forced = lost or base.broken or not keep.min_ok
    if not forced and opts.migration and reference is not None:
        change = max(
            (
                abs(ctx.demand[i] - reference.get(f.name, ctx.demand[i])) / ctx.demand[i]
                for i, f in enumerate(ctx.fleets)
            ),
            default=0.0,
        )
        dropped = 0.0 if reference_value is None else reference_value - keep.value
        if change <= opts.deadband and dropped <= opts.tolerance:
            return _decide(ctx, keep, running, "deadband")
    best = keep
    for opt in training_options(ctx, running.training, serving_gpus):
        got = fill(ctx, opt, kept)
        if (got.min_ok, got.score) > (best.min_ok, best.score + 1e-12):
            best = got
    margin = opts.margin if opts.migration else 0.0
    if not forced and (best is keep or best.score <= keep.score + margin):
        return _decide(ctx, keep, running, "margin")
    return _decide(ctx, best, running, "forced" if forced else "replanned")


def _decide(ctx: ReplanContext, filled: Filled, running: MultiPlan, reason: str) -> Decision:
    """The decision for ``filled``: its plan, validated (a broken rule other than a
    minimum share is a bug), with the validator's figures as metrics."""
    plan = _to_plan(ctx, filled, running)
    ev = evaluate_multi(ctx.multi, plan)
    structural = [v for v in ev.violations if v.rule not in SHARE_RULES]
    late = {k: f.late for k, f in ev.fleets.items() if f.late}
    if structural or late:
        raise RuntimeError(f"re-planned plan broke rules (bug): {structural[:3]} late {late}")
    plan = plan.with_metrics(**ev.as_metrics())
    return Decision(plan, ev, filled.changed, reason, filled.option.name)
