"""Failures over time (docs/model.md, spec section 5): failure traces and their replay.

* :func:`generate_trace` draws a :class:`Trace`, a time-ordered list of
  failure and repair events, from the Llama 3 failure rates.
* :func:`simulate` replays a trace under one policy, re-planning from scratch
  with :func:`ntp_opt.solve` at every event, and returns a :class:`SimResult`
  with the time-averaged relative goodput and the paused hours.
* :func:`spares_search` finds the fewest spare domains for which a policy
  never stalls (pauses, or falls below a goodput threshold) on a trace drawn
  on the largest cluster and restricted (:func:`restrict_trace`) to smaller
  ones; :func:`spares_needed` draws the trace and asks it about pauses.

The traces live in :mod:`ntp_opt.workflows.traces` and the spares search in
:mod:`ntp_opt.workflows.spares`; this module re-exports them.

The choices the spec left open are recorded in ``docs/simulation.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.solve import POLICIES, Result, solve
from ntp_opt.workflows.spares import (
    PRUNES,
    SparesResult,
    interchangeable_domains,
    spares_needed,
    spares_search,
)
from ntp_opt.workflows.traces import (
    LLAMA3_HARDWARE_SHARE,
    LLAMA3_RATE_PER_GPU_DAY,
    Event,
    Trace,
    check_trace,
    generate_trace,
    restrict_trace,
    state_instance,
    trace_states,
)

__all__ = [
    "LLAMA3_HARDWARE_SHARE",
    "LLAMA3_RATE_PER_GPU_DAY",
    "PRUNES",
    "Event",
    "SimResult",
    "SimStep",
    "SparesResult",
    "Trace",
    "generate_trace",
    "interchangeable_domains",
    "restrict_trace",
    "simulate",
    "spares_needed",
    "spares_search",
]


@dataclass(frozen=True)
class SimStep:
    """One piece of the piecewise-constant goodput.

    The state holds from ``t_hours`` until the next step (or the horizon).
    """

    t_hours: float
    relative_goodput: float
    failed_gpus: int
    """GPUs down in the trace at this time (not counting those failed in the instance)."""
    plan: Plan | None
    status: str
    """The planner's status (``infeasible`` / ``no_solution`` count as goodput 0)."""


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`.

    Attributes
    ----------
    policy
        The planner name.
    horizon_hours
        Length of the trace.
    mean_relative_goodput
        Time average of the relative goodput over the horizon.
    paused_hours
        Hours with relative goodput 0 (the paused job, or no plan).
    replans
        Re-plans: the start plus one per distinct event time.
    solves
        Calls to :func:`ntp_opt.solve` (re-plans of a state already seen are
        taken from the cache).
    steps
        The per-event series.
    """

    policy: str
    horizon_hours: float
    mean_relative_goodput: float
    paused_hours: float
    replans: int
    solves: int
    steps: tuple[SimStep, ...]

    @property
    def times(self) -> np.ndarray:
        """Start time of every step, in hours."""
        return np.array([s.t_hours for s in self.steps], dtype=float)

    @property
    def relative_goodputs(self) -> np.ndarray:
        """Relative goodput of every step."""
        return np.array([s.relative_goodput for s in self.steps], dtype=float)


def simulate(
    instance: Instance,
    trace: Trace,
    policy: str,
    *,
    time_limit: float = 5.0,
    solver: Callable[..., Result] = solve,
) -> SimResult:
    """Replay ``trace`` on ``instance`` under ``policy``.

    At the start and at every distinct event time the job is re-planned from
    scratch with ``solve(current_instance, policy, time_limit=time_limit)``;
    the relative goodput of the plan holds until the next event. Plans are
    cached by the set of GPUs down, so a state seen before is not solved
    again. A planner returning no plan (an infeasible power budget) counts as
    paused.

    Re-planning that limits migration from the previous plan is not done: a
    re-plan may move every replica. ``solver`` replaces :func:`ntp_opt.solve`
    (same signature), e.g. to count or instrument calls.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    check_trace(instance, trace)
    cache: dict[frozenset[int], tuple[float, Plan | None, str]] = {}
    steps = []
    for t, down in trace_states(instance, trace):
        if down not in cache:
            res = solver(state_instance(instance, down), policy, time_limit=time_limit)
            if res.limit == "interrupted":  # Ctrl-C: stop the whole simulation
                raise KeyboardInterrupt
            g = res.relative_objective if res.plan is not None else None
            cache[down] = (float(g) if g is not None else 0.0, res.plan, str(res.status))
        g, plan, status = cache[down]
        steps.append(SimStep(t, g, len(down), plan, status))
    horizon = trace.horizon_hours
    area = 0.0
    paused = 0.0
    for k, s in enumerate(steps):
        end = steps[k + 1].t_hours if k + 1 < len(steps) else horizon
        area += s.relative_goodput * (end - s.t_hours)
        if s.relative_goodput <= 0.0:
            paused += end - s.t_hours
    return SimResult(
        policy=policy,
        horizon_hours=horizon,
        mean_relative_goodput=area / horizon,
        paused_hours=paused,
        replans=len(steps),
        solves=len(cache),
        steps=tuple(steps),
    )


# ---------------------------------------------------------------- spares
