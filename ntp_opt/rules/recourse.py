"""Recourse: how a running plan reacts to failures (docs/model.md, spec section 4).

:func:`adapt` is the deterministic NTP reaction documented in
``docs/failures.md`` (step 5 only with ``boost=True``):

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
4. Every stage keeps its power multiplier (a refilled stage's is lowered to
   the largest its new GPUs' boards accept, :func:`ntp_opt.rules.power.stage_cap`,
   when it exceeds it). If a rack is over budget, every
   stage with a GPU in such a rack goes back to power 1; if the site is still
   over budget, every stage does; if a budget still fails (possible only when
   a budget is below the GPUs' TDP), the last replicas drop until it holds.
5. Only with ``boost=True`` (default off): the replicas whose degree dropped
   in step 2 raise the power of their stages toward the nominal speed
   ``1 / c`` (never above ``1 + max_boost`` or the stage's board limit,
   never below their current power), the one needing the fewest extra watts
   first, each as far as the remaining rack and site budgets allow (the
   reachable speed is found by bisection) — docs/model.md's "its racks boost".
6. Local batches are re-split exactly with :func:`ntp_opt.rules.goodput.split_batch`
   under the job's policy; under ``fixed`` a set of replicas that cannot carry
   ``B`` pauses the job (empty plan).

The result is feasible for :func:`ntp_opt.model.failures.failed_instance`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.layout import Layout
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules import goodput as gp
from ntp_opt.rules.boost import Stages, boost_stages
from ntp_opt.rules.power import (
    can_boost,
    over_budget,
    rack_and_site_draw,
    stage_cap,
)
from ntp_opt.rules.tolerances import POWER_TOL


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
    """Watts per rack and for the site (:func:`ntp_opt.rules.power.rack_and_site_draw`)."""
    power_of = np.zeros(instance.arrays.n_gpus)
    for g, pw in stages:
        power_of[g] = pw
    return rack_and_site_draw(instance, power_of, alive)


def adapt(
    instance: Instance, plan: Plan, failed_mask: np.ndarray | None, *, boost: bool = False
) -> Plan:
    """The plan after recourse to the failures in ``failed_mask``.

    Parameters
    ----------
    instance
        The instance the plan was made for (before the failures).
    plan
        A feasible plan for ``instance``.
    failed_mask
        Bool per GPU (``instance.arrays`` order): True = failed in the horizon.
    boost
        Let the replicas whose degree dropped boost their racks (step 5 of the
        module docstring) instead of only taking a smaller batch. Default
        ``False``: the documented recourse, which never raises a power.

    Returns
    -------
    Plan
        Feasible for ``failed_instance(instance, failed_mask)``; empty when
        the job pauses. ``metrics`` holds ``goodput``, ``relative_goodput``,
        ``paused``, ``policy="recourse"``, ``dropped`` (replicas that dropped
        out), ``reduced_power`` (the power rule of step 4 fired) and, with
        ``boost``, ``boosted`` (replicas whose power step 5 raised).
    """
    mask = _mask(instance, failed_mask)
    return adapt_indices(instance, plan, mask, Layout.from_plan(instance, plan), boost=boost)


def plan_indices(instance: Instance, plan: Plan) -> list[list[np.ndarray]]:
    """GPU indices of every stage of ``plan`` (per replica, per stage)."""
    return Layout.from_plan(instance, plan).per_replica()


def replica_degree(
    allowed: Sequence[int],
    t_r: int,
    doms: Sequence[int],
    survivors: Sequence[np.ndarray],
    room: Callable[[int], int],
) -> int | None:
    """Step 2: a replica's new degree, or ``None`` when it drops out.

    Parameters
    ----------
    allowed
        The job's allowed degrees, ascending.
    t_r
        The replica's degree in the plan.
    doms
        Per stage: its domain index.
    survivors
        Per stage: the GPU indices of its GPUs that did not fail.
    room
        GPUs in a domain's pool (by domain index).

    Returns
    -------
    int or None
        The largest allowed ``t <= t_r`` whose refills
        (``sum_k max(0, t - survivors_k)`` per domain) fit the pools.
    """
    for t in reversed(allowed):
        if t > t_r:
            continue
        need: dict[int, int] = {}
        for d, s in zip(doms, survivors, strict=True):
            need[d] = need.get(d, 0) + max(0, t - len(s))
        if all(n <= room(d) for d, n in need.items()):
            return t
    return None


def stage_after(
    speed: np.ndarray, survivors: np.ndarray, t: int, pool: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Step 3: a stage's GPUs at degree ``t``.

    Parameters
    ----------
    speed
        Per GPU index: its speed.
    survivors
        The stage's GPU indices that did not fail.
    t
        The replica's new degree (:func:`replica_degree`).
    pool
        The stage's domain's pool, fastest first.

    Returns
    -------
    tuple of (numpy.ndarray, numpy.ndarray, int)
        The stage's GPUs (its ``t`` fastest survivors in speed order, ties in
        stage order, or all survivors then the pool's first ones), the survivors
        it returns to the pool, and how many GPUs it takes from the pool's front.
    """
    if len(survivors) >= t:
        order = np.argsort(-speed[survivors], kind="stable")  # fastest first, stage order
        return survivors[order[:t]], survivors[order[t:]], 0
    take = t - len(survivors)
    refill = np.asarray(pool[:take], dtype=np.int64)
    return np.concatenate([survivors, refill]), np.empty(0, dtype=np.int64), take


