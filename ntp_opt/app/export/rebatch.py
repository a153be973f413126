"""Re-planning for Megatron-LM's single local batch: :func:`equal_batch`."""

from __future__ import annotations

from dataclasses import replace

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.planners.megatron import (
    MegatronError,
    launch_batch,
)
from ntp_opt.rules.power import stage_cap
from ntp_opt.rules.validate import Violation, check, evaluate


def equal_batch(instance: Instance, plan: Plan, *, iterations: int = 50) -> Plan:
    """The same placement with one local batch for every replica, power re-balanced.

    Megatron-LM gives every DP rank the same local batch ``b``. With one ``b``
    the step time is ``b / min_r v_r`` (times the resharding overhead), so the
    goodput ``R b / theta`` no longer depends on ``b`` but only on the slowest
    replica: ``b`` is :func:`ntp_opt.planners.megatron.launch_batch` (``elastic``: the
    largest multiple of ``micro_batch`` up to ``min(max_local_batch, B // R)``;
    ``fixed``: ``B / R``, which must divide, fit and be such a multiple), and the power
    multipliers are re-chosen to maximise the slowest replica's speed: the
    largest target speed (bisection, ``iterations`` steps) whose required
    multipliers -- per stage the smallest ``pi >= 1`` reaching it, within
    ``1 + max_boost`` and every GPU's ``max_power_w`` -- pass the validator's
    rack and site budgets. If that is not better than keeping the plan's
    multipliers, they are kept.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan that passes the validator.
    iterations
        Bisection steps on the target speed.

    Returns
    -------
    Plan
        The plan with equal local batches, metrics from the validator and
        ``policy`` suffixed ``+equal-batch``.

    Raises
    ------
    MegatronError
        When no equal local batch fits.
    ntp_opt.rules.validate.PlanError
        If the plan breaks a rule of the model.
    """
    check(instance, plan)
    job = instance.job
    n = len(plan.replicas)
    if n == 0 or len({r.local_batch for r in plan.replicas}) == 1:
        return plan
    equal = launch_batch(job, n)
    if equal is None:
        raise MegatronError(
            [
                Violation(
                    "megatron-batch",
                    f"the {job.batch_policy} global batch {job.global_batch} cannot be split "
                    f"equally over {n} replicas with at most {job.local_batch_max} each, "
                    f"a multiple of micro_batch {job.micro_batch}",
                )
            ]
        )
    b = equal
    policy = f"{plan.metrics.get('policy', 'plan')}+equal-batch"
    kept = Plan(plan.instance, tuple(replace(r, local_batch=b) for r in plan.replicas), {})
    best = kept.with_metrics(**check(instance, kept).as_metrics())
    alpha = job.power_exponent
    base, cap = _stage_speeds(instance, plan)
    lo = min(min(s) for s in base)  # everyone at pi = 1
    hi = max(
        max(x * c**alpha for x, c in zip(s, cs, strict=True))
        for s, cs in zip(base, cap, strict=True)
    )
    low_plan = _at_speed(instance, plan, b, base, cap, lo)
    if low_plan is not None:
        found = low_plan
        for _ in range(iterations):
            mid = (lo + hi) / 2
            cand = _at_speed(instance, plan, b, base, cap, mid)
            if cand is None:
                hi = mid
            else:
                lo, found = mid, cand
        if found.metrics["goodput"] > best.metrics["goodput"]:
            best = found
    return best.with_metrics(policy=policy)


def _stage_speeds(instance: Instance, plan: Plan) -> tuple[list[list[float]], list[list[float]]]:
    """Per replica and stage: relative speed at ``pi = 1``, largest multiplier its GPUs accept."""
    a = instance.arrays
    job = instance.job
    base: list[list[float]] = []
    cap: list[list[float]] = []
    for rep in plan.replicas:
        base.append([])
        cap.append([])
        for st in rep.stages:
            idx = [a.gpu_index[g] for g in st.gpus]
            base[-1].append(job.tp_factor(rep.tp) * min(float(a.speed[i]) for i in idx))
            cap[-1].append(max(1.0, stage_cap(instance, idx)))
    return base, cap


def _at_speed(
    instance: Instance,
    plan: Plan,
    b: int,
    base: list[list[float]],
    cap: list[list[float]],
    target: float,
) -> Plan | None:
    """``plan`` with local batch ``b`` and every stage at the least power reaching ``target``.

    ``None`` when a stage cannot reach it within its cap or the plan breaks a budget.
    """
    alpha = instance.job.power_exponent
    reps = []
    for r, rep in enumerate(plan.replicas):
        stages = []
        for k, st in enumerate(rep.stages):
            need = max(1.0, (target / base[r][k]) ** (1.0 / alpha)) if base[r][k] > 0 else 1.0
            if need > cap[r][k] * (1 + 1e-12):
                return None
            stages.append(replace(st, power=min(need, cap[r][k])))
        reps.append(replace(rep, local_batch=b, stages=tuple(stages)))
    cand = Plan(plan.instance, tuple(reps), {})
    ev = evaluate(instance, cand)
    return cand.with_metrics(**ev.as_metrics()) if ev.feasible else None
