"""Hypothesis strategies: valid instances and plans (tests only).

* :func:`jobs` draws a job for a nominal TP degree: both batch policies,
  reduced degrees, efficiencies, power exponents, boosts, idle draw, overhead.
* :func:`small_instances` draws instances within the exact planner's scope
  (every domain's healthy GPUs share one TDP and one rack, at most 16 GPUs),
  small enough for the brute force of ``tests/bruteforce.py``.
* :func:`preset_instances` draws instances on every topology preset
  (DGX H100, NVL32, GB200 NVL72, NVL36x2) of a few domains, with failed GPUs,
  failed trays, stragglers and rack and site power budgets.
* :func:`instances` is either of the two; :func:`valid_plans` draws a feasible
  plan for an instance, built replica by replica from random free GPUs.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import networkx as nx
from hypothesis import assume
from hypothesis import strategies as st

from ntp_opt.model import topology
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules.validate import validate

#: (domains, domain size, GPUs per tray, trays per rack) of the small in-scope
#: clusters: one rack per domain (or several whole domains per rack, all at one
#: TDP), at most 16 GPUs.
SMALL_SHAPES = [
    (1, 4, 2, 2),
    (2, 4, 2, 2),
    (3, 4, 2, 2),
    (4, 4, 2, 2),
    (2, 4, 2, 4),
    (4, 4, 2, 4),
    (2, 8, 4, 2),
    (3, 4, 1, 4),
    (2, 8, 8, 1),
]

#: Presets and the number of domains (DGX nodes, racks) drawn for them.
PRESETS: dict[str, tuple[int, int]] = {
    "dgx-h100": (1, 8),
    "nvl32": (1, 3),
    "nvl72": (1, 2),
    "nvl36x2": (1, 2),
}

speeds = st.sampled_from([0.5, 0.8, 0.9, 0.95])


@st.composite
def jobs(
    draw: st.DrawFn,
    tp: int,
    *,
    max_pp: int = 2,
    max_dp: int = 3,
    policy: str | None = None,
) -> Job:
    """A valid job of nominal degree ``tp``; ``policy`` fixes the batch policy."""
    tp_min = draw(st.integers(max(1, tp // 2), tp))
    reduced = list(range(tp_min, tp))
    allowed = None
    if reduced and draw(st.booleans()):
        allowed = (*draw(st.lists(st.sampled_from(reduced), unique=True)), tp)
    dp = draw(st.integers(1, max_dp))
    batch = draw(st.integers(dp, 3 * dp))
    eff: dict[int, float] = {}
    if reduced and draw(st.booleans()):
        eff = {draw(st.sampled_from(reduced)): draw(st.sampled_from([0.9, 1.05]))}
    return Job(
        tp=tp,
        tp_min=tp_min,
        tp_allowed=allowed,
        pp=draw(st.integers(1, max_pp)),
        dp=dp,
        dp_max=dp + draw(st.integers(0, 1)),
        global_batch=batch,
        max_local_batch=-(-batch // dp) + draw(st.integers(0, 1)),
        batch_policy=policy or draw(st.sampled_from(["fixed", "elastic"])),
        seq_time_s=draw(st.sampled_from([1.0, 0.7])),
        tp_efficiency=eff,
        power_exponent=draw(st.sampled_from([0.65, 0.65, 0.3, 1.0, 0.0])),
        max_boost=draw(st.sampled_from([0.3, 0.3, 0.0, 1.0])),
        idle_power_fraction=draw(st.sampled_from([0.1, 0.0, 0.5])),
        reshard_overhead=draw(st.sampled_from([0.01, 0.0, 0.2])),
    )


def _fail_and_slow(draw: st.DrawFn, g: nx.Graph, max_fail: int, max_slow: int) -> None:
    gpus = topology.gpus(g)
    failed = draw(st.lists(st.sampled_from(gpus), unique=True, max_size=max_fail))
    topology.fail_gpus(g, failed)
    healthy = [x for x in gpus if x not in set(failed)]
    if healthy:
        for x in draw(st.lists(st.sampled_from(healthy), unique=True, max_size=max_slow)):
            topology.set_speed(g, [x], draw(speeds))


@st.composite
def small_instances(draw: st.DrawFn, *, policy: str | None = None) -> Instance:
    """An instance within the exact planner's scope, at most 16 GPUs."""
    nd, size, tray, tpr = draw(st.sampled_from(SMALL_SHAPES))
    g = topology.build_cluster(
        nd, size, tray, tpr, rack_power_factor=draw(st.sampled_from([1.0, 1.15, 1.4]))
    )
    _fail_and_slow(draw, g, 3, 2)
    n = len(topology.gpus(g))
    g.graph["power_budget_w"] = draw(st.sampled_from([0.9, 1.0, 1.0, 1.2])) * 1000.0 * n
    tp = draw(st.sampled_from([t for t in (2, 4, 8) if t <= size]))
    return Instance("small", g, draw(jobs(tp, policy=policy)))


