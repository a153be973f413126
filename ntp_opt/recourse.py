"""Recourse: how a running plan reacts to failures (MODEL.md section 4).

:func:`adapt` is the deterministic NTP reaction documented in
``docs/failures.md``:

1. GPUs of the plan that failed leave their stages. The *pool* of a domain is
   its healthy, non-failed GPUs that no stage of the plan uses, fastest first
   (ties in graph order).
2. Replicas are processed in plan order. A replica's new degree is the
   largest allowed degree ``t <= t_r`` such that, for every domain it uses,
   the refills its stages need (``sum_k max(0, t - survivors_k)``) fit in that
   domain's pool. No such degree (below ``tp_min``): the replica drops out
   and its surviving GPUs return to their pools for later replicas.
3. A stage with more survivors than ``t`` keeps its ``t`` fastest (ties in
   stage order) and returns the others to the pool; a stage with fewer takes
   the first GPUs of its domain's pool.
4. Every stage keeps its power multiplier. If a rack is over budget, every
   stage with a GPU in such a rack goes back to power 1; if the site is still
   over budget, every stage does; if a budget still fails (possible only when
   a budget is below the GPUs' TDP), the last replicas drop until it holds.
5. Local batches are re-split exactly with :func:`ntp_opt.goodput.split_batch`
   under the job's policy; under ``fixed`` a set of replicas that cannot carry
   ``B`` pauses the job (empty plan).

The result is feasible for :func:`ntp_opt.failures.failed_instance`.
"""

from __future__ import annotations

import numpy as np

from . import goodput as gp
from .instance import Instance
from .plan import Plan, Replica, Stage
from .validate import POWER_TOL


def _mask(instance: Instance, failed_mask: np.ndarray | None) -> np.ndarray:
    n = instance.arrays.n_gpus
    if failed_mask is None:
        return np.zeros(n, dtype=bool)
    mask = np.asarray(failed_mask, dtype=bool)
    if mask.shape != (n,):
        raise ValueError(f"failed_mask must have shape ({n},), got {mask.shape}")
    return mask


def _draw(
    instance: Instance, alive: np.ndarray, stages: list[tuple[np.ndarray, float]]
) -> tuple[np.ndarray, float]:
    """Watts per rack and for the site."""
    a = instance.arrays
    per = np.where(alive, instance.job.idle_power_fraction, 0.0)
    for g, pw in stages:
        per[g] = pw
    per = per * a.tdp
    return np.bincount(a.gpu_rack, weights=per, minlength=len(a.rack_ids)), float(per.sum())


def _over(instance: Instance, rack: np.ndarray, site: float) -> tuple[np.ndarray, bool]:
    a = instance.arrays
    # The validator's tolerance: plans it accepts (the exact planner's boosts
    # may sit ~1e-10 above a budget) are not "over budget" here either.
    racks = rack > a.rack_budget * (1 + POWER_TOL) + 1e-9
    return racks, bool(site > a.site_budget * (1 + POWER_TOL) + 1e-9)


def adapt(instance: Instance, plan: Plan, failed_mask: np.ndarray | None) -> Plan:
    """The plan after recourse to the failures in ``failed_mask``.

    Parameters
    ----------
    instance
        The instance the plan was made for (before the failures).
    plan
        A feasible plan for ``instance``.
    failed_mask
        Bool per GPU (``instance.arrays`` order): True = failed in the horizon.

    Returns
    -------
    Plan
        Feasible for ``failed_instance(instance, failed_mask)``; empty when
        the job pauses. ``metrics`` holds ``goodput``, ``relative_goodput``,
        ``paused``, ``policy="recourse"``, ``dropped`` (replicas that dropped
        out), ``reduced_power`` (the power rule of step 4 fired).
    """
    return _adapt(instance, plan, _mask(instance, failed_mask), plan_indices(instance, plan))


def plan_indices(instance: Instance, plan: Plan) -> list[list[np.ndarray]]:
    """GPU indices of every stage of ``plan`` (per replica, per stage)."""
    index = instance.arrays.gpu_index
    return [
        [np.array([index[g] for g in st.gpus], dtype=np.int64) for st in rep.stages]
        for rep in plan.replicas
    ]


