"""The independent validator: every rule of docs/model.md, spec section 3, and goodput.

:func:`validate` lists every violated rule with a message that names the
replica, stage, GPU or rack (the checks and their :class:`Violation` records:
:mod:`ntp_opt.rules.violations`); :func:`evaluate` recomputes goodput from the
instance and the plan alone, :func:`evaluate_layout` the same from a plan's
index arrays. Planners never bypass them: every plan that leaves the package
went through :func:`check`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan
from ntp_opt.rules import goodput as gp
from ntp_opt.rules.power import board_over, over_budget, rack_and_site_draw, redraw
from ntp_opt.rules.tolerances import POWER_TOL
from ntp_opt.rules.violations import (
    Violation,
    batch_sum_violations,
    board_violations,
    budget_violations,
    metrics_violations,
    plan_violations,
)

__all__ = [
    "Certifiable",
    "Evaluation",
    "Judgement",
    "PlanError",
    "Violation",
    "certified",
    "certify",
    "check",
    "checked",
    "evaluate",
    "evaluate_layout",
    "infeasibility",
    "layout_speeds",
    "pause_reason",
    "stage_slowest",
    "validate",
]


class PlanError(ValueError):
    """A plan broke rules of the model; ``violations`` lists them all."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        head = "; ".join(str(v) for v in violations[:5])
        more = f" (and {len(violations) - 5} more)" if len(violations) > 5 else ""
        super().__init__(f"infeasible plan: {head}{more}")


@dataclass(frozen=True)
class Evaluation:
    """Figures of a plan, recomputed from the instance and the plan alone.

    Attributes
    ----------
    feasible
        No rule is broken.
    violations
        The broken rules.
    goodput
        Sequences per second (the formula's value even for an infeasible
        plan: check ``feasible``).
    relative_goodput
        ``goodput * c / R``: 1.0 for the same job with no failures.
    step_time
        ``theta`` in seconds (``inf`` for an empty plan).
    total_batch
        ``sum_r b_r``.
    replica_speeds
        ``v_r`` for every replica, sequences per second.
    n_replicas, n_reduced
        Replicas, and replicas below the nominal TP degree.
    gpus_used
        GPUs in some stage.
    site_power_w
        Site draw in watts; ``rack_power_w`` per rack, in rack order.
    """

    feasible: bool
    violations: tuple[Violation, ...]
    goodput: float
    relative_goodput: float
    step_time: float
    total_batch: int
    replica_speeds: tuple[float, ...]
    n_replicas: int
    n_reduced: int
    gpus_used: int
    site_power_w: float
    rack_power_w: tuple[float, ...]

    def as_metrics(self) -> dict[str, float | int]:
        """The figures a plan file stores under ``metrics``."""
        return {
            "goodput": self.goodput,
            "relative_goodput": self.relative_goodput,
            "step_time_s": self.step_time if math.isfinite(self.step_time) else -1.0,
            "replicas": self.n_replicas,
            "reduced_replicas": self.n_reduced,
            "gpus_used": self.gpus_used,
            "site_power_w": self.site_power_w,
        }


def evaluate(instance: Instance, plan: Plan) -> Evaluation:
    """Recompute a plan's figures and check every rule.

    Parameters
    ----------
    instance
        The instance.
    plan
        The plan to evaluate; its ``metrics`` are checked, never used.

    Returns
    -------
    Evaluation
    """
    job = instance.job
    violations, speeds, power_of, lay, first = plan_violations(instance, plan)
    violations += board_violations(instance, lay, first, power_of)
    rack_w, site_w = rack_and_site_draw(instance, power_of)
    violations += budget_violations(instance, rack_w, site_w)
    tps = [rep.tp for rep in plan.replicas]
    batches = [int(rep.local_batch) for rep in plan.replicas]
    theta = gp.step_time(job, tps, batches, speeds)
    value = gp.goodput_at(batches, theta)
    violations += metrics_violations(plan, value)
    return Evaluation(
        feasible=not violations,
        violations=tuple(violations),
        goodput=value,
        relative_goodput=gp.relative_goodput(job, value),
        step_time=theta,
        total_batch=sum(batches),
        replica_speeds=tuple(speeds),
        n_replicas=len(plan.replicas),
        n_reduced=sum(1 for t in tps if t < job.tp),
        gpus_used=int((power_of > 0).sum()),
        site_power_w=site_w,
        rack_power_w=tuple(rack_w.tolist()),
    )


