"""The risk-aware planner: :func:`plan_risk_aware` and its :class:`RiskAwareOutcome`.

It starts from the risk-blind optimum, runs the local search of
:mod:`ntp_opt.planners.riskaware.search` on the training scenarios and
reports an estimate on fresh ones (``docs/risk.md``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

from ntp_opt.model.control import Control
from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import Limit, Outcome, RunOptions
from ntp_opt.planners.riskaware.nonanticipative import domain_bound, domain_limit
from ntp_opt.planners.riskaware.scenarios import (
    SAA_SAMPLES,
    fresh_scenarios,
    gpu_risk,
    scenario_goodputs,
    training_scenarios,
)
from ntp_opt.planners.riskaware.search import Search, local_search, relocate
from ntp_opt.planners.riskaware.waitandsee import wait_and_see_bound
from ntp_opt.rules.expected import Z95
from ntp_opt.rules.tolerances import FLOAT_NOISE, REL_TOL
from ntp_opt.rules.validate import certified, evaluate, infeasibility

__all__ = [
    "BLIND_SHARE",
    "EVAL_SHARE",
    "WS_AUTO_GPUS",
    "WS_AUTO_SCENARIOS",
    "RiskAwareOutcome",
    "plan_risk_aware",
]

logger = logging.getLogger(__name__)

#: Share of the time limit given to the risk-blind optimum.
BLIND_SHARE = 0.4
#: Share of the time limit reserved for the fresh-scenario estimate at the end.
EVAL_SHARE = 0.15
#: Share of the time limit, before the estimate's, kept from the bound for the
#: search seeded by the bound's domains.
RESEED_SHARE = 0.05
#: The wait-and-see bound is on by default only for at most this many
#: distinct training scenarios (each may need an exact solve) ...
WS_AUTO_SCENARIOS = 64
#: ... on instances of at most this many GPUs.
WS_AUTO_GPUS = 1024


@dataclass(frozen=True)
class RiskAwareOutcome(Outcome):
    """What :func:`plan_risk_aware` returns: an :class:`Outcome` and the plan it started from.

    Attributes
    ----------
    plan
        The risk-aware plan (never ``None``; validated unless
        ``validate=False``; metrics in ``docs/risk.md``).
    bound
        A bound on the training objective (expected goodput after recourse
        over the training scenarios) of every plan: the smaller of the
        wait-and-see bound and the domain bound, or ``None`` with
        ``ws_bound=False``; the risk-blind optimum's bound on *nominal*
        goodput is the plan's ``bound`` metric.
    proven
        The gap ``(bound - objective) / bound`` is within
        :data:`~ntp_opt.rules.tolerances.REL_TOL` (1e-6): no plan has an
        expected goodput over these scenarios higher by more than that.
    limit
        :attr:`Limit.TIME` when the search, the wait-and-see bound or the
        final estimate stopped at the time limit, :attr:`Limit.INTERRUPTED`
        when ``cancel`` stopped the search (the plan is the best so far); so
        ``time_limit_hit`` and ``interrupted`` read as before.
    stats
        ``evaluations``: candidate plans scored (also :attr:`evaluations`);
        ``expected_objective``: the plan's training objective (the
        ``saa_expected_goodput`` metric), which :attr:`bound` bounds.
    blind
        The risk-blind plan it started from.
    """

    plan: Plan
    blind: Plan = field(kw_only=True)

    @property
    def evaluations(self) -> int:
        """Candidate plans scored."""
        return int(self.stats.get("evaluations", 0))


def plan_risk_aware(
    instance: Instance,
    *,
    time_limit: float | None = 60.0,
    seed: int = 0,
    threads: int = 1,
    samples: int = SAA_SAMPLES,
    exact_units: int = 10,
    fresh_samples: int = 1000,
    nominal_tolerance: float = 0.0,
    blast_radius: str = "gpu",
    scale: float = 1.0,
    blind: Plan | None = None,
    cancel: threading.Event | None = None,
    validate: bool = True,
    ws_bound: bool | None = None,
) -> RiskAwareOutcome:
    """Maximise expected goodput after recourse, starting from the risk-blind optimum.

    Parameters
    ----------
    instance
        The instance (GPU and tray ``p_fail`` give the risk).
    time_limit
        Seconds for everything (``None``: no limit): at most
        :data:`BLIND_SHARE` of it for the risk-blind optimum, the search up
        to ``1 -`` :data:`EVAL_SHARE`, the fresh estimate in the rest.
    seed
        Seed of the training and fresh scenarios and of the exact solver.
    threads
        Worker threads of the exact solver (1: deterministic).
    samples
        SAA sample size (training scenarios) when not enumerated.
    exact_units
        Optimise the exact expectation when the instance has at most this
        many failure units.
    fresh_samples
        Fresh Monte Carlo scenarios for the reported ``expected_goodput``
        (fewer if the time limit strikes first; ``0`` skips it).
    nominal_tolerance
        Fraction of the risk-blind optimum's nominal goodput the plan may
        give up for expected goodput (default 0: none).
    blast_radius, scale
        As in :func:`ntp_opt.model.failures.sample_failures`.
    blind
        The risk-blind plan to start from (default: ``solve(instance, "optimal")``).
    cancel
        Once set, every stage stops at its next check and the best plan so far
        is returned with ``interrupted``.
    validate
        Check the plan with the validator and attach its figures to the
        metrics (default). :func:`ntp_opt.solve.solve` passes ``False``: it
        checks every plan once itself.

    ws_bound
        Bound the training objective over every plan (``docs/risk.md``), in
        the time the search leaves before the fresh estimate's share (all of
        it without a time limit). ``None`` (default): always, with the
        cheapest valid caps (the nominal optimum's bound where recourse keeps
        the nominal draws) and, where it applies, the non-anticipative domain
        bound (:func:`~ntp_opt.planners.riskaware.nonanticipative.domain_bound`,
        whose domains also seed a second search); elsewhere the wait-and-see
        bound solves the scenarios (heaviest first; without a time limit only
        for at most :data:`WS_AUTO_SCENARIOS` distinct scenarios and
        :data:`WS_AUTO_GPUS` GPUs). ``True``: the wait-and-see bound solves
        the scenarios too. ``False``: no bound (``bound`` is ``None``).

    Returns
    -------
    RiskAwareOutcome
    """
    if not 0.0 <= nominal_tolerance <= 1.0:
        raise ValueError(f"nominal_tolerance must be in [0, 1], got {nominal_tolerance!r}")
    if fresh_samples < 0:
        raise ValueError(f"fresh_samples must be >= 0, got {fresh_samples}")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be positive, got {time_limit!r}")
    start = time.perf_counter()
    end = None if time_limit is None else start + time_limit
    bound = None
    if blind is None:
        from ntp_opt.planners.exact.search import solve_exact

        if infeasibility(instance) is not None:
            raise ValueError(f"instance {instance.name!r}: {infeasibility(instance)}")
        found = solve_exact(
            instance,
            RunOptions(
                time_limit=None if time_limit is None else BLIND_SHARE * time_limit,
                seed=seed,
                threads=threads,
                control=Control("risk-aware", None, cancel),
            ),
        )
        assert found.plan is not None  # the exact search always returns a plan
        blind, bound = found.plan, found.bound
    nominal = evaluate(instance, blind)
    if not nominal.feasible:
        raise ValueError("blind: the starting plan is not feasible for the instance")
    scenarios = training_scenarios(
        instance,
        samples=samples,
        seed=seed,
        exact_units=exact_units,
        blast_radius=blast_radius,
        scale=scale,
    )
    risk = gpu_risk(instance, blast_radius, scale)
    search_end = None if time_limit is None else start + (1 - EVAL_SHARE) * time_limit
    # the bound stops a little earlier, for the search seeded by its domains
    bound_end = None if time_limit is None else start + (1 - EVAL_SHARE - RESEED_SHARE) * time_limit
    s = Search(
        instance,
        scenarios,
        risk,
        nominal.goodput * (1 - nominal_tolerance) * (1 - FLOAT_NOISE),
        search_end,
        cancel,
    )
    layout = Layout.from_plan(instance, blind)
    plan0 = s.plan(layout)
    if plan0 is None or evaluate(instance, plan0).goodput < nominal.goodput:
        plan0 = blind  # keep the given batches when the re-split cannot match them
    value0 = s.score(plan0, layout)  # the same stages either way (batches do not count)
    plan, value = local_search(s, layout, plan0, value0)
    best_layout = Layout.from_plan(instance, plan)
    metrics: dict[str, object] = {
        "policy": "risk-aware",
        "saa_expected_goodput": value,
        "saa_method": scenarios.method,
        "saa_samples": scenarios.samples,
        "blind_saa_expected_goodput": value0,
        "blind_goodput": nominal.goodput,
    }
    hit = s.timed_out
    bound_value: float | None = None
    proven = False
    if ws_bound is not False and not (cancel is not None and cancel.is_set()):
        coupled = domain_limit(instance) is not None
        small = len(scenarios.gpus) <= WS_AUTO_SCENARIOS and instance.arrays.n_gpus <= WS_AUTO_GPUS
        ws = wait_and_see_bound(
            instance,
            scenarios,
            deadline=bound_end,
            seed=seed,
            threads=threads,
            known=[(blind, nominal.goodput), (plan, evaluate(instance, plan).goodput)],
            cancel=cancel,
            nominal_bound=bound,
            solve_scenarios=bool(ws_bound) or (not coupled and (search_end is not None or small)),
        )
        bound_value = ws.bound
        hit = hit or ws.limit_hit
        metrics.update(
            ws_cap=ws.cap,
            ws_solved=ws.solved,
            ws_proven=ws.proven,
            ws_capped=ws.capped,
            ws_limit=ws.limit_hit,
        )
        if coupled and not (cancel is not None and cancel.is_set()):
            na = domain_bound(
                instance,
                scenarios,
                ws.scenario_bounds,
                deadline=bound_end,
                seed=seed,
                threads=threads,
                cancel=cancel,
                min_nominal=s.min_nominal,
            )
            assert na is not None  # domain_limit said it applies
            bound_value = min(bound_value, na.bound)
            # primal: the search again, from the plan moved onto the bound's domains
            moved = relocate(s, best_layout, na.chosen) if na.chosen else None
            reseeded = False
            if moved is not None and moved is not best_layout and not s.expired():
                p1 = s.plan(moved)
                if p1 is not None:
                    plan1, value1 = local_search(s, moved, p1, s.score(p1, moved))
                    reseeded = True
                    if value1 > value:
                        plan, value = plan1, value1
                        metrics["saa_expected_goodput"] = value
            hit = hit or na.limit_hit
            metrics.update(
                na_bound=max(na.bound, value),
                na_domains=na.domains,
                na_options=na.options,
                na_solved=na.solved,
                na_masters=na.masters,
                na_limit=na.limit_hit,
                na_reseeded=reseeded,
                na_power_cap=na.power_cap,
            )
        # every bound is proven (to the exact planner's tolerance): a bound
        # below the objective is a bug, never hidden
        if bound_value < value * (1 - REL_TOL):
            raise RuntimeError(f"bound {bound_value} on the expected goodput below {value}")
        bound_value = max(bound_value, value)
        # proven when the gap, as Result.gap computes it, is within the tolerance
        proven = bound_value - value <= REL_TOL * bound_value
        hit = hit or s.timed_out
        ws_value = max(ws.bound, value)
        metrics.update(
            ws_bound=ws_value,
            ws_gap=(ws_value - value) / ws_value if ws_value > 0 else 0.0,
        )
        metrics.update(
            expected_bound=bound_value,
            expected_gap=(bound_value - value) / bound_value if bound_value > 0 else 0.0,
        )
    if scenarios.method == "exact":
        metrics.update(
            expected_goodput=value, expected_method="exact", expected_samples=scenarios.samples
        )
    elif fresh_samples > 0:
        fresh = fresh_scenarios(
            instance, fresh_samples, seed=seed, blast_radius=blast_radius, scale=scale
        )
        vals = scenario_goodputs(instance, plan, fresh, deadline=end, cancel=cancel)
        hit = hit or len(vals) < fresh_samples
        mean = float(vals.mean())
        metrics.update(expected_goodput=mean, expected_method="mc", expected_samples=len(vals))
        if len(vals) > 1:  # no interval from one scenario (and JSON has no infinity)
            half = Z95 * float(vals.std(ddof=1)) / math.sqrt(len(vals))
            metrics.update(expected_ci_low=mean - half, expected_ci_high=mean + half)
    if bound is not None:
        metrics["bound"] = bound
    out = plan.with_metrics(**metrics)
    if validate:
        out = certified(instance, out)
    stopped = s.interrupted or (cancel is not None and cancel.is_set())
    logger.info(
        "risk-aware: %d plans scored, expected goodput %.9g (blind %.9g)%s",
        s.evaluations,
        value,
        value0,
        " (interrupted)" if stopped else "",
    )
    limit = Limit.INTERRUPTED if stopped else Limit.TIME if hit else Limit.NONE
    return RiskAwareOutcome(
        plan=out,
        bound=bound_value,
        proven=proven,
        limit=limit,
        stats={"evaluations": s.evaluations, "expected_objective": value},
        blind=blind,
    )