def _adapt(instance: Instance, plan: Plan, mask: np.ndarray, reps: list[list[np.ndarray]]) -> Plan:
    """:func:`adapt` with the plan's stage indices precomputed."""
    a = instance.arrays
    job = instance.job
    alive = a.healthy & ~mask
    speed = a.speed
    used = np.zeros(a.n_gpus, dtype=bool)
    for stages in reps:
        for g in stages:
            used[g] = True
    # pools: per domain, list of free alive GPU indices, fastest first, graph order
    pools: dict[int, list[int]] = {}

    def sort_pool(items: list[int]) -> list[int]:
        return sorted(items, key=lambda i: (-float(speed[i]), i))

    def pool(d: int) -> list[int]:
        if d not in pools:
            members = a.domain_gpus[d]
            free = members[alive[members] & ~used[members]]
            pools[d] = sort_pool([int(i) for i in free])
        return pools[d]

    new_reps: list[tuple[int, list[np.ndarray], list[float], int]] = []  # (t, gpus, powers, r)
    dropped = 0
    for r, (rep, stages) in enumerate(zip(plan.replicas, reps, strict=True)):
        doms = [a.domain_index[st.domain] for st in rep.stages]
        survivors = [g[alive[g]] for g in stages]
        if all(len(s) == rep.tp for s in survivors):
            new_reps.append((rep.tp, survivors, [float(st.power) for st in rep.stages], r))
            continue
        t_new = None
        for t in reversed(job.allowed):
            if t > rep.tp:
                continue
            need: dict[int, int] = {}
            for d, s in zip(doms, survivors, strict=True):
                need[d] = need.get(d, 0) + max(0, t - len(s))
            if all(n <= len(pool(d)) for d, n in need.items()):
                t_new = t
                break
        if t_new is None:
            dropped += 1
            for d, s in zip(doms, survivors, strict=True):
                pools[d] = sort_pool(pool(d) + [int(i) for i in s])
            continue
        out = []
        for d, s in zip(doms, survivors, strict=True):
            if len(s) >= t_new:
                order = np.argsort(-speed[s], kind="stable")  # fastest first, stage order
                keep = s[order[:t_new]]
                back = [int(i) for i in s[order[t_new:]]]
                if back:
                    pools[d] = sort_pool(pool(d) + back)
                out.append(keep)
            else:
                p = pool(d)
                take = t_new - len(s)
                out.append(np.concatenate([s, np.array(p[:take], dtype=np.int64)]))
                pools[d] = p[take:]
        new_reps.append((t_new, out, [float(st.power) for st in rep.stages], r))

    # power (step 4)
    reduced_power = False

    def flat() -> list[tuple[np.ndarray, float]]:
        return [(g, pw) for _, gs, pws, _ in new_reps for g, pw in zip(gs, pws, strict=True)]

    racks_over, site_over = _over(instance, *_draw(instance, alive, flat()))
    if racks_over.any():
        reduced_power = True
        for _, gs, pws, _ in new_reps:
            for k, g in enumerate(gs):
                if racks_over[a.gpu_rack[g]].any():
                    pws[k] = 1.0
        racks_over, site_over = _over(instance, *_draw(instance, alive, flat()))
    if site_over:
        reduced_power = True
        for _, _, pws, _ in new_reps:
            pws[:] = [1.0] * len(pws)
        racks_over, site_over = _over(instance, *_draw(instance, alive, flat()))
    while new_reps and (racks_over.any() or site_over):
        reduced_power = True
        new_reps.pop()
        dropped += 1
        racks_over, site_over = _over(instance, *_draw(instance, alive, flat()))

    # batches (step 5)
    tps = [t for t, _, _, _ in new_reps]
    speeds = [
        gp.replica_speed(job, t, [float(speed[g].min()) for g in gs], pws)
        for t, gs, pws, _ in new_reps
    ]
    split = gp.split_batch(job, speeds, tps)
    replicas: tuple[Replica, ...] = ()
    if split is not None and new_reps:
        replicas = tuple(
            Replica(
                tp=t,
                local_batch=int(b),
                stages=tuple(
                    st
                    if pw == st.power and np.array_equal(g, g0)  # unchanged: reuse
                    else Stage(domain=st.domain, gpus=tuple(a.gpu_ids[i] for i in g), power=pw)
                    for st, g, g0, pw in zip(plan.replicas[r].stages, gs, reps[r], pws, strict=True)
                ),
            )
            for (t, gs, pws, r), b in zip(new_reps, split.batches, strict=True)
        )
        value = gp.goodput(job, tps, list(split.batches), speeds)
    else:
        value = 0.0
    return Plan(
        plan.instance,
        replicas,
        {
            "policy": "recourse",
            "paused": not replicas,
            "goodput": value,
            "relative_goodput": gp.relative_goodput(job, value),
            "dropped": dropped,
            "reduced_power": reduced_power,
        },
    )


def goodput_after(instance: Instance, plan: Plan, failed_mask: np.ndarray | None) -> float:
    """Goodput (sequences per second) of ``plan`` after recourse to ``failed_mask``."""
    return float(adapt(instance, plan, failed_mask).metrics["goodput"])