class Kept(NamedTuple):
    """A replica that survives recourse (steps 2-5), in index space.

    Attributes
    ----------
    degree
        Its new TP degree.
    gpus
        Per stage: its GPU indices.
    powers
        Per stage: its power multiplier (changed in place by steps 4 and 5).
    source
        Its replica's index in the plan.
    """

    degree: int
    gpus: list[np.ndarray]
    powers: list[float]
    source: int


class SparePools:
    """Per domain, its free healthy GPUs (indices), fastest first, then in index order.

    A domain's pool is listed on first use; GPUs return with :meth:`give_back`
    and leave from the front with :meth:`take`.
    """

    def __init__(self, instance: Instance, alive: np.ndarray, used: np.ndarray) -> None:
        self._arrays = instance.arrays
        self._alive = alive
        self._used = used
        self._pools: dict[int, list[int]] = {}

    def _sorted(self, items: list[int]) -> list[int]:
        speed = self._arrays.speed
        return sorted(items, key=lambda i: (-float(speed[i]), i))

    def get(self, d: int) -> list[int]:
        """Domain ``d``'s pool."""
        if d not in self._pools:
            members = self._arrays.domain_gpus[d]
            free = members[self._alive[members] & ~self._used[members]]
            self._pools[d] = self._sorted([int(i) for i in free])
        return self._pools[d]

    def size(self, d: int) -> int:
        """How many GPUs domain ``d``'s pool holds."""
        return len(self.get(d))

    def give_back(self, d: int, gpus: np.ndarray) -> None:
        """Return ``gpus`` to domain ``d``'s pool."""
        self._pools[d] = self._sorted(self.get(d) + [int(i) for i in gpus])

    def take(self, d: int, n: int) -> None:
        """Remove the first ``n`` GPUs of domain ``d``'s pool."""
        self._pools[d] = self.get(d)[n:]