@st.composite
def preset_instances(draw: st.DrawFn) -> Instance:
    """An instance on a topology preset: failures (GPUs and trays), stragglers, budgets."""
    kind = draw(st.sampled_from(sorted(PRESETS)))
    lo, hi = PRESETS[kind]
    n = draw(st.integers(lo, hi))
    g = topology.BUILDERS[kind](n, rack_power_factor=draw(st.sampled_from([1.0, 1.2])))
    trays = topology.trays(g)
    topology.fail_trays(g, draw(st.lists(st.sampled_from(trays), unique=True, max_size=1)))
    _fail_and_slow(draw, g, 4, 3)
    if draw(st.booleans()):
        g.graph["power_budget_w"] = g.graph["power_budget_w"] * draw(
            st.sampled_from([0.8, 0.95, 1.1])
        )
    size = topology.DOMAIN_SIZE[kind]
    tp = draw(st.sampled_from([t for t in (8, 16, 32, 36, 72) if t <= size]))
    return Instance(f"{kind}-{n}", g, draw(jobs(tp, max_pp=3, max_dp=4)))


def instances() -> st.SearchStrategy[Instance]:
    """Small in-scope instances or preset instances."""
    return st.one_of(small_instances(), preset_instances())


@st.composite
def valid_plans(draw: st.DrawFn, instance: Instance, *, min_replicas: int = 0) -> Plan:
    """A feasible plan for ``instance`` built from random free healthy GPUs.

    Replicas take random allowed degrees and random GPUs of random domains;
    batches are split to meet the policy; powers are 1 or a random boost.
    Draws that cannot be completed into a feasible plan are rejected.
    """
    job = instance.job
    g = instance.cluster
    free: dict[Hashable, list[Hashable]] = {}
    for d in topology.domains(g):
        trays = [x for x in nx.neighbors(g, d) if g.nodes[x]["kind"] == "tray"]
        free[d] = [
            x
            for tray in trays
            for x in _tray_gpus(g, tray)
            if g.nodes[x].get("state", "healthy") == "healthy"
        ]
    n_rep = draw(st.integers(min_replicas, job.replicas_max))
    shapes: list[tuple[int, list[Stage]]] = []
    boost = 1.0 + job.max_boost
    for _ in range(n_rep):
        t = draw(st.sampled_from(job.allowed))
        stages = []
        for _k in range(job.pp):
            options = sorted((d for d, gs in free.items() if len(gs) >= t), key=str)
            assume(options)
            d = draw(st.sampled_from(options))
            picks = draw(st.permutations(free[d]))[:t]
            free[d] = [x for x in free[d] if x not in set(picks)]
            power = draw(st.sampled_from([1.0, 1.0, boost, (1.0 + boost) / 2]))
            stages.append(Stage(d, tuple(picks), power))
        shapes.append((t, stages))
    n = len(shapes)
    cap = job.local_batch_max
    if job.batch_policy == "fixed" and n:
        assume(n <= job.global_batch <= n * cap)
        total = job.global_batch
    else:
        total = draw(st.integers(n, max(n, min(job.global_batch, n * cap))))
        assume(total <= job.global_batch or n == 0)
    batches = [1] * n
    for _ in range(total - n):  # hand out the rest one by one to random replicas
        open_ = [i for i in range(n) if batches[i] < cap]
        batches[draw(st.sampled_from(open_))] += 1
    replicas = [
        Replica(t, b, tuple(stages)) for (t, stages), b in zip(shapes, batches, strict=True)
    ]
    plan = Plan(instance.name, tuple(replicas))
    assume(not validate(instance, plan))
    return plan


def _tray_gpus(g: nx.Graph, tray: Hashable) -> list[Hashable]:
    return [x for x in nx.neighbors(g, tray) if g.nodes[x]["kind"] == "gpu"]


def with_cluster(instance: Instance, change: Any) -> Instance:
    """A copy of ``instance`` whose cluster graph went through ``change(graph)``."""
    g = instance.cluster.copy()
    change(g)
    return Instance(instance.name, g, instance.job, dict(instance.meta))
