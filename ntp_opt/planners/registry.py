"""Every planner :func:`ntp_opt.solve.solve` accepts, as a :class:`~ntp_opt.planners.base.Planner`.

Each entry is a planner function itself (``(instance, options) -> Outcome``;
:func:`functools.partial` would bind a knob other than its default), except
the exact ones, which :class:`ExactPlanner` runs (on the instance without
power boost for the ``-nopower`` names). The heuristics and ``fast`` are imported normally; the
exact search, the Megatron-restricted search and the risk-aware planner when
first run (:class:`Lazy`: a command that runs ``fast`` does not import them);
the optional integer-programming backends (ortools, pulp, highspy) are
imported by :mod:`ntp_opt.planners.exact.backends` only when used, and raise
an :class:`ImportError` naming the missing extra.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from ntp_opt.model.instance import Instance
from ntp_opt.planners import heuristics, peers
from ntp_opt.planners.base import Outcome, PlannerKind, PlannerSpec, RunOptions
from ntp_opt.planners.fast import plan_fast


def without_power(instance: Instance) -> Instance:
    """The same instance with power boost disabled (``max_boost = 0``)."""
    return instance.with_job(instance.job.model_copy(update={"max_boost": 0.0}))


@dataclass(frozen=True)
class Lazy:
    """The planner ``module.name``, imported when first run.

    Attributes
    ----------
    module, name
        Where the planner function is.
    """

    module: str
    name: str

    def __call__(self, instance: Instance, options: RunOptions) -> Outcome:
        """Run the planner on ``instance`` under ``options``."""
        planner = getattr(importlib.import_module(self.module), self.name)
        out: Outcome = planner(instance, options)
        return out


@dataclass(frozen=True)
class ExactPlanner:
    """The exact search (or the Megatron-restricted one) under a registered name.

    Attributes
    ----------
    name
        The name, written as the plan's ``policy`` metric.
    backend
        Integer-programming backend.
    power
        Power boost as the job allows; ``False``: none (:func:`without_power`).
    megatron
        :func:`ntp_opt.planners.megatron.solve_megatron` instead of
        :func:`ntp_opt.planners.exact.search.solve_exact`.
    """

    name: str
    backend: str
    power: bool
    megatron: bool = False

    def __call__(self, instance: Instance, options: RunOptions) -> Outcome:
        """Run the search on ``instance`` (or its copy without boost) under ``options``."""
        from ntp_opt.planners.exact.search import solve_exact
        from ntp_opt.planners.megatron import solve_megatron

        inst = instance if self.power else without_power(instance)
        if self.megatron:
            out = solve_megatron(inst, options, backend=self.backend)
        else:
            out = solve_exact(inst, options, backend=self.backend)
        if out.plan is None:
            return out
        plan = out.plan.with_metrics(policy=self.name)
        if out.bound is not None:
            plan = plan.with_metrics(bound=out.bound)
        return dataclasses.replace(out, plan=plan, log=out.log if options.log else ())


def _exact(name: str, backend: str, power: bool, megatron: bool, what: str) -> PlannerSpec:
    return PlannerSpec(
        run=ExactPlanner(name, backend, power, megatron),
        description=what,
        instance_bound=power and not megatron,
        uses_time_limit=True,
        kind=PlannerKind.EXACT,
        backend=backend,
    )


#: Every planner by name, in the order of :data:`ntp_opt.solve.PLANNERS`.
REGISTRY: dict[str, PlannerSpec] = {
    "dp-drop": PlannerSpec(heuristics.dp_drop, "drop failed replicas (policy dp-drop)"),
    "ntp": PlannerSpec(heuristics.ntp, "nonuniform tensor parallelism (policy ntp)"),
    "ntp-pw": PlannerSpec(heuristics.ntp_pw, "ntp with power boost (policy ntp-pw)"),
    "megatron-ntp": PlannerSpec(peers.megatron_ntp, "Megatron-LM's NTP runtime planner"),
    "megatron-ntp-reordered": PlannerSpec(
        peers.megatron_ntp_reordered, "megatron-ntp with reordered replicas"
    ),
    "fast": PlannerSpec(
        plan_fast,
        "best of several sort-and-pack candidates, with a bound",
        instance_bound=True,
        kind=PlannerKind.BOUNDED,
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
        Lazy("ntp_opt.planners.riskaware", "plan_risk_aware"),
        "maximise expected goodput after recourse",
        uses_time_limit=True,
        kind=PlannerKind.SEARCH,
    ),
}
