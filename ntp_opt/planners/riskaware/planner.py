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
    Scenarios,
    fresh_scenarios,
    gpu_risk,
    scenario_goodputs,
    training_scenarios,
)
from ntp_opt.planners.riskaware.search import Search, local_search, relocate
from ntp_opt.planners.riskaware.waitandsee import WaitAndSee, wait_and_see_bound
from ntp_opt.rules.expected import Z95
from ntp_opt.rules.tolerances import FLOAT_NOISE, REL_TOL
from ntp_opt.rules.validate import Evaluation, evaluate, infeasibility

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
        The risk-aware plan (never ``None``; not yet checked: :func:`ntp_opt.solve.solve`
        checks it; metrics in ``docs/risk.md``).
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
    options: RunOptions = RunOptions(),
    *,
    samples: int = SAA_SAMPLES,
    exact_units: int = 10,
    fresh_samples: int = 1000,
    nominal_tolerance: float = 0.0,
    blast_radius: str = "gpu",
    scale: float = 1.0,
    blind: Plan | None = None,
    ws_bound: bool | None = None,
) -> RiskAwareOutcome:
    """Maximise expected goodput after recourse, starting from the risk-blind optimum.

    Parameters
    ----------
    instance
        The instance (GPU and tray ``p_fail`` give the risk).
    options
        ``time_limit``: seconds for everything (``None``: no limit), at most
        :data:`BLIND_SHARE` of it for the risk-blind optimum, the search up
        to ``1 -`` :data:`EVAL_SHARE`, the fresh estimate in the rest;
        ``seed``: of the training and fresh scenarios and of the exact
        solver; ``threads``: worker threads of the exact solver (1:
        deterministic); ``control.cancel``: once set, every stage stops at
        its next check and the best plan so far is returned with
        ``interrupted``. The other fields are not read.
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
        Its plan not yet checked (:func:`ntp_opt.solve.solve` checks it).
    """
    _check_arguments(options, nominal_tolerance, fresh_samples)
    start = time.perf_counter()
    blind, bound = (blind, None) if blind is not None else _blind_optimum(instance, options)
    run = _start(
        instance,
        options,
        blind,
        start,
        nominal_tolerance,
        samples,
        exact_units,
        blast_radius,
        scale,
    )
    run.search_from_blind()
    if ws_bound is not False and not run.cancel.is_set():
        _bound(run, ws_bound, bound)
    _estimate(run, fresh_samples, blast_radius, scale)
    return run.outcome(bound)


def _check_arguments(options: RunOptions, nominal_tolerance: float, fresh_samples: int) -> None:
    """``ValueError`` naming the first argument out of its range."""
    if not 0.0 <= nominal_tolerance <= 1.0:
        raise ValueError(f"nominal_tolerance must be in [0, 1], got {nominal_tolerance!r}")
    if fresh_samples < 0:
        raise ValueError(f"fresh_samples must be >= 0, got {fresh_samples}")
    time_limit = options.time_limit
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be positive, got {time_limit!r}")


def _blind_optimum(instance: Instance, options: RunOptions) -> tuple[Plan, float | None]:
    """The risk-blind optimum (exact, in :data:`BLIND_SHARE` of the time) and its bound."""
    from ntp_opt.planners.exact.search import solve_exact

    if infeasibility(instance) is not None:
        raise ValueError(f"instance {instance.name!r}: {infeasibility(instance)}")
    time_limit, seed, threads = options.time_limit, options.seed, options.threads
    cancel = options.control.cancel
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
    return found.plan, found.bound