def adapt_replica(
    instance: Instance,
    pools: SparePools,
    t_r: int,
    doms: list[int],
    survivors: list[np.ndarray],
    powers: list[float],
) -> tuple[int, list[np.ndarray], list[float]] | None:
    """Recourse steps 2-3 for one replica that lost GPUs (updates ``pools``).

    Parameters
    ----------
    instance
        The instance.
    pools
        The domains' spare GPUs; GPUs the replica gives back or takes move.
    t_r
        The replica's degree before the failures.
    doms
        Its stages' domain indices.
    survivors
        Per stage, its GPUs that are still healthy.
    powers
        Per stage, its power multiplier (lowered in place where a refill brings
        a lower board limit).

    Returns
    -------
    tuple or None
        ``(degree, stage GPUs, powers)``, or ``None`` when no allowed degree
        fits (the survivors then went back to their pools).
    """
    speed = instance.arrays.speed
    t_new = replica_degree(instance.job.allowed, t_r, doms, survivors, pools.size)
    if t_new is None:
        for d, s in zip(doms, survivors, strict=True):
            pools.give_back(d, s)
        return None
    out = []
    for k, (d, s) in enumerate(zip(doms, survivors, strict=True)):
        stage, back, take = stage_after(speed, s, t_new, pools.get(d))
        out.append(stage)
        if len(back):
            pools.give_back(d, back)
        if take:
            pools.take(d, take)
            cap = stage_cap(instance, stage)  # a refill may bring a lower board limit
            if powers[k] > cap * (1 + POWER_TOL):
                powers[k] = cap
    return t_new, out, powers


def adapt_indices(
    instance: Instance,
    plan: Plan,
    mask: np.ndarray,
    layout: Layout,
    *,
    boost: bool = False,
) -> Plan:
    """:func:`adapt` with the plan's layout precomputed.

    Parameters
    ----------
    instance, plan, boost
        As for :func:`adapt`.
    mask
        Boolean per GPU index: the GPUs that fail.
    layout
        ``Layout.from_plan(instance, plan)`` (computed once when many masks
        are tried on one plan).

    Returns
    -------
    Plan
        The adapted plan (feasible; possibly empty).
    """
    job = instance.job
    alive = instance.arrays.healthy & ~mask
    reps = layout.per_replica()
    new_reps, reduced, dropped = _survivors(instance, layout, reps, alive)
    reduced_power, more = _power_rule(instance, alive, new_reps)
    boosted = _boost(instance, alive, new_reps, reduced) if boost else 0
    replicas, value = _rebatched(instance, plan, reps, new_reps)
    return Plan(
        plan.instance,
        replicas,
        {
            "policy": "recourse",
            "paused": not replicas,
            "goodput": value,
            "relative_goodput": gp.relative_goodput(job, value),
            "dropped": dropped + more,
            "reduced_power": reduced_power,
            **({"boosted": boosted} if boost else {}),
        },
    )


def _survivors(
    instance: Instance, layout: Layout, reps: list[list[np.ndarray]], alive: np.ndarray
) -> tuple[list[Kept], set[int], int]:
    """Steps 2-3: the replicas that survive, the plan indices of those whose degree
    dropped, and how many replicas dropped out."""
    used = np.zeros(instance.arrays.n_gpus, dtype=bool)
    used[layout.gpus] = True
    doms_of = layout.domain.tolist()
    powers_of = layout.power.tolist()
    pools = SparePools(instance, alive, used)
    new_reps: list[Kept] = []
    reduced: set[int] = set()  # plan indices of the replicas whose degree dropped
    dropped = 0
    first = 0  # flat index of replica r's first stage
    for r, (t_r, stages) in enumerate(zip(layout.degree.tolist(), reps, strict=True)):
        doms = doms_of[first : first + len(stages)]
        pws = powers_of[first : first + len(stages)]
        first += len(stages)
        survivors = [g[alive[g]] for g in stages]
        if all(len(s) == t_r for s in survivors):
            new_reps.append(Kept(t_r, survivors, pws, r))
            continue
        adapted = adapt_replica(instance, pools, t_r, doms, survivors, pws)
        if adapted is None:
            dropped += 1
            continue
        new_reps.append(Kept(*adapted, r))
        reduced.add(r)
    return new_reps, reduced, dropped


def _flat(new_reps: list[Kept]) -> list[tuple[np.ndarray, float]]:
    """Every stage of the kept replicas: its GPUs and multiplier."""
    return [(g, pw) for kept in new_reps for g, pw in zip(kept.gpus, kept.powers, strict=True)]