def stage_slowest(
    instance: Instance, layout: Layout, memo: dict[Any, Any] | None = None
) -> np.ndarray:
    """Per stage of a strict layout, the speed of its slowest GPU.

    Parameters
    ----------
    instance, layout
        The instance and the layout (every stage has a GPU).
    memo
        A dict kept by the caller (a re-planning chain's): the last result is
        kept in it with the speed, GPU and offset arrays it was read from, and
        returned again while the same three arrays (the same objects, which
        re-planning never changes in place) are asked for. The same result
        without it.
    """
    speed, gpus, offsets = instance.arrays.speed, layout.gpus, layout.offsets
    kept = None if memo is None else memo.get("slowest")
    if kept is not None and kept[0] is speed and kept[1] is gpus and kept[2] is offsets:
        out: np.ndarray = kept[3]
        return out
    out = np.minimum.reduceat(speed[gpus], offsets[:-1])
    if memo is not None:
        memo["slowest"] = (speed, gpus, offsets, out)
    return out


def layout_speeds(
    instance: Instance,
    layout: Layout,
    *,
    powers: np.ndarray | None = None,
    slowest: np.ndarray | None = None,
    memo: dict[Any, Any] | None = None,
) -> np.ndarray:
    """Per replica of a strict layout, :func:`ntp_opt.rules.goodput.replica_speed`, vectorised.

    Bit for bit the per-replica function: the same products ``pi ** alpha *
    slowest`` (numpy's power is the C library's, as Python's), the exact
    minimum per replica, then ``f(t) * slowest / c``. Every stage must have a
    GPU and every replica a stage.

    Parameters
    ----------
    instance, layout
        The instance and the layout.
    powers
        Multiplier per stage instead of ``layout.power`` (re-boosting tries
        several on the same stages).
    slowest
        Per stage, the speed of its slowest GPU, when known (the same for
        every ``powers``).
    memo
        Where :func:`stage_slowest` keeps its last result, when ``slowest``
        is not given.
    """
    job = instance.job
    if layout.n_replicas == 0:
        return np.zeros(0)
    if slowest is None:
        slowest = stage_slowest(instance, layout, memo)
    pw = layout.power if powers is None else powers
    per_stage = pw**job.power_exponent * slowest
    first = np.searchsorted(layout.replica, np.arange(layout.n_replicas))
    low = np.minimum.reduceat(per_stage, first)
    out: np.ndarray = _degree_factors(job, layout.degree) * low / job.seq_time_s
    return out


def _degree_factors(job: Job, degree: np.ndarray) -> np.ndarray:
    """``job.tp_factor(t)`` per entry of ``degree`` (each degree's factor computed once)."""
    degs = degree.tolist()
    kinds = set(degs)
    if len(kinds) == 1:  # one degree: one factor for all
        return np.full(len(degs), job.tp_factor(kinds.pop()), dtype=float)
    factors = {t: job.tp_factor(t) for t in kinds}
    return np.array([factors[t] for t in degs], dtype=float)


