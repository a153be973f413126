"""Baseline planners of docs/model.md, spec section 5: ``dp-drop``, ``ntp`` and ``ntp-pw``.

All three cut every domain into *slots* (candidate stages), pack the slots
into replicas and split the batch exactly:

* a domain with ``h`` healthy GPUs gives ``h // T`` full slots of its fastest
  GPUs; ``ntp`` and ``ntp-pw`` add one reduced slot of the largest allowed
  degree that the remaining healthy GPUs can run (``dp-drop`` leaves them idle);
* slots are sorted by degree, then speed, and grouped ``pp`` at a time into
  at most ``dp_max`` replicas: partially failed domains end up packed into as
  few replicas as possible and the worst slots become spares, which is the
  paper's "swap in spare domains" and "pack failed domains together";
* a replica runs at the smallest degree among its slots, on the fastest GPUs;
* ``ntp-pw`` then boosts the power of slow replicas' stages, cheapest first,
  as far as rack and site budgets allow (targeting nominal speed), instead of
  relying on a smaller local batch;
* local batches come from :func:`ntp_opt.goodput.split_batch` (exact). Under
  the ``fixed`` policy a plan that cannot carry ``B`` pauses (no replicas).

Stragglers are not avoided on purpose: the paper's heuristic ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules.goodput import BatchSplit, replica_speed, split_batch
from ntp_opt.rules.power import (
    boost_toward,
    can_boost,
    headroom,
    over_budget,
    rack_and_site_draw,
)
from ntp_opt.rules.tolerances import BUDGET_SLACK, FLOAT_NOISE
from ntp_opt.rules.validate import certified


@dataclass(frozen=True)
class Slot:
    """A candidate stage: ``gpus`` (indices, fastest first) of one domain."""

    domain: int
    gpus: np.ndarray
    degree: int

    def speed(self, speed: np.ndarray, t: int) -> float:
        """Speed of the slowest of the ``t`` GPUs a stage of degree ``t`` uses."""
        cache = self.__dict__.get("_prefix_min")  # (speed array, prefix minima)
        if cache is None or cache[0] is not speed:
            cache = (speed, np.minimum.accumulate(speed[self.gpus]))
            self.__dict__["_prefix_min"] = cache  # a cache, not state: frozen is kept
        return float(cache[1][t - 1])


def domain_slots(instance: Instance, reduced: bool) -> list[Slot]:
    """Cut every domain into slots (see the module docstring).

    Parameters
    ----------
    instance
        The instance.
    reduced
        Also make one reduced-degree slot from each domain's leftover GPUs.

    Returns
    -------
    list of Slot
    """
    a = instance.arrays
    job = instance.job
    big_t = job.tp
    slots: list[Slot] = []
    for d, members in enumerate(a.domain_gpus):
        ok = members[a.healthy[members]]
        # fastest first; ties keep graph order
        ok = ok[np.argsort(-a.speed[ok], kind="stable")]
        full = len(ok) // big_t
        for j in range(full):
            slots.append(Slot(d, ok[j * big_t : (j + 1) * big_t], big_t))
        if reduced:
            rest = ok[full * big_t :]
            t = job.largest_allowed(len(rest))
            if t is not None and t < big_t:
                slots.append(Slot(d, rest[:t], t))
    return slots


def pack_replicas(
    instance: Instance, slots: list[Slot], by_value: bool = False
) -> list[tuple[int, list[Slot]]]:
    """Group slots into replicas: best slots first, ``pp`` at a time.

    "Best" is the highest degree, then the fastest slowest GPU (the paper's
    packing); with ``by_value``, the largest ``f(t) * slowest speed``, then
    the highest degree. Ties keep slot order.

    Returns
    -------
    list of (degree, slots)
        At most ``dp_max`` replicas; leftover slots are spares.
    """
    job = instance.job
    speed = instance.arrays.speed
    fast = [s.speed(speed, s.degree) for s in slots]
    if by_value:
        value = [job.tp_factor(s.degree) * v for s, v in zip(slots, fast, strict=True)]
        order = sorted(range(len(slots)), key=lambda i: (-value[i], -slots[i].degree, i))
    else:
        order = sorted(range(len(slots)), key=lambda i: (-slots[i].degree, -fast[i], i))
    n = min(job.replicas_max, len(slots) // job.pp)
    groups = []
    for r in range(n):
        members = [slots[i] for i in order[r * job.pp : (r + 1) * job.pp]]
        groups.append((min(s.degree for s in members), members))
    return groups


def boost_slowest(instance: Instance, groups: list[tuple[int, list[Slot]]]) -> list[list[float]]:
    """Power multipliers per replica and stage: boost slow replicas, cheapest first.

    :func:`ntp_opt.rules.power.boost_toward` (50 bisection steps) from power 1,
    for the replicas slower than nominal.
    """
    a = instance.arrays
    job = instance.job
    if not can_boost(instance):
        return [[1.0] * len(members) for _, members in groups]
    rack_room, site_room = headroom(instance, used_mask(instance, groups).astype(float))
    target = 1.0 / job.seq_time_s  # nominal speed of a healthy full-TP replica
    reps = [(t, [s.gpus[:t] for s in m], [1.0] * len(m)) for t, m in groups]
    speeds = [
        replica_speed(job, t, [s.speed(a.speed, t) for s in m], [1.0] * len(m)) for t, m in groups
    ]
    slow = [r for r in range(len(groups)) if speeds[r] < target * (1 - FLOAT_NOISE)]
    powers, _ = boost_toward(instance, reps, slow, rack_room, site_room, steps=50)
    return powers


def used_mask(instance: Instance, groups: list[tuple[int, list[Slot]]]) -> np.ndarray:
    """Boolean per GPU index: the GPUs the packed replicas ``groups`` use."""
    used = np.zeros(instance.arrays.n_gpus, dtype=bool)
    for t, members in groups:
        for s in members:
            used[s.gpus[:t]] = True
    return used


def draw_at_power_one(instance: Instance, used: np.ndarray) -> tuple[np.ndarray, float]:
    """Watts per rack and for the site when the ``used`` GPUs run at power 1.

    Unused healthy GPUs draw their idle share, failed GPUs nothing.
    """
    return rack_and_site_draw(instance, used.astype(float))


def fits_at_power_one(instance: Instance, used: np.ndarray) -> bool:
    """Do the ``used`` GPUs at power 1 (and the idle ones) fit every rack and the site?"""
    racks, site = over_budget(
        instance, *draw_at_power_one(instance, used), tol=BUDGET_SLACK, slack=0.0
    )
    return not (racks.any() or site)


Groups = list[tuple[int, list[Slot]]]


def fit_power(instance: Instance, groups: Groups) -> Groups:
    """``groups`` without its last (worst) replicas until all fit the budgets at power 1.

    Only a budget below the GPUs' TDP makes this drop anything.
    """
    groups = list(groups)
    while groups and not fits_at_power_one(instance, used_mask(instance, groups)):
        groups.pop()
    return groups


def split_groups(
    instance: Instance, groups: Groups, powers: list[list[float]]
) -> BatchSplit | None:
    """The exact batch split of replicas ``groups`` at stage multipliers ``powers``."""
    a = instance.arrays
    job = instance.job
    speeds = [
        replica_speed(job, t, [s.speed(a.speed, t) for s in m], p)
        for (t, m), p in zip(groups, powers, strict=True)
    ]
    return split_batch(job, speeds, [t for t, _ in groups])


def to_replicas(
    instance: Instance, groups: Groups, powers: list[list[float]], batches: tuple[int, ...]
) -> tuple[Replica, ...]:
    """Replicas of the plan: each stage on its slot's fastest ``t`` GPUs (zero batches left out)."""
    a = instance.arrays
    return tuple(
        Replica(
            tp=t,
            local_batch=b,
            stages=tuple(
                Stage(
                    domain=a.domain_ids[s.domain],
                    gpus=tuple(a.gpu_ids[i] for i in s.gpus[:t]),
                    power=float(pw),
                )
                for s, pw in zip(members, p, strict=True)
            ),
        )
        for (t, members), p, b in zip(groups, powers, batches, strict=True)
        if b > 0
    )