@dataclass
class _Run:
    """The state of one :func:`plan_risk_aware` run, shared by its steps."""

    instance: Instance
    blind: Plan
    nominal: Evaluation
    scenarios: Scenarios
    search: Search
    seed: int
    threads: int
    cancel: threading.Event
    end: float | None  # the time limit
    search_end: float | None  # the search (and the bounds) stop here
    bound_end: float | None  # the bounds stop here (room for the reseeded search)
    plan: Plan | None = None
    value: float = 0.0
    value0: float = 0.0
    hit: bool = False
    proven: bool = False
    bound_value: float | None = None
    metrics: dict[str, object] = field(default_factory=dict)

    def search_from_blind(self) -> None:
        """The local search from the blind plan (re-split) on the training scenarios."""
        instance, s, blind, nominal = self.instance, self.search, self.blind, self.nominal
        layout = Layout.from_plan(instance, blind)
        plan0 = s.plan(layout)
        if plan0 is None or evaluate(instance, plan0).goodput < nominal.goodput:
            plan0 = blind  # keep the given batches when the re-split cannot match them
        self.value0 = s.score(plan0, layout)  # the same stages either way (batches do not count)
        self.plan, self.value = local_search(s, layout, plan0, self.value0)
        self.metrics.update(
            {
                "policy": "risk-aware",
                "saa_expected_goodput": self.value,
                "saa_method": self.scenarios.method,
                "saa_samples": self.scenarios.samples,
                "blind_saa_expected_goodput": self.value0,
                "blind_goodput": nominal.goodput,
            }
        )
        self.hit = s.timed_out

    def outcome(self, nominal_bound: float | None) -> RiskAwareOutcome:
        """The :class:`RiskAwareOutcome` (plan not yet checked; the blind optimum's bound)."""
        if nominal_bound is not None:
            self.metrics["bound"] = nominal_bound
        s = self.search
        assert self.plan is not None  # the search always returns a plan
        out = self.plan.with_metrics(**self.metrics)
        stopped = s.interrupted or self.cancel.is_set()
        logger.info(
            "risk-aware: %d plans scored, expected goodput %.9g (blind %.9g)%s",
            s.evaluations,
            self.value,
            self.value0,
            " (interrupted)" if stopped else "",
        )
        limit = Limit.INTERRUPTED if stopped else Limit.TIME if self.hit else Limit.NONE
        return RiskAwareOutcome(
            plan=out,
            bound=self.bound_value,
            proven=self.proven,
            limit=limit,
            stats={"evaluations": s.evaluations, "expected_objective": self.value},
            blind=self.blind,
        )


def _start(
    instance: Instance,
    options: RunOptions,
    blind: Plan,
    start: float,
    nominal_tolerance: float,
    samples: int,
    exact_units: int,
    blast_radius: str,
    scale: float,
) -> _Run:
    """The run's scenarios, deadlines and :class:`Search` (nominal floor from ``blind``)."""
    time_limit, seed, cancel = options.time_limit, options.seed, options.control.cancel
    end = None if time_limit is None else start + time_limit
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
    floor = nominal.goodput * (1 - nominal_tolerance) * (1 - FLOAT_NOISE)
    search_end = None if time_limit is None else start + (1 - EVAL_SHARE) * time_limit
    # the bound stops a little earlier, for the search seeded by its domains
    bound_end = None if time_limit is None else start + (1 - EVAL_SHARE - RESEED_SHARE) * time_limit
    return _Run(
        instance,
        blind,
        nominal,
        scenarios,
        Search(instance, scenarios, risk, floor, search_end, cancel),
        seed,
        options.threads,
        cancel,
        end,
        search_end,
        bound_end,
    )