def _power_rule(instance: Instance, alive: np.ndarray, new_reps: list[Kept]) -> tuple[bool, int]:
    """Step 4 (changes ``new_reps`` in place): whether the power rule fired, and how
    many replicas it dropped."""
    a = instance.arrays
    reduced_power = False
    dropped = 0
    racks_over, site_over = over_budget(instance, *_draw(instance, alive, _flat(new_reps)))
    if racks_over.any():
        reduced_power = True
        for kept in new_reps:
            for k, g in enumerate(kept.gpus):
                if racks_over[a.gpu_rack[g]].any():
                    kept.powers[k] = 1.0
        racks_over, site_over = over_budget(instance, *_draw(instance, alive, _flat(new_reps)))
    if site_over:
        reduced_power = True
        for kept in new_reps:
            kept.powers[:] = [1.0] * len(kept.powers)
        racks_over, site_over = over_budget(instance, *_draw(instance, alive, _flat(new_reps)))
    while new_reps and (racks_over.any() or site_over):
        reduced_power = True
        new_reps.pop()
        dropped += 1
        racks_over, site_over = over_budget(instance, *_draw(instance, alive, _flat(new_reps)))
    return reduced_power, dropped


def _kept_speed(instance: Instance, kept: Kept) -> float:
    """A kept replica's speed (:func:`ntp_opt.rules.goodput.replica_speed`)."""
    speed = instance.arrays.speed
    t, gs, pws, _ = kept
    return gp.replica_speed(instance.job, t, [float(speed[g].min()) for g in gs], pws)


def _rebatched(
    instance: Instance, plan: Plan, reps: list[list[np.ndarray]], new_reps: list[Kept]
) -> tuple[tuple[Replica, ...], float]:
    """Step 6: the kept replicas with their batches (stages that did not change are
    the plan's own), and the goodput; no replicas when no split is feasible."""
    a = instance.arrays
    job = instance.job
    tps = [kept.degree for kept in new_reps]
    speeds = [_kept_speed(instance, kept) for kept in new_reps]
    split = gp.split_batch(job, speeds, tps)
    if split is None or not new_reps:
        return (), 0.0
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
    return replicas, gp.goodput(job, tps, list(split.batches), speeds)


def _boost(instance: Instance, alive: np.ndarray, new_reps: list[Kept], reduced: set[int]) -> int:
    """Step 5: raise the power of reduced replicas toward nominal speed; count them.

    :func:`ntp_opt.rules.boost.boost_stages` with 60 bisection steps.
    """
    a = instance.arrays
    job = instance.job
    if not can_boost(instance):
        return 0
    rack_draw, site_draw = _draw(instance, alive, _flat(new_reps))
    rack_room = a.rack_budget - rack_draw
    site_room = a.site_budget - site_draw
    target = 1.0 / job.seq_time_s
    slow = [
        i
        for i, kept in enumerate(new_reps)
        if kept.source in reduced and _kept_speed(instance, kept) < target
    ]
    stages = Stages.from_lists([gs for _, gs, _, _ in new_reps])
    tp = np.array([t for t, _, _, _ in new_reps], dtype=np.int64)
    powers = np.array([float(x) for _, _, pws, _ in new_reps for x in pws], dtype=float)
    out, boosted = boost_stages(instance, stages, tp, powers, slow, rack_room, site_room, steps=60)
    cuts = np.searchsorted(stages.replica, np.arange(len(new_reps) + 1)).tolist()
    new_powers = out.tolist()
    for i in boosted:
        new_reps[i].powers[:] = new_powers[cuts[i] : cuts[i + 1]]
    return len(boosted)


def goodput_after(instance: Instance, plan: Plan, failed_mask: np.ndarray | None) -> float:
    """Goodput (sequences per second) of ``plan`` after recourse to ``failed_mask``."""
    return float(adapt(instance, plan, failed_mask).metrics["goodput"])