def _plan(
    instance: Instance, policy: str, reduced: bool, boost: bool, validate: bool = True
) -> Plan:
    groups = fit_power(instance, pack_replicas(instance, domain_slots(instance, reduced)))
    powers = boost_slowest(instance, groups) if boost else [[1.0] * len(m) for _, m in groups]
    split = split_groups(instance, groups, powers)
    replicas: tuple[Replica, ...] = ()
    if split is not None:
        replicas = to_replicas(instance, groups, powers, split.batches)
    plan = Plan(instance.name, replicas, {"policy": policy, "paused": not replicas})
    return certified(instance, plan) if validate else plan


def dp_drop(instance: Instance, *, validate: bool = True) -> Plan:
    """Uniform TP: only full-degree stages; spare domains swapped in.

    Parameters
    ----------
    instance
        The instance.
    validate
        Check the plan and attach the validator's metrics (default);
        :func:`ntp_opt.solve.solve` checks it itself.

    Returns
    -------
    Plan
        A validated plan (empty when the job pauses).
    """
    return _plan(instance, "dp-drop", reduced=False, boost=False, validate=validate)


def ntp(instance: Instance, *, validate: bool = True) -> Plan:
    """The paper's NTP: reduced-degree replicas with a smaller local batch.

    Parameters
    ----------
    instance
        The instance.
    validate
        Check the plan and attach the validator's metrics (default);
        :func:`ntp_opt.solve.solve` checks it itself.

    Returns
    -------
    Plan
        A validated plan (empty when the job pauses).
    """
    return _plan(instance, "ntp", reduced=True, boost=False, validate=validate)


def ntp_pw(instance: Instance, *, validate: bool = True) -> Plan:
    """NTP with power boost of slow replicas within rack and site budgets.

    Parameters
    ----------
    instance
        The instance.
    validate
        Check the plan and attach the validator's metrics (default);
        :func:`ntp_opt.solve.solve` checks it itself.

    Returns
    -------
    Plan
        A validated plan (empty when the job pauses).
    """
    return _plan(instance, "ntp-pw", reduced=True, boost=True, validate=validate)