def evaluate_layout(
    instance: Instance, plan: Plan, layout: Layout, memo: dict[Any, Any] | None = None
) -> Evaluation:
    """:func:`evaluate` of ``plan`` from its strict layout, on index arrays only.

    The re-planning path: ``layout`` is ``Layout.from_plan(instance, plan)``
    (or the layout the plan was written from), so node ids are never looked
    up. Every rule is checked at once on the arrays (degrees, batches, stage
    counts and sizes, power ranges and boards, failed, foreign and reused
    GPUs, the batch sum, every rack and the site); only when one is broken
    does the full :func:`evaluate` run, for its messages. The figures are
    bit for bit :func:`evaluate`'s (tests compare them).

    Parameters
    ----------
    instance
        The instance.
    plan
        The plan (its ``metrics`` are checked; its stages are read only on
        the fall-back).
    layout
        The plan's strict layout.
    memo
        A re-planning chain's memo: the stages' slowest speeds are read
        from it when the same arrays were read before
        (:func:`stage_slowest`), and the power draw of the last check that
        passed is kept in it: the next check draws again only the GPUs
        whose multiplier or health changed, and checks health and boards
        there only (:func:`ntp_opt.rules.power.redraw`; elsewhere a GPU
        runs as in a check that passed). The same figures and violations
        without it.

    Returns
    -------
    Evaluation
    """
    job = instance.job
    a = instance.arrays
    g = layout.gpus
    power_of = _layout_power(instance, plan, layout)
    if power_of is None:
        return evaluate(instance, plan)
    last = None if memo is None else memo.get("drawn")
    drawn, changed = redraw(instance, power_of, last)
    # where a GPU's multiplier and health are those of the last check, which
    # passed, it is healthy if used and within its board's limit
    at = None if changed is None else changed[power_of[changed] > 0]
    if not (a.healthy[g] if at is None else a.healthy[at]).all() or batch_sum_violations(
        instance, plan
    ):
        return evaluate(instance, plan)
    rack_w, site_w = drawn.rack, drawn.site
    racks_over, site_over = over_budget(instance, rack_w, site_w)
    if racks_over.any() or site_over or board_over(instance, power_of, at=at).any():
        return evaluate(instance, plan)
    speeds = layout_speeds(instance, layout, memo=memo).tolist()
    tps = layout.degree.tolist()
    batches = layout.batch.tolist()
    theta = gp.step_time(job, tps, batches, speeds)
    value = gp.goodput_at(batches, theta)
    if metrics_violations(plan, value):
        return evaluate(instance, plan)
    if memo is not None:
        memo["drawn"] = drawn  # passed: the next check starts from it
    return Evaluation(
        feasible=True,
        violations=(),
        goodput=value,
        relative_goodput=gp.relative_goodput(job, value),
        step_time=theta,
        total_batch=sum(batches),
        replica_speeds=tuple(speeds),
        n_replicas=layout.n_replicas,
        n_reduced=sum(1 for t in tps if t < job.tp),
        gpus_used=int(g.size),  # each listed once, at a multiplier > 0
        site_power_w=site_w,
        rack_power_w=tuple(rack_w.tolist()),
    )


def _layout_power(instance: Instance, plan: Plan, lay: Layout) -> np.ndarray | None:
    """Per GPU its stage's multiplier (0: unused) when the layout's arrays break no rule
    of the plan, its replicas and stages (health, boards and budgets aside), else ``None``."""
    job = instance.job
    a = instance.arrays
    n_rep = lay.n_replicas
    if (
        plan.instance != instance.name
        or n_rep != len(plan.replicas)
        or n_rep > job.replicas_max
        or not all(type(rep.local_batch) is int for rep in plan.replicas)
    ):
        return None
    deg, batch = lay.degree, lay.batch
    sizes = np.diff(lay.offsets)
    hi_power = 1.0 + job.max_boost
    pw = lay.power
    g = lay.gpus
    with np.errstate(invalid="ignore"):
        fine = (
            _allowed(job, deg)
            and bool(((batch >= 1) & (batch <= job.local_batch_max)).all())
            and bool((np.bincount(lay.replica, minlength=n_rep) == job.pp).all())
            and bool((sizes == deg[lay.replica]).all())
            and bool(
                (
                    np.isfinite(pw) & (pw >= 1.0 - POWER_TOL) & (pw <= hi_power * (1 + POWER_TOL))
                ).all()
            )
        )
    power_of = np.zeros(a.n_gpus, dtype=float)
    if fine and g.size:
        fine = int(g.min()) >= 0 and int(g.max()) < a.n_gpus
        if fine:
            power_of[g] = np.repeat(pw, sizes)
            # every multiplier is > 0 (checked above): fewer GPUs drawing than
            # listed means a GPU is in two stages
            fine = int(np.count_nonzero(power_of)) == g.size and bool(
                (a.gpu_domain[g] == np.repeat(lay.domain, sizes)).all()
            )
    return power_of if fine else None


def _allowed(job: Job, degree: np.ndarray) -> bool:
    """Is every entry of ``degree`` an allowed degree (``numpy.isin``, by a table)?"""
    if degree.size == 0:
        return True
    lo, hi = int(degree.min()), int(degree.max())
    if lo < 0 or hi > job.tp:
        return False
    table = np.zeros(job.tp + 1, dtype=bool)
    table[list(job.allowed)] = True
    return bool(table[degree].all())


