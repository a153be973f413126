"""Every planner :func:`ntp_opt.solve.solve` accepts, as a :class:`~ntp_opt.planners.base.Planner`.

The heuristics and ``fast`` are imported normally; the exact search, the
Megatron-restricted search and the risk-aware planner when first run (a
command that runs ``fast`` does not import them); the optional
integer-programming backends (ortools, pulp, highspy) are imported by
:mod:`ntp_opt.planners.exact.backends` only when used, and raise an
:class:`ImportError` naming the missing extra.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners import heuristics, peers
from ntp_opt.planners.base import Outcome, Planner, PlannerSpec, RunOptions
from ntp_opt.planners.fast import plan_fast


def without_power(instance: Instance) -> Instance:
    """The same instance with power boost disabled (``max_boost = 0``)."""
    return instance.with_job(instance.job.model_copy(update={"max_boost": 0.0}))


class Heuristic(Protocol):
    """A heuristic: ``function(instance, validate=False)`` returns an unchecked plan."""

    def __call__(self, instance: Instance, *, validate: bool = True) -> Plan:
        """The plan; checked with the validator's metrics when ``validate``."""
        ...


def heuristic(function: Heuristic) -> Planner:
    """A :class:`Planner` running ``function(instance) -> Plan`` to the end, unchecked."""

    def run(instance: Instance, options: RunOptions) -> Outcome:
        # solve checks the plan: the heuristic need not check it too
        return Outcome(plan=function(instance, validate=False))

    return run


def fast(instance: Instance, options: RunOptions) -> Outcome:
    """:func:`ntp_opt.planners.fast.plan_fast` as a :class:`Planner` (unchecked plan, bound)."""
    # solve checks the plan: the planner need not check it too
    plan, bound = plan_fast(instance, validate=False, cancel=options.control.cancel)
    return Outcome(plan=plan.with_metrics(bound=bound), bound=bound)


def exact(name: str, backend: str, power: bool, megatron: bool = False) -> Planner:
    """A :class:`Planner` running the exact search (or the Megatron-restricted one)."""

    def run(instance: Instance, options: RunOptions) -> Outcome:
        from ntp_opt.planners.exact.search import solve_exact
        from ntp_opt.planners.megatron import solve_megatron

        inst = instance if power else without_power(instance)
        if megatron:
            out = solve_megatron(
                inst,
                backend,
                time_limit=options.time_limit,
                threads=options.threads,
                seed=options.seed,
                initial_plan=options.initial_plan,
                log=options.log,
                control=options.control,
            )
        else:
            out = solve_exact(inst, options, backend=backend)
        if out.plan is None:
            return out
        plan = out.plan.with_metrics(policy=name)
        if out.bound is not None:
            plan = plan.with_metrics(bound=out.bound)
        return dataclasses.replace(out, plan=plan, log=out.log if options.log else ())

    return run


def risk_aware(instance: Instance, options: RunOptions) -> Outcome:
    """:func:`ntp_opt.planners.riskaware.plan_risk_aware` as a :class:`Planner` (unchecked plan)."""
    from ntp_opt.planners.riskaware import plan_risk_aware

    # solve checks the plan: the planner need not check it too
    return plan_risk_aware(
        instance,
        time_limit=options.time_limit,
        seed=options.seed,
        threads=options.threads,
        cancel=options.control.cancel,
        validate=False,
    )


def _exact(name: str, backend: str, power: bool, megatron: bool, what: str) -> PlannerSpec:
    return PlannerSpec(
        run=exact(name, backend, power, megatron),
        description=what,
        instance_bound=power and not megatron,
        uses_time_limit=True,
        kind="exact",
        backend=backend,
    )


#: Every planner by name, in the order of :data:`ntp_opt.solve.PLANNERS`.
REGISTRY: dict[str, PlannerSpec] = {
    "dp-drop": PlannerSpec(heuristic(heuristics.dp_drop), "drop failed replicas (policy dp-drop)"),
    "ntp": PlannerSpec(heuristic(heuristics.ntp), "nonuniform tensor parallelism (policy ntp)"),
    "ntp-pw": PlannerSpec(heuristic(heuristics.ntp_pw), "ntp with power boost (policy ntp-pw)"),
    "megatron-ntp": PlannerSpec(heuristic(peers.megatron_ntp), "Megatron-LM's NTP runtime planner"),
    "megatron-ntp-reordered": PlannerSpec(
        heuristic(peers.megatron_ntp_reordered), "megatron-ntp with reordered replicas"
    ),
    "fast": PlannerSpec(
        fast, "best of several sort-and-pack candidates, with a bound", True, False, "bounded"
    ),
    "optimal": _exact("optimal", "cpsat", True, False, "exact (CP-SAT)"),
    "optimal-nopower": _exact("optimal-nopower", "cpsat", False, False, "exact, no boost"),
    "cpsat": _exact("cpsat", "cpsat", True, False, "exact with CP-SAT"),
    "highs": _exact("highs", "highs", True, False, "exact with HiGHS"),
    "cbc": _exact("cbc", "cbc", True, False, "exact with CBC"),
    "optimal-megatron": _exact(
        "optimal-megatron", "cpsat", True, True, "exact, Megatron-LM runnable plans"
    ),
    "optimal-megatron-nopower": _exact(
        "optimal-megatron-nopower", "cpsat", False, True, "exact, Megatron runnable, no boost"
    ),
    "risk-aware": PlannerSpec(
        risk_aware, "maximise expected goodput after recourse", False, True, "search"
    ),
}
