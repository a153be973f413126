"""What moving work between plans costs: :class:`MigrationCost`, :class:`ReplayOptions`,
:func:`moves` and :func:`migration_loss` (``docs/workloads.md``).

The re-planner (:mod:`ntp_opt.workflows.multi.replanner`) charges these costs
to the plans it weighs, and :func:`~ntp_opt.workflows.multi.replay.replay`
charges every planner the same :func:`migration_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from ntp_opt.model.instance import ClusterArrays, Instance
from ntp_opt.model.workloads import (
    MultiInstance,
    MultiPlan,
    ServingReplica,
    ServingWorkload,
    Workloads,
)
from ntp_opt.rules.multi import usable


@dataclass(frozen=True)
class MigrationCost:
    """What moving work costs, as lost requests or lost training time.

    A cost in weighted-goodput-seconds is spread over ``horizon_s``, the time
    the new plan is expected to run, so that it compares with the weighted
    goodput ``W`` (a rate) of the plans.

    Attributes
    ----------
    serving_start_s
        A started replica serves nothing for this long (weights loaded from
        local storage, engine and CUDA-graph warm-up: tens of seconds to
        minutes for a model of tens of GB). Default 120.
    serving_stop_s
        A stopped replica's in-flight requests are drained or retried: its
        throughput is lost for this long. Default 30.
    training_restart_s
        Any change of the training job's GPUs stops the whole job (synchronous
        data parallelism): it restarts from its last checkpoint and recomputes
        the steps since then. Default 600 (restart plus half of a 10-15 minute
        checkpoint interval).
    horizon_s
        Time over which a move pays off: about the interval between demand
        changes worth acting on. Default 3600.
    """

    serving_start_s: float = 120.0
    serving_stop_s: float = 30.0
    training_restart_s: float = 600.0
    horizon_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("serving_start_s", "serving_stop_s", "training_restart_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: {v!r} must be a finite number >= 0")
        if not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ValueError(f"horizon_s: {self.horizon_s!r} must be a positive number")


@dataclass(frozen=True)
class ReplayOptions:
    """Migration cost and hysteresis of the re-planner.

    Attributes
    ----------
    cost
        :class:`MigrationCost`.
    deadband
        No re-plan while every fleet's demand is within this relative change of
        its demand at the last re-plan, the plan's weighted goodput has not
        dropped by more than ``tolerance`` since, and no health event hit the
        plan. Default 0.05: request rates measured over minutes carry a few per
        cent of noise.
    tolerance
        Weighted goodput the running plan may lose to demand changes inside the
        deadband before a re-plan is considered. Default 0.01 (a fleet of weight 1
        served 1 % short).
    margin
        A new plan must beat keeping the running one by this much weighted
        goodput, after its migration cost. Default 0.002 (0.05 % of the 4.5 of
        the benchmark's workloads).
    migration
        ``False``: no migration cost and no hysteresis (an ablation).
    """

    cost: MigrationCost = field(default_factory=MigrationCost)
    deadband: float = 0.05
    tolerance: float = 0.01
    margin: float = 0.002
    migration: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.deadband) and self.deadband >= 0):
            raise ValueError(f"deadband: {self.deadband!r} must be a finite number >= 0")
        for name in ("margin", "tolerance"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: {v!r} must be a finite number >= 0")


def with_demand(multi: MultiInstance, demand: Mapping[str, float]) -> MultiInstance:
    """``multi`` with the fleets' demand replaced by ``demand`` (fleets not named keep theirs)."""
    fleets = tuple(
        s.model_copy(update={"demand": float(demand.get(s.name, s.demand))})
        for s in multi.workloads.serving
    )
    wl = multi.workloads.model_copy(update={"serving": fleets})
    return MultiInstance(multi.instance, Workloads.model_validate(wl.model_dump()))


def gpu_owners(plan: MultiPlan) -> dict[Hashable, Hashable]:
    """Owner of each used GPU: ``"training"`` or ``(fleet, replica GPUs)``."""
    out: dict[Hashable, Hashable] = {g: "training" for g in plan.training.used_gpus()}
    for rep in plan.serving:
        for g in rep.gpus:
            out[g] = (rep.workload, rep.gpus)
    return out


@dataclass(frozen=True)
class Moves:
    """What changed between two plans (GPUs that failed in between are not counted).

    Attributes
    ----------
    gpus
        GPUs whose owner changed (training, a serving replica, or idle).
    training_gpus
        Those of them that left or joined training.
    started, stopped
        Serving replicas started and stopped.
    """

    gpus: int
    training_gpus: int
    started: int
    stopped: int


def moves(before: MultiPlan | None, after: MultiPlan, instance: Instance) -> Moves:
    """:class:`Moves` from ``before`` to ``after`` (``None``: nothing ran)."""
    if before is None:
        return Moves(0, 0, 0, 0)
    a = instance.arrays
    old, new = gpu_owners(before), gpu_owners(after)
    healthy = {g for g in (*old, *new) if g in a.gpu_index and a.healthy[a.gpu_index[g]]}
    changed = [g for g in healthy if old.get(g) != new.get(g)]
    training = sum(1 for g in changed if "training" in (old.get(g), new.get(g)))
    old_reps = {(r.workload, r.gpus) for r in before.serving}
    new_reps = {(r.workload, r.gpus) for r in after.serving}
    return Moves(len(changed), training, len(new_reps - old_reps), len(old_reps - new_reps))


def _share(a: ClusterArrays, fleets: Mapping[str, ServingWorkload], rep: ServingReplica) -> float:
    """The weighted share of its fleet's demand ``rep`` serves (0: it cannot count)."""
    f = fleets.get(rep.workload)
    idx = [a.gpu_index[g] for g in rep.gpus if g in a.gpu_index]
    speed = float(a.speed[idx].min()) if idx else 0.0
    if f is None or not idx or not usable(f, rep.tp, speed):
        return 0.0  # a replica that cannot count serves nothing to lose
    return f.weight * min(f.rate(rep.tp, speed), f.demand) / f.demand


def _tps(plan: MultiPlan) -> list[int]:
    """The training replicas' degrees."""
    return [r.tp for r in plan.training.replicas]


def migration_loss(
    multi: MultiInstance,
    before: MultiPlan | None,
    after: MultiPlan,
    relative: float,
    cost: MigrationCost,
) -> float:
    """Weighted-goodput-seconds lost moving from ``before`` to ``after`` under ``cost``
    (the same charge for every planner of :func:`replay`): each serving replica started
    or stopped (but not one a failure stopped) loses its share of its fleet's demand for
    ``serving_start_s`` or ``serving_stop_s``; a change of training's GPUs or degrees
    loses ``training_restart_s`` of the training job at its new relative goodput
    ``relative``."""
    if before is None:
        return 0.0
    a = multi.instance.arrays
    fleets = multi.workloads.by_name()

    old = {(r.workload, r.gpus): r for r in before.serving}
    new = {(r.workload, r.gpus): r for r in after.serving}
    lost = sum(_share(a, fleets, r) for k, r in new.items() if k not in old) * cost.serving_start_s
    dead = {g for g in a.gpu_index if not a.healthy[a.gpu_index[g]]}
    lost += (
        sum(
            _share(a, fleets, r)
            for k, r in old.items()
            if k not in new and not dead.intersection(r.gpus)
        )
        * cost.serving_stop_s
    )
    same = set(before.training.used_gpus()) == set(after.training.used_gpus()) and _tps(
        before
    ) == _tps(after)
    if not same:
        lost += multi.workloads.training_weight * relative * cost.training_restart_s
    return lost
