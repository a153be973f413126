"""The rules of multi-workload plans: the latency rule, the validator and evaluator.

:func:`usable` says whether a serving replica counts (degree at least
``min_tp``, latency target met at its slowest GPU's speed).
:func:`evaluate_multi` recomputes the weighted goodput of a
:class:`~ntp_opt.model.workloads.MultiPlan` from the instance and the plan
alone and lists every broken rule (:data:`MULTI_RULES`); the training plan is
judged by :func:`ntp_opt.rules.validate.evaluate` except for power, which is
recomputed here over the GPUs of every workload. Planners never bypass it:
every plan they return went through :func:`check_multi`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.model.workloads import MultiInstance, MultiPlan, ServingReplica, ServingWorkload
from ntp_opt.rules.power import rack_and_site_draw
from ntp_opt.rules.tolerances import FLOAT_NOISE, SHARE_TOL
from ntp_opt.rules.validate import Evaluation, Violation, certify, checked, evaluate
from ntp_opt.rules.violations import budget_violations, metrics_violations


def meets_latency(fleet: ServingWorkload, t: int, speed: float = 1.0) -> bool:
    """Whether a replica of ``fleet`` meets its latency target.

    Parameters
    ----------
    fleet
        The serving fleet.
    t
        The replica's TP degree (one of ``fleet.throughput``).
    speed
        Speed of the replica's slowest GPU.

    Returns
    -------
    bool
        ``latency_ms[t] / speed <= max_latency_ms`` (always true without a target).
    """
    ms = fleet.latency(t, speed)
    if fleet.max_latency_ms is None or ms is None:
        return True
    return ms <= fleet.max_latency_ms * (1 + FLOAT_NOISE)


def usable(fleet: ServingWorkload, t: int, speed: float = 1.0) -> bool:
    """Whether a replica of ``fleet`` of degree ``t`` counts.

    Parameters
    ----------
    fleet
        The serving fleet.
    t
        The replica's TP degree.
    speed
        Speed of the replica's slowest GPU.

    Returns
    -------
    bool
        An allowed degree, at least ``min_tp``, meeting the latency target.

    Examples
    --------
    >>> a = ServingWorkload(name="agents", throughput={2: 2.0, 4: 3.5, 8: 6.0}, demand=9.0,
    ...                     latency_ms={2: 90.0, 4: 50.0, 8: 30.0}, max_latency_ms=60.0,
    ...                     min_tp=4)
    >>> usable(a, 4, 1.0), usable(a, 4, 0.8), usable(a, 8, 0.8), usable(a, 2, 1.0)
    (True, False, True, False)
    """
    return t in fleet.throughput and t >= fleet.min_tp and meets_latency(fleet, t, speed)


#: Rule codes added to :data:`ntp_opt.rules.violations.RULES` for multi-workload plans.
MULTI_RULES: dict[str, str] = {
    "serving-workload": "a serving replica names no serving workload",
    "serving-tp": "a serving replica's TP degree is not one its workload allows",
    "serving-size": "a serving replica does not have exactly its TP degree of GPUs",
    "serving-memory": "a serving replica's TP degree is below its workload's min_tp (the model "
    "does not fit)",
    "domain-unknown": "a serving replica names a node that is not a domain",
    "gpu-unknown": "a serving replica names a node that is not a GPU",
    "gpu-failed": "a serving replica uses a failed GPU",
    "gpu-outside-domain": "a serving replica uses a GPU of another domain",
    "gpu-reused": "a GPU is used twice (by any two replicas of any workloads)",
    "max-replicas": "a serving workload has more than max_replicas replicas",
    "min-replicas": "a serving workload has fewer than min_replicas replicas that count "
    "(a replica missing the latency target does not)",
    "min-fraction": "a serving workload serves less than min_fraction of its demand",
    "training-min": "training's relative goodput is below training_min_relative_goodput",
    "rack-power": "a rack draws more than its budget (all workloads together)",
    "site-power": "the site draws more than its budget (all workloads together)",
    "metrics": "the plan's reported weighted goodput differs from the recomputed one",
}


@dataclass(frozen=True)
class FleetFigures:
    """Figures of one serving fleet.

    Attributes
    ----------
    replicas
        Number of replicas.
    gpus
        GPUs they use.
    throughput
        Requests/s, ``sum throughput[t] * slowest speed`` over the replicas that
        count (degree at least ``min_tp``, latency target met).
    served
        ``min(1, throughput / demand)``.
    late
        Replicas that miss the latency target (they serve nothing).
    """

    replicas: int
    gpus: int
    throughput: float
    served: float
    late: int = 0


@dataclass(frozen=True)
class MultiEvaluation:
    """Figures of a multi-workload plan, recomputed from the instance and the plan.

    Attributes
    ----------
    feasible
        No rule is broken.
    violations
        The broken rules.
    weighted_goodput
        ``w_T * relative_goodput_T + sum_i w_i * served_i``.
    training
        The training plan's :class:`~ntp_opt.rules.validate.Evaluation` (its power
        figures count training GPUs only; see ``site_power_w`` here).
    fleets
        :class:`FleetFigures` by serving workload name (every workload listed).
    gpus_used
        GPUs used by any workload.
    idle_healthy
        Healthy GPUs no workload uses.
    site_power_w
        Site draw of all workloads together, in watts.
    """

    feasible: bool
    violations: tuple[Violation, ...]
    weighted_goodput: float
    training: Evaluation
    fleets: dict[str, FleetFigures]
    gpus_used: int
    idle_healthy: int
    site_power_w: float

    def as_metrics(self) -> dict[str, float | int]:
        """Flat figures for a plan's ``metrics`` and for reports."""
        out: dict[str, float | int] = {
            "weighted_goodput": self.weighted_goodput,
            "training_relative_goodput": self.training.relative_goodput,
            "gpus_used": self.gpus_used,
            "idle_healthy": self.idle_healthy,
        }
        for name, f in self.fleets.items():
            out[f"{name}_served"] = f.served
            out[f"{name}_replicas"] = f.replicas
            if f.late:
                out[f"{name}_late"] = f.late
        return out


