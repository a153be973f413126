"""The wait-and-see bound on expected goodput after recourse (``docs/risk.md``).

For the risk-aware planner's training scenarios ``s`` (weights ``w_s``), the
recourse of any plan ``P`` to ``s`` is a feasible plan of the scenario's
instance (:func:`ntp_opt.model.failures.failed_instance`;
:mod:`ntp_opt.rules.recourse` guarantees it), so its goodput ``G(P, s)`` is at
most that instance's optimum, which is at most any proven upper bound
``U_s`` on it. Hence, for every plan,

    sum_s w_s G(P, s)  <=  sum_s w_s U_s,

the *wait-and-see* bound: the planner's objective (the exact expectation
when the scenarios are enumerated, the sample average otherwise) can never
beat the weighted mean of the scenarios' own optima.

:func:`wait_and_see_bound` computes ``U_s`` with the exact planner
(:func:`ntp_opt.planners.exact.search.solve_exact`, its proven bound, never
its objective), heaviest scenarios first, within a time budget. Every
scenario not solved (time, cancel, an instance above :data:`WS_MAX_GPUS`
GPUs, or a solve that would not tighten it) gets the *cap*: a bound valid
for a whole group of scenarios (those whose failures free at most so many
idle watts, :data:`WS_TIERS` groups), the exact planner's bound (or
:func:`~ntp_opt.planners.bounds.capacity.capacity_bound`) of the
:func:`relaxed_instance`: the instance without the new failures, each rack
and the site budget raised by the largest idle draw that one scenario's
failed GPUs had there. Any plan feasible in a scenario is feasible there:
its GPUs are healthy, and the idle watts its failed GPUs no longer draw are
at most what the budgets gained. When ``idle_power_fraction`` is 0 the
relaxed instance is the instance itself, and the cap is the no-failure
bound (so is the lowest tier's when a scenario fails no healthy GPU).

Where every domain lies in one rack with one TDP and one board limit
(:func:`~ntp_opt.planners.riskaware.scorer.refills_keep_power`) no relaxation
is needed: recourse never raises a power multiplier, and each GPU it takes
from a pool replaces a failed GPU of the same stage, rack and TDP, so no
draw rises when the failed GPUs are counted at their idle draw. The
recourse plan is then feasible for :func:`idle_instance` (the failed GPUs
unusable but still drawing idle power), a restriction of the no-failure
instance: every scenario's cap is the no-failure bound (``nominal_bound``,
e.g. the risk-blind solve's), and each scenario is solved on
:func:`idle_instance`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.control import Control, Deadline
from ntp_opt.model.failures import failed_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import Limit, Outcome, RunOptions
from ntp_opt.planners.bounds import capacity_bound
from ntp_opt.planners.exact.search import solve_exact
from ntp_opt.planners.riskaware.scenarios import Scenarios
from ntp_opt.planners.riskaware.scorer import refills_keep_power
from ntp_opt.rules.power import idle_draw
from ntp_opt.rules.tolerances import REL_TOL

__all__ = [
    "WS_MAX_GPUS",
    "WS_TIERS",
    "WaitAndSee",
    "bound_solve",
    "idle_instance",
    "relaxed_instance",
    "solve_share",
    "wait_and_see_bound",
]

#: Largest instance (GPUs) whose scenarios are solved by the exact planner;
#: above it every scenario gets the cap from :func:`capacity_bound`.
WS_MAX_GPUS = 4096
#: Share of the remaining budget the cap's exact solve may use.
CAP_SHARE = 0.5
#: A scenario's (or a nonanticipative restricted instance's) solve may use the
#: remaining budget divided by the solves left, but never less than this share
#: of it (so that solves that need more than an even split still finish while
#: few are left).
SOLVE_SHARE = 0.25
#: Tiers of caps: scenarios are grouped by the idle watts their failures
#: free (at evenly spaced quantiles of their weight), and each group gets
#: the cap of its own relaxed instance.
WS_TIERS = 4


@dataclass(frozen=True)
class WaitAndSee:
    """The wait-and-see bound and how it was obtained.

    Attributes
    ----------
    bound
        ``sum_s w_s U_s``: an upper bound on the weighted mean goodput after
        recourse of every plan over the scenarios (sequences per second).
    scenario_bounds
        ``U_s`` per scenario, in the order of :attr:`Scenarios.gpus`.
    cap
        The bound valid for every scenario (module docstring); scenarios
        whose failures free fewer idle watts get the smaller cap of their
        tier (:data:`WS_TIERS`).
    solved
        Scenarios whose ``U_s`` comes from their own exact solve.
    proven
        Of those, the ones solved to optimality (``U_s`` within the exact
        planner's tolerance of the scenario's optimum).
    capped
        Scenarios given the cap without a solve because a known plan already
        reaches it in that scenario (their ``U_s`` is tight).
    limit_hit
        The time budget (or a cancel) left some scenario with the cap that a
        solve might have tightened, or stopped a solve.
    """

    bound: float
    scenario_bounds: np.ndarray
    cap: float
    solved: int
    proven: int
    capped: int
    limit_hit: bool


def relaxed_instance(instance: Instance, scenarios: Sequence[np.ndarray]) -> Instance:
    """The instance with rack and site budgets raised by the idle draw scenarios free.

    Parameters
    ----------
    instance
        The instance.
    scenarios
        Failed GPU indices (``instance.arrays`` order) of each scenario.

    Returns
    -------
    Instance
        Each rack's budget raised by the largest idle draw the failed GPUs of
        one scenario had in that rack, and the site's by the largest over the
        site; ``instance`` itself when nothing is raised (no healthy GPU
        fails, or ``idle_power_fraction`` is 0). Every plan feasible for
        ``failed_instance(instance, mask)``, ``mask`` one of ``scenarios``, is
        feasible for it: its GPUs are healthy here, and the watts the
        scenario's failed GPUs no longer draw are at most what the budgets
        gained.
    """
    a = instance.arrays
    idle = instance.job.idle_power_fraction
    rack = np.zeros(len(a.rack_ids))
    site = 0.0
    if idle > 0:
        per_gpu = idle_draw(instance)
        for g in scenarios:
            gpus = np.unique(np.asarray(g, dtype=np.int64))
            gpus = gpus[a.healthy[gpus]]
            if len(gpus) == 0:
                continue
            watts = per_gpu[gpus]
            per_rack = np.bincount(a.gpu_rack[gpus], weights=watts, minlength=len(a.rack_ids))
            rack = np.maximum(rack, per_rack)
            site = max(site, float(watts.sum()))
    if site <= 0:
        return instance
    g = instance.cluster.copy()
    for i, rid in enumerate(a.rack_ids):
        g.nodes[rid]["power_budget_w"] = float(a.rack_budget[i] + rack[i])
    g.graph["power_budget_w"] = float(a.site_budget + site)
    return Instance(instance.name, g, instance.job, instance.meta)


def idle_instance(instance: Instance, unusable: np.ndarray) -> Instance:
    """The instance with the ``unusable`` GPUs failed but still drawing their idle power.

    Parameters
    ----------
    instance
        The instance.
    unusable
        Per GPU (``instance.arrays`` order), whether no plan may use it.

    Returns
    -------
    Instance
        Those GPUs ``failed``; each rack's budget, and the site's, lowered by
        the idle draw those of them that are healthy in ``instance`` had there.
        A plan is feasible here exactly when it uses none of them and is
        feasible for ``instance``. When :func:`refills_keep_power` holds,
        recourse to a scenario is such a plan with ``unusable`` the
        scenario's failed GPUs (module docstring).
    """
    a = instance.arrays
    mask = np.asarray(unusable, dtype=bool) & a.healthy
    out = instance.with_health(healthy=a.healthy & ~mask)
    watts = idle_draw(instance, mask)
    if not watts.any():
        return out
    per_rack = np.bincount(a.gpu_rack, weights=watts, minlength=len(a.rack_ids))
    g = out.cluster.copy()
    for i, rid in enumerate(a.rack_ids):
        if per_rack[i] > 0:
            g.nodes[rid]["power_budget_w"] = float(a.rack_budget[i] - per_rack[i])
    g.graph["power_budget_w"] = float(a.site_budget - watts.sum())
    return Instance(instance.name, g, instance.job, instance.meta)


def bound_solve(
    instance: Instance,
    time_limit: float | None,
    seed: int,
    threads: int,
    control: Control | None,
) -> Outcome:
    """:func:`solve_exact` for its bound alone (no bound report), as the risk-aware
    bounds solve their scenario and restricted instances.

    Parameters
    ----------
    instance
        The instance to bound.
    time_limit, seed, threads
        As :class:`~ntp_opt.planners.base.RunOptions`.
    control
        The caller's control (``None``: a silent one).

    Returns
    -------
    Outcome
        The exact planner's outcome; its ``bound`` (``None`` when not found)
        bounds the goodput of every plan of ``instance``.
    """
    return solve_exact(
        instance,
        RunOptions(
            time_limit=time_limit,
            seed=seed,
            threads=threads,
            control=Control("", None, None) if control is None else control,
        ),
        report_bounds=False,
    )


def solve_share(clock: Deadline, n_left: int) -> float | None:
    """Seconds one of ``n_left`` solves may use: the time left split evenly, but at
    least :data:`SOLVE_SHARE` of it (``None`` without a deadline)."""
    left = clock.remaining()
    return None if left is None else left * max(1 / n_left, SOLVE_SHARE)


def _avoids(plan_gpus: np.ndarray, failed: np.ndarray) -> bool:
    return not bool(np.isin(failed, plan_gpus, assume_unique=False).any())


def wait_and_see_bound(
    instance: Instance,
    scenarios: Scenarios,
    *,
    deadline: float | None = None,
    seed: int = 0,
    threads: int = 1,
    known: Sequence[tuple[Plan, float]] = (),
    cancel: threading.Event | None = None,
    max_gpus: int = WS_MAX_GPUS,
    solve_scenarios: bool = True,
    nominal_bound: float | None = None,
) -> WaitAndSee:
    """Upper bound on ``sum_s w_s G(P, s)`` over every plan ``P`` (module docstring).

    Parameters
    ----------
    instance
        The instance.
    scenarios
        The scenarios and weights (e.g. :func:`training_scenarios`' ones:
        the same seed gives the same scenarios, hence the same bound).
    deadline
        ``time.perf_counter()`` value by which to stop solving (``None``:
        solve every scenario that could tighten the bound, without a limit;
        deterministic with ``threads=1``).
    seed, threads
        Passed to the exact planner.
    known
        Plans feasible for ``instance`` with their goodput. A plan that uses
        no GPU failing in a scenario stays feasible there, so that
        scenario's optimum is at least its goodput; a scenario where this
        already meets the cap is not solved.
    cancel
        Once set, no further scenario is solved (the running solve stops);
        the unsolved ones keep the cap, so the bound stays valid.
    max_gpus
        Above this many GPUs no exact solve runs: the cap is
        :func:`capacity_bound` of the relaxed instance.
    solve_scenarios
        Solve the scenarios (default); ``False``: only the caps and the
        known plans (every ``U_s`` is its tier's cap).
    nominal_bound
        A proven bound on ``instance``'s optimum (e.g. the risk-blind
        solve's). When :func:`refills_keep_power` holds it is the cap of
        every scenario, and no cap is solved.

    Returns
    -------
    WaitAndSee
    """
    weights = np.asarray(scenarios.weights, dtype=float)
    clock = Deadline(Control("risk-aware", None, cancel), deadline)
    exact = instance.arrays.n_gpus <= max_gpus
    # the caps: one relaxed instance per tier of freed idle watts; none is
    # needed when recourse keeps the nominal draws (failed GPUs count at idle)
    keeps = refills_keep_power(instance)
    relief = _freed_watts(instance, scenarios, keeps)
    tiers = _tier_levels(relief, weights)
    tier_caps, limit_hit = _tier_caps(
        instance, scenarios, relief, tiers, keeps, exact, nominal_bound, clock, seed, threads
    )
    caps = np.array(tier_caps)[np.searchsorted(tiers, relief)]
    bounds = caps.copy()
    order, capped = _unsettled(caps, _known_lower(instance, scenarios, known), weights)
    solved = proven = 0
    if exact and solve_scenarios:
        solved, proven, hit = _solve_scenarios(
            instance, scenarios, order, caps, bounds, keeps, clock, seed, threads
        )
        limit_hit = limit_hit or hit
    return WaitAndSee(
        bound=float(np.dot(weights, bounds)),
        scenario_bounds=bounds,
        cap=float(max(tier_caps)),
        solved=solved,
        proven=proven,
        capped=capped,
        limit_hit=limit_hit,
    )


def _unsettled(caps: np.ndarray, lower: np.ndarray, weights: np.ndarray) -> tuple[list[int], int]:
    """The scenarios a solve might tighten, largest possible gain first, and how many
    a known plan already meets the cap in (their ``U_s`` is tight)."""
    tight = caps <= lower * (1 + 2 * REL_TOL)
    order = sorted(
        (i for i in range(len(caps)) if not tight[i]),
        key=lambda i: (-weights[i] * (caps[i] - lower[i]), i),
    )
    return order, int(tight.sum())


def _freed_watts(instance: Instance, scenarios: Scenarios, keeps: bool) -> np.ndarray:
    """Per scenario, the idle watts its failed GPUs free (0 when recourse keeps the draws)."""
    a = instance.arrays
    idle = idle_draw(instance, a.healthy & (not keeps))
    return np.array([float(idle[np.unique(g)].sum()) for g in scenarios.gpus])


def _tier_levels(relief: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The tiers' levels: the freed watts at evenly spaced quantiles of the weight
    (the smallest and the largest included)."""
    n = len(relief)
    by_relief = np.argsort(relief, kind="stable")
    cum = np.cumsum(weights[by_relief])
    at = np.searchsorted(cum, np.linspace(0.0, 1.0, WS_TIERS) * cum[-1], side="left")
    return np.unique(np.append(relief[by_relief[np.minimum(at, n - 1)]], relief.max()))


def _tier_caps(
    instance: Instance,
    scenarios: Scenarios,
    relief: np.ndarray,
    tiers: np.ndarray,
    keeps: bool,
    exact: bool,
    nominal_bound: float | None,
    clock: Deadline,
    seed: int,
    threads: int,
) -> tuple[list[float], bool]:
    """Each tier's cap (a higher tier's covers the lower) and whether a limit cut one."""
    control = clock.control
    limit_hit = False
    tier_caps = []
    for j, level in enumerate(tiers):
        members = [g for g, r in zip(scenarios.gpus, relief, strict=True) if r <= level]
        relaxed = instance if keeps else relaxed_instance(instance, members)
        cap_j = capacity_bound(relaxed)
        if keeps and nominal_bound is not None:
            cap_j = min(cap_j, nominal_bound)
        elif exact and not clock.stopped():
            left = clock.remaining()
            share = None if left is None else CAP_SHARE * left / (len(tiers) - j)
            out = bound_solve(relaxed, share, seed, threads, control)
            limit_hit = limit_hit or out.limit != Limit.NONE
            if out.bound is not None:
                cap_j = min(cap_j, out.bound)
        elif exact:
            limit_hit = True
        tier_caps.append(cap_j)
    for j in range(len(tier_caps) - 2, -1, -1):  # a higher tier's relaxation covers the lower
        tier_caps[j] = min(tier_caps[j], tier_caps[j + 1])
    return tier_caps, limit_hit


def _known_lower(
    instance: Instance, scenarios: Scenarios, known: Sequence[tuple[Plan, float]]
) -> np.ndarray:
    """A lower bound per scenario from the known plans (0 where none avoids it)."""
    lower = np.zeros(len(scenarios.gpus))
    for plan, value in known:
        index = instance.arrays.gpu_index
        ids = [index[g] for rep in plan.replicas for st in rep.stages for g in st.gpus]
        used = np.array(ids, dtype=np.int64)
        for i, g in enumerate(scenarios.gpus):
            if value > lower[i] and _avoids(used, g):
                lower[i] = value
    return lower


def _solve_scenarios(
    instance: Instance,
    scenarios: Scenarios,
    order: list[int],
    caps: np.ndarray,
    bounds: np.ndarray,
    keeps: bool,
    clock: Deadline,
    seed: int,
    threads: int,
) -> tuple[int, int, bool]:
    """Solve the scenarios in ``order`` into ``bounds``: ``(solved, proven, limit hit)``."""
    control = clock.control
    solved = proven = 0
    limit_hit = False
    cache: dict[bytes, float] = {}
    for k, i in enumerate(order):
        if clock.stopped():
            limit_hit = True
            break
        key = np.sort(scenarios.gpus[i]).astype(np.int64).tobytes()
        if key in cache:  # the same failed GPUs: the same instance
            bounds[i] = cache[key]
            continue
        mask = np.zeros(instance.arrays.n_gpus, dtype=bool)
        mask[scenarios.gpus[i]] = True
        scenario = idle_instance(instance, mask) if keeps else failed_instance(instance, mask)
        out = bound_solve(scenario, solve_share(clock, len(order) - k), seed, threads, control)
        limit_hit = limit_hit or out.limit != Limit.NONE
        u = out.bound if out.bound is not None else capacity_bound(scenario)
        bounds[i] = cache[key] = min(caps[i], u)
        solved += 1
        proven += int(out.proven)
    return solved, proven, limit_hit