def _bound(run: _Run, ws_bound: bool | None, nominal_bound: float | None) -> None:
    """The bound on the training objective (wait-and-see, domain), the gap and the proof."""
    instance, s, scenarios = run.instance, run.search, run.scenarios
    assert run.plan is not None
    coupled = domain_limit(instance) is not None
    small = len(scenarios.gpus) <= WS_AUTO_SCENARIOS and instance.arrays.n_gpus <= WS_AUTO_GPUS
    ws = wait_and_see_bound(
        instance,
        scenarios,
        deadline=run.bound_end,
        seed=run.seed,
        threads=run.threads,
        known=[
            (run.blind, run.nominal.goodput),
            (run.plan, evaluate(instance, run.plan).goodput),
        ],
        cancel=run.cancel,
        nominal_bound=nominal_bound,
        solve_scenarios=bool(ws_bound) or (not coupled and (run.search_end is not None or small)),
    )
    bound_value = ws.bound
    run.hit = run.hit or ws.limit_hit
    run.metrics.update(
        ws_cap=ws.cap,
        ws_solved=ws.solved,
        ws_proven=ws.proven,
        ws_capped=ws.capped,
        ws_limit=ws.limit_hit,
    )
    if coupled and not run.cancel.is_set():
        bound_value = min(bound_value, _domain_bound(run, ws))
    value = run.value
    # every bound is proven (to the exact planner's tolerance): a bound
    # below the objective is a bug, never hidden
    if bound_value < value * (1 - REL_TOL):
        raise RuntimeError(f"bound {bound_value} on the expected goodput below {value}")
    bound_value = max(bound_value, value)
    # proven when the gap, as Result.gap computes it, is within the tolerance
    run.proven = bound_value - value <= REL_TOL * bound_value
    run.hit = run.hit or s.timed_out
    ws_value = max(ws.bound, value)
    run.metrics.update(
        ws_bound=ws_value,
        ws_gap=(ws_value - value) / ws_value if ws_value > 0 else 0.0,
    )
    run.metrics.update(
        expected_bound=bound_value,
        expected_gap=(bound_value - value) / bound_value if bound_value > 0 else 0.0,
    )
    run.bound_value = bound_value


def _domain_bound(run: _Run, ws: WaitAndSee) -> float:
    """The non-anticipative domain bound, and the search again from its domains."""
    instance, s = run.instance, run.search
    assert run.plan is not None
    best_layout = Layout.from_plan(instance, run.plan)
    na = domain_bound(
        instance,
        run.scenarios,
        ws.scenario_bounds,
        deadline=run.bound_end,
        seed=run.seed,
        threads=run.threads,
        cancel=run.cancel,
        min_nominal=s.min_nominal,
    )
    assert na is not None  # domain_limit said it applies
    # primal: the search again, from the plan moved onto the bound's domains
    moved = relocate(s, best_layout, na.chosen) if na.chosen else None
    reseeded = False
    if moved is not None and moved is not best_layout and not s.expired():
        p1 = s.plan(moved)
        if p1 is not None:
            plan1, value1 = local_search(s, moved, p1, s.score(p1, moved))
            reseeded = True
            if value1 > run.value:
                run.plan, run.value = plan1, value1
                run.metrics["saa_expected_goodput"] = value1
    run.hit = run.hit or na.limit_hit
    run.metrics.update(
        na_bound=max(na.bound, run.value),
        na_domains=na.domains,
        na_options=na.options,
        na_solved=na.solved,
        na_masters=na.masters,
        na_limit=na.limit_hit,
        na_reseeded=reseeded,
        na_power_cap=na.power_cap,
    )
    return na.bound


def _estimate(run: _Run, fresh_samples: int, blast_radius: str, scale: float) -> None:
    """The expected goodput: exact, or on fresh Monte Carlo scenarios (with a 95 % interval)."""
    instance, scenarios = run.instance, run.scenarios
    if scenarios.method == "exact":
        run.metrics.update(
            expected_goodput=run.value,
            expected_method="exact",
            expected_samples=scenarios.samples,
        )
    elif fresh_samples > 0:
        assert run.plan is not None
        fresh = fresh_scenarios(
            instance, fresh_samples, seed=run.seed, blast_radius=blast_radius, scale=scale
        )
        vals = scenario_goodputs(instance, run.plan, fresh, deadline=run.end, cancel=run.cancel)
        run.hit = run.hit or len(vals) < fresh_samples
        mean = float(vals.mean())
        run.metrics.update(expected_goodput=mean, expected_method="mc", expected_samples=len(vals))
        if len(vals) > 1:  # no interval from one scenario (and JSON has no infinity)
            half = Z95 * float(vals.std(ddof=1)) / math.sqrt(len(vals))
            run.metrics.update(expected_ci_low=mean - half, expected_ci_high=mean + half)
