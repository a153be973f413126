"""The baseline: a fixed static partition of the domains among the workloads.

Each workload gets a contiguous block of domains (in cluster order, decided
before any failure is known): training first takes the domains its nominal
replicas need, the serving fleets share the rest in proportion to their
nominal needs. Nominal needs in domains (``S`` = GPUs per domain, the
largest domain's size):

* training: ``ceil(dp * pp / floor(S / tp))`` domains, the domains its
  nominal replicas occupy;
* a serving fleet: the GPUs its demand needs at its most GPU-efficient degree
  ``t*`` (largest ``throughput[t] / t``, the smaller degree on ties, among the
  degrees of at least ``min_tp`` that meet the latency target at speed 1.0),
  ``ceil(demand / throughput[t*]) * t*`` (at most ``max_replicas * t*``, at
  least ``min_replicas * t*``), divided by ``S``.

Fleet blocks are apportioned by largest remainders. Inside its block the training
job is planned with :func:`ntp_opt.solve` (default ``optimal-nopower``, with a
time limit) and every fleet greedily: domain by domain, replicas of the most
efficient degree that fits the free GPUs (fastest first) and meets the latency
target on them, until the demand or ``max_replicas`` is reached. GPUs a block
cannot use stay idle: that is what a static partition costs.
"""

from __future__ import annotations

import math

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.model.workloads import MultiInstance, MultiPlan, ServingReplica, ServingWorkload
from ntp_opt.rules.multi import MultiEvaluation, evaluate_multi, meets_latency, usable
from ntp_opt.solve import solve


def nominal_need(multi: MultiInstance) -> dict[str, float]:
    """Nominal need in domains of every workload (``"training"`` first); see the module doc."""
    job = multi.instance.job
    size = max((len(g) for g in multi.instance.arrays.domain_gpus), default=1)
    out: dict[str, float] = {"training": float(math.ceil(job.dp * job.pp / (size // job.tp)))}
    for fleet in multi.workloads.serving:
        t = _best_degree(fleet)
        n = math.ceil(fleet.demand / fleet.rate(t))
        if fleet.max_replicas is not None:
            n = min(n, fleet.max_replicas)
        out[fleet.name] = max(n, fleet.min_replicas) * t / size
    return out


def _efficient(fleet: ServingWorkload) -> list[int]:
    """Degrees a replica of ``fleet`` may have (at least ``min_tp``), most GPU-efficient
    first, those meeting the latency target at speed 1.0 before the others."""
    return sorted(
        fleet.fitting_degrees,
        key=lambda t: (not meets_latency(fleet, t), -fleet.rate(t) / t, t),
    )


def _best_degree(fleet: ServingWorkload) -> int:
    return _efficient(fleet)[0]


def partition(multi: MultiInstance) -> dict[str, list[int]]:
    """Domain indices of every workload's block.

    Training first takes its nominal domains (or all of them, if fewer); the
    serving fleets share the rest in proportion to their nominal needs,
    apportioned by largest remainders.
    """
    need = nominal_need(multi)
    n_dom = multi.instance.arrays.n_domains
    names = list(need)
    count = dict.fromkeys(names, 0)
    count["training"] = min(n_dom, int(need["training"]))
    rest = n_dom - count["training"]
    fleets = names[1:]
    total = sum(need[k] for k in fleets)
    if fleets and total > 0 and rest > 0:
        quota = {k: need[k] / total * rest for k in fleets}
        for k in fleets:
            count[k] = math.floor(quota[k])
        order = sorted(fleets, key=lambda k: (-(quota[k] - count[k]), fleets.index(k)))
        for k in order[: rest - sum(count[k] for k in fleets)]:
            count[k] += 1
    out: dict[str, list[int]] = {}
    pos = 0
    for name in names:
        out[name] = list(range(pos, pos + count[name]))
        pos += count[name]
    return out


def _restricted(instance: Instance, domains: list[int]) -> Instance:
    """The instance with every GPU outside ``domains`` marked failed."""
    a = instance.arrays
    keep = np.zeros(a.n_domains, dtype=bool)
    keep[domains] = True
    g = instance.cluster.copy()
    for i, gid in enumerate(a.gpu_ids):
        if not keep[a.gpu_domain[i]]:
            g.nodes[gid]["state"] = "failed"
    return Instance(instance.name, g, instance.job, instance.meta, copy_graph=False)


def _serve(
    multi: MultiInstance, fleet: ServingWorkload, domains: list[int]
) -> list[ServingReplica]:
    a = multi.instance.arrays
    degrees = _efficient(fleet)
    out: list[ServingReplica] = []
    served = 0.0
    limit = fleet.max_replicas if fleet.max_replicas is not None else math.inf
    for d in domains:
        members = a.domain_gpus[d]
        free = members[a.healthy[members]]
        free = list(free[np.argsort(-a.speed[free], kind="stable")])
        while served < fleet.demand and len(out) < limit:
            # the free GPUs fastest first: a replica on the next t misses the target
            # only if its slowest is too slow for degree t
            fits = [
                t
                for t in degrees
                if t <= len(free) and usable(fleet, t, float(a.speed[free[t - 1]]))
            ]
            if not fits:
                break
            t = fits[0]
            gs, free = free[:t], free[t:]
            out.append(
                ServingReplica(fleet.name, t, a.domain_ids[d], tuple(a.gpu_ids[g] for g in gs))
            )
            served += fleet.rate(t, float(a.speed[gs].min()))
    return out


def solve_static(
    multi: MultiInstance,
    *,
    training_solver: str = "optimal-nopower",
    time_limit: float | None = 30.0,
    seed: int = 0,
) -> tuple[MultiPlan, MultiEvaluation]:
    """Plan every workload inside its static block.

    Parameters
    ----------
    multi
        The instance and its workloads.
    training_solver
        Planner of :func:`ntp_opt.solve` for the training block.
    time_limit, seed
        Passed to it.

    Returns
    -------
    (MultiPlan, MultiEvaluation)
        The plan and the validator's verdict; the plan may break a minimum
        share the partition cannot meet (``evaluation.feasible`` says).
    """
    parts = partition(multi)
    sub = _restricted(multi.instance, parts["training"])
    res = solve(sub, training_solver, time_limit=time_limit, seed=seed)
    # no plan only when even the paused job breaks a power budget: the
    # evaluation below then reports it
    training = res.plan if res.plan is not None else Plan(multi.name, ())
    serving: list[ServingReplica] = []
    for fleet in multi.workloads.serving:
        serving.extend(_serve(multi, fleet, parts[fleet.name]))
    plan = MultiPlan(training, tuple(serving), {"policy": "static"})
    ev = evaluate_multi(multi, plan)
    return plan.with_metrics(**ev.as_metrics()), ev