def _fmt(x: float) -> str:
    return f"{x:.6g}"


@dataclass
class _Tally:
    """Per fleet: throughput that counts, replicas, replicas that count, late ones, GPUs."""

    through: dict[str, float]
    count: dict[str, int]
    counted: dict[str, int]
    late: dict[str, int]
    gpus: dict[str, int]

    @classmethod
    def of(cls, names: dict[str, ServingWorkload]) -> _Tally:
        """Zero for every fleet of ``names``."""
        return cls(
            dict.fromkeys(names, 0.0),
            dict.fromkeys(names, 0),
            dict.fromkeys(names, 0),
            dict.fromkeys(names, 0),
            dict.fromkeys(names, 0),
        )


@dataclass
class _Usage:
    """Who uses each GPU and at which power multiplier (0: unused); training first."""

    power_of: np.ndarray
    owner: dict[int, str] = field(default_factory=dict)


def _training_usage(inst: Instance, training: Plan) -> _Usage:
    """The GPUs of the training plan, at their stage's power multiplier."""
    a = inst.arrays
    use = _Usage(np.zeros(a.n_gpus, dtype=float))
    for r, rep in enumerate(training.replicas):
        for st in rep.stages:
            for g in st.gpus:
                i = a.gpu_index.get(g)
                if i is not None and i not in use.owner:
                    use.owner[i] = f"training replica {r}"
                    use.power_of[i] = min(max(float(st.power), 1.0), 1.0 + inst.job.max_boost)
    return use


def _replica_kind(
    srv: ServingReplica, fleet: ServingWorkload | None, where: str, known: list[str]
) -> list[Violation]:
    """The rules on a replica's workload and degree."""
    if fleet is None:
        return [
            Violation(
                "serving-workload",
                f"{where}: no serving workload named {srv.workload!r} (known: {known})",
            )
        ]
    if srv.tp not in fleet.throughput:
        return [
            Violation(
                "serving-tp",
                f"{where}: TP degree {srv.tp} not in allowed {list(fleet.degrees)}",
            )
        ]
    if srv.tp < fleet.min_tp:
        return [
            Violation(
                "serving-memory",
                f"{where}: TP degree {srv.tp} < min_tp={fleet.min_tp}: the model does not fit",
            )
        ]
    return []