def validate(instance: Instance, plan: Plan) -> list[Violation]:
    """Every rule of docs/model.md, spec section 3 that ``plan`` breaks (empty if feasible).

    Parameters
    ----------
    instance
        The instance.
    plan
        The plan.

    Returns
    -------
    list of Violation
    """
    return list(evaluate(instance, plan).violations)


class Judgement(Protocol):
    """What an evaluation offers :func:`checked`: feasibility, violations, metrics."""

    @property
    def feasible(self) -> bool:
        """No rule is broken."""

    @property
    def violations(self) -> tuple[Violation, ...]:
        """The broken rules."""

    def as_metrics(self) -> dict[str, float | int]:
        """The figures a plan stores under ``metrics``."""


class Certifiable(Protocol):
    """A plan that can take the validator's figures as its metrics."""

    def with_metrics(self: _P, **metrics: Any) -> _P:
        """A copy with ``metrics`` merged into the existing ones."""


_I = TypeVar("_I")
_P = TypeVar("_P", bound=Certifiable)
_E = TypeVar("_E", bound=Judgement)


def checked(evaluator: Callable[[_I, _P], _E], instance: _I, plan: _P) -> _E:
    """``evaluator(instance, plan)``, raising :class:`PlanError` if it breaks any rule.

    The one check behind :func:`check` and the multi-workload
    ``check_multi``.

    Parameters
    ----------
    evaluator
        Recomputes the plan's figures and lists its violations
        (:func:`evaluate`, ``evaluate_multi``).
    instance, plan
        Passed to ``evaluator``.

    Returns
    -------
    The evaluation, feasible.

    Raises
    ------
    PlanError
        Listing every violation.
    """
    ev = evaluator(instance, plan)
    if not ev.feasible:
        raise PlanError(list(ev.violations))
    return ev


def certify(evaluator: Callable[[_I, _P], _E], instance: _I, plan: _P) -> _P:
    """``plan`` checked by :func:`checked`, with the evaluation's figures as its metrics.

    The one certification behind :func:`certified` and ``certified_multi``.

    Parameters
    ----------
    evaluator, instance, plan
        As for :func:`checked`.

    Returns
    -------
    The plan with the recomputed figures merged into its ``metrics``.
    """
    return plan.with_metrics(**checked(evaluator, instance, plan).as_metrics())


def check(instance: Instance, plan: Plan) -> Evaluation:
    """Evaluate ``plan`` and raise :class:`PlanError` if it breaks any rule."""
    return checked(evaluate, instance, plan)


def certified(instance: Instance, plan: Plan) -> Plan:
    """``plan`` checked by :func:`check`, with the validator's figures as its metrics."""
    return certify(evaluate, instance, plan)


def infeasibility(instance: Instance) -> str | None:
    """Why no plan at all is feasible, or ``None`` when the paused job is.

    The paused job (no replicas) breaks a rule only when the idle draw of the
    healthy GPUs alone exceeds a rack or site power budget.
    """
    ev = evaluate(instance, Plan(instance.name, ()))
    if ev.feasible:
        return None
    return "no feasible plan, not even the paused job: " + "; ".join(
        v.message for v in ev.violations
    )


def pause_reason(instance: Instance, proven: bool) -> str:
    """Why a planner returned the paused job (no replicas), for :class:`Result`."""
    job = instance.job
    a = instance.arrays
    healthy = a.healthy_in_domain()
    stages = int(sum(int(h) // job.min_tp for h in healthy))
    if stages < job.pp:
        why = (
            f"the healthy GPUs of the domains hold only {stages} stage(s) of degree "
            f">= tp_min={job.min_tp}; a replica needs pp={job.pp}"
        )
    elif job.batch_policy == "fixed" and job.replicas_max * job.local_batch_max < (
        job.global_batch
    ):
        why = (
            f"dp_max={job.replicas_max} replicas of at most {job.local_batch_max} sequences "
            f"cannot carry global_batch={job.global_batch}"
        )
    elif job.batch_policy == "fixed":
        why = (
            f"no set of replicas that fits the cluster and the power budgets carries "
            f"global_batch={job.global_batch} (fixed policy)"
        )
    else:
        why = "no replica fits the cluster and the power budgets"
    return f"paused: {why}" + (" (proven)" if proven else "")