def _replica_gpus(
    inst: Instance, srv: ServingReplica, where: str, use: _Usage, out: list[Violation]
) -> float:
    """Check a replica's domain and GPUs (appending to ``out``), mark them used; its
    slowest GPU's speed (``inf``: none known)."""
    a = inst.arrays
    if len(srv.gpus) != srv.tp:
        out.append(
            Violation("serving-size", f"{where}: {len(srv.gpus)} GPUs for TP degree {srv.tp}")
        )
    d = a.domain_index.get(srv.domain)
    if d is None:
        out.append(
            Violation(
                "domain-unknown",
                f"{where}: {srv.domain!r} is not a domain of the cluster",
                node=srv.domain,
            )
        )
    slowest = math.inf
    for g in srv.gpus:
        i = a.gpu_index.get(g)
        if i is None:
            out.append(
                Violation("gpu-unknown", f"{where}: {g!r} is not a GPU of the cluster", node=g)
            )
            continue
        slowest = min(slowest, float(a.speed[i]))
        if not a.healthy[i]:
            out.append(Violation("gpu-failed", f"{where}: GPU {g!r} has failed", node=g))
        if d is not None and a.gpu_domain[i] != d:
            out.append(
                Violation(
                    "gpu-outside-domain",
                    f"{where}: GPU {g!r} belongs to domain "
                    f"{a.domain_ids[a.gpu_domain[i]]!r}, not {srv.domain!r}",
                    node=g,
                )
            )
        if i in use.owner:
            out.append(
                Violation(
                    "gpu-reused", f"{where}: GPU {g!r} is already used by {use.owner[i]}", node=g
                )
            )
        else:
            use.owner[i] = where
            use.power_of[i] = 1.0
    return slowest


def _count_replica(
    srv: ServingReplica, fleet: ServingWorkload, slowest: float, tally: _Tally
) -> None:
    """Add a replica to its fleet's figures (a late one serves nothing)."""
    tally.count[fleet.name] += 1
    tally.gpus[fleet.name] += len(srv.gpus)
    if srv.tp in fleet.throughput and srv.gpus and math.isfinite(slowest):
        if not meets_latency(fleet, srv.tp, slowest):
            tally.late[fleet.name] += 1  # misses the latency target: serves nothing
        elif srv.tp >= fleet.min_tp:
            tally.through[fleet.name] += fleet.rate(srv.tp, slowest)
            tally.counted[fleet.name] += 1


def _fleet_rules(name: str, fleet: ServingWorkload, tally: _Tally) -> list[Violation]:
    """The replica-count and minimum-share rules of one fleet."""
    out = []
    count, counted, late = tally.count[name], tally.counted[name], tally.late[name]
    if fleet.max_replicas is not None and count > fleet.max_replicas:
        out.append(
            Violation(
                "max-replicas",
                f"serving workload {name!r}: {count} replicas > max_replicas={fleet.max_replicas}",
            )
        )
    if counted < fleet.min_replicas:
        out.append(
            Violation(
                "min-replicas",
                f"serving workload {name!r}: {counted} replicas that count < "
                f"min_replicas={fleet.min_replicas}"
                + (f" ({late} miss the latency target)" if late else ""),
            )
        )
    if tally.through[name] < fleet.min_fraction * fleet.demand * (1 - SHARE_TOL):
        out.append(
            Violation(
                "min-fraction",
                f"serving workload {name!r}: serves {_fmt(tally.through[name])} req/s < "
                f"min_fraction={fleet.min_fraction} of demand {_fmt(fleet.demand)}",
            )
        )
    return out


def _power_rules(inst: Instance, power_of: np.ndarray, out: list[Violation]) -> float:
    """Rack and site power over all workloads (appending to ``out``); the site draw."""
    # used at tdp * pi, idle healthy at the idle share
    rack_w, site_w = rack_and_site_draw(inst, power_of)
    out.extend(budget_violations(inst, rack_w, site_w))
    return site_w


def _serving_rules(
    multi: MultiInstance, plan: MultiPlan, use: _Usage, out: list[Violation]
) -> _Tally:
    """Check every serving replica (appending to ``out``) and tally the fleets."""
    fleets = multi.workloads.by_name()
    tally = _Tally.of(fleets)
    for k, srv in enumerate(plan.serving):
        where = f"serving replica {k} ({srv.workload!r})"
        fleet = fleets.get(srv.workload)
        out.extend(_replica_kind(srv, fleet, where, sorted(fleets)))
        slowest = _replica_gpus(multi.instance, srv, where, use, out)
        if fleet is not None:
            _count_replica(srv, fleet, slowest, tally)
    return tally


def evaluate_multi(multi: MultiInstance, plan: MultiPlan) -> MultiEvaluation:
    """Check every rule and recompute the weighted goodput of ``plan``.

    Parameters
    ----------
    multi
        The instance and its workloads.
    plan
        The plan; its ``metrics`` are checked, never used.

    Returns
    -------
    MultiEvaluation
    """
    inst = multi.instance
    wl = multi.workloads
    a = inst.arrays
    train = evaluate(inst, plan.training)
    out = [v for v in train.violations if v.rule not in ("rack-power", "site-power")]
    use = _training_usage(inst, plan.training)
    tally = _serving_rules(multi, plan, use, out)
    figures: dict[str, FleetFigures] = {}
    value = wl.training_weight * train.relative_goodput
    for name, fleet in wl.by_name().items():
        served = min(1.0, tally.through[name] / fleet.demand)
        figures[name] = FleetFigures(
            tally.count[name], tally.gpus[name], tally.through[name], served, tally.late[name]
        )
        value += fleet.weight * served
        out.extend(_fleet_rules(name, fleet, tally))
    need = wl.training_min_relative_goodput
    if train.relative_goodput < need * (1 - SHARE_TOL):
        out.append(
            Violation(
                "training-min",
                f"training relative goodput {_fmt(train.relative_goodput)} < "
                f"training_min_relative_goodput={need}",
            )
        )
    site_w = _power_rules(inst, use.power_of, out)
    out.extend(metrics_violations(plan, value, key="weighted_goodput"))
    used = np.zeros(a.n_gpus, dtype=bool)
    used[list(use.owner)] = True
    return MultiEvaluation(
        feasible=not out,
        violations=tuple(out),
        weighted_goodput=value,
        training=train,
        fleets=figures,
        gpus_used=int(used.sum()),
        idle_healthy=int((a.healthy & ~used).sum()),
        site_power_w=site_w,
    )


def validate_multi(multi: MultiInstance, plan: MultiPlan) -> list[Violation]:
    """Every rule ``plan`` breaks (empty if feasible)."""
    return list(evaluate_multi(multi, plan).violations)


def check_multi(multi: MultiInstance, plan: MultiPlan) -> MultiEvaluation:
    """Evaluate ``plan``; raise :class:`~ntp_opt.rules.validate.PlanError` if it breaks a rule."""
    return checked(evaluate_multi, multi, plan)


def certified_multi(multi: MultiInstance, plan: MultiPlan) -> MultiPlan:
    """``plan`` checked by :func:`check_multi`, with the validator's figures as metrics."""
    return certify(evaluate_multi, multi, plan)


def with_training_metrics(multi: MultiInstance, plan: MultiPlan) -> MultiPlan:
    """``plan`` with the validator's figures as its training part's metrics.

    Parameters
    ----------
    multi
        The instance and its workloads.
    plan
        The plan (to write with
        :func:`ntp_opt.model.files.workloads.save_multi_plan`).

    Returns
    -------
    MultiPlan
        The same plan; its training :class:`~ntp_opt.model.plan.Plan` carries the
        figures of :func:`ntp_opt.rules.validate.evaluate`.
    """
    training = plan.training.with_metrics(**evaluate(multi.instance, plan.training).as_metrics())
    return MultiPlan(training, plan.serving, plan.metrics)


def gpu_owner_map(plan: MultiPlan) -> dict[Hashable, str]:
    """Which workload uses each GPU (``"training"`` or the fleet name); for reports."""
    out: dict[Hashable, str] = {g: "training" for g in plan.training.used_gpus()}
    for rep in plan.serving:
        for g in rep.gpus:
            out.setdefault(g, rep.workload)
    return out
