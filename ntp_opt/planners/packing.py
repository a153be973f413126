"""The packing core of the sort-and-pack planners: slots, packings, power, batch split.

A *slot* is a candidate stage: GPUs of one domain, fastest first
(:class:`Slot`, in array form :class:`SlotTable`). :func:`domain_slot_table`
cuts every domain into slots: a domain with ``h`` healthy GPUs gives
``h // T`` full slots of its fastest GPUs and, with ``reduced``, one reduced
slot of the largest allowed degree that the remaining healthy GPUs can run.
:func:`pack` sorts the slots by degree, then speed, and groups them ``pp`` at
a time into at most ``dp_max`` replicas (a :class:`Packing`); a replica runs
at the smallest degree among its slots, on the fastest GPUs.
:func:`fit_packing` drops the last replicas until the rest fit the power
budgets at power 1, :func:`boost_slowest_packed` boosts slow replicas
cheapest first, :func:`split_packing` splits the batch exactly,
:func:`trim_packed` lowers the multipliers to what the split uses and
:func:`packing_replicas` turns the result into plan replicas.

Used by the baselines (:mod:`ntp_opt.planners.heuristics`), ``fast``
(:mod:`ntp_opt.planners.fast`) and the Megatron peers; several functions also
have a list form (``Groups`` of :class:`Slot`) that the tests compare with the
array form.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Replica, Stage
from ntp_opt.rules.boost import Stages, boost_stages, trim_powers
from ntp_opt.rules.goodput import BatchSplit, goodput, overhead_factor, replica_speed, split_batch
from ntp_opt.rules.power import (
    budget_limit,
    can_boost,
    extra_draw,
    headroom,
    over_budget,
    rack_and_site_draw,
)
from ntp_opt.rules.tolerances import BUDGET_SLACK, FLOAT_NOISE


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


Groups = list[tuple[int, list[Slot]]]


@dataclass(frozen=True, eq=False)
class SlotTable:
    """Slots in array form: row ``i`` is a slot of ``degree[i]`` GPUs ``gpus[i]`` of ``domain[i]``.

    ``gpus`` is padded with ``-1`` past each slot's degree; ``prefix[i, t - 1]``
    is the speed of the slowest of the slot's first ``t`` GPUs
    (:meth:`Slot.speed`), ``inf`` past its degree.
    """

    domain: np.ndarray
    degree: np.ndarray
    gpus: np.ndarray
    prefix: np.ndarray

    def __len__(self) -> int:
        return len(self.degree)

    @classmethod
    def build(
        cls, speed: np.ndarray, domain: np.ndarray, degree: np.ndarray, gpus: np.ndarray
    ) -> SlotTable:
        """A table from padded GPU rows (``-1`` past each degree); prefix minima of ``speed``."""
        gpus = np.asarray(gpus, dtype=np.int64)
        if gpus.ndim != 2:
            gpus = gpus.reshape(len(degree), 0)
        sp = np.where(gpus >= 0, speed[np.maximum(gpus, 0)], np.inf)
        prefix = np.minimum.accumulate(sp, axis=1) if sp.size else sp
        return cls(
            np.asarray(domain, dtype=np.int64), np.asarray(degree, dtype=np.int64), gpus, prefix
        )

    @classmethod
    def from_slots(cls, instance: Instance, slots: list[Slot]) -> SlotTable:
        """The table of ``slots`` (their GPUs as given)."""
        width = max((len(s.gpus) for s in slots), default=0)
        gpus = np.full((len(slots), width), -1, dtype=np.int64)
        for i, s in enumerate(slots):
            gpus[i, : len(s.gpus)] = s.gpus
        return cls.build(
            instance.arrays.speed,
            np.array([s.domain for s in slots], dtype=np.int64),
            np.array([s.degree for s in slots], dtype=np.int64),
            gpus,
        )

    def slots(self) -> list[Slot]:
        """The rows as :class:`Slot` objects (GPUs up to the degree)."""
        return [
            Slot(int(d), g[:t], int(t))
            for d, g, t in zip(self.domain.tolist(), self.gpus, self.degree.tolist(), strict=True)
        ]

    def speed(self, t: np.ndarray | int) -> np.ndarray:
        """Per slot, the speed of its slowest GPU at degree ``t`` (per slot or for all)."""
        cols = np.broadcast_to(np.asarray(t, dtype=np.int64), self.degree.shape) - 1
        out: np.ndarray = self.prefix[np.arange(len(self.degree)), cols]
        return out


def _cut(
    instance: Instance,
    g: np.ndarray,
    domain: np.ndarray,
    start: np.ndarray,
    degree: np.ndarray,
    width: int,
) -> SlotTable:
    """Slots of consecutive GPUs of ``g`` (from ``start``), as given."""
    cols = np.arange(width)
    idx = np.minimum(start[:, None] + cols, max(len(g) - 1, 0))
    gpus = np.where(cols < degree[:, None], g[idx] if len(g) else -1, -1)
    return SlotTable.build(instance.arrays.speed, domain, degree, gpus)


def fastest_first(
    instance: Instance, spread: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Healthy GPUs by domain, fastest first (ties in index order); per domain: count and start.

    With ``spread``, GPUs of equal speed alternate between the domain's racks
    (the first of each rack, then the second of each, ...): stages cut from
    the order draw on every rack alike, which leaves each rack room to boost.
    Kept on the instance for its arrays (every ``fast`` candidate cuts from it).
    """
    a = instance.arrays
    memo = instance.__dict__.get("_fastest_first")
    if memo is None or memo[0] is not a:
        orders: dict[bool, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        memo = (a, orders)
        instance.__dict__["_fastest_first"] = memo  # a cache, not state
    if spread not in memo[1]:
        memo[1][spread] = _fastest_first(instance, spread)
    out: tuple[np.ndarray, np.ndarray, np.ndarray] = memo[1][spread]
    return out


def _fastest_first(instance: Instance, spread: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = instance.arrays
    ok = np.flatnonzero(a.healthy)
    dom = a.gpu_domain[ok]
    g = ok[np.lexsort((-a.speed[ok], dom))]
    if spread and len(g):
        rack = a.gpu_rack[g]
        sp = a.speed[g]
        d = a.gpu_domain[g]
        by = np.lexsort((g, rack, -sp, d))  # (domain, speed, rack) groups in index order
        key = np.stack([d[by], -sp[by], rack[by]])
        new_group = np.concatenate([[True], (key[:, 1:] != key[:, :-1]).any(axis=0)])
        pos = np.arange(len(by))
        starts = np.maximum.accumulate(np.where(new_group, pos, 0))
        rank = np.empty(len(g), dtype=np.int64)
        rank[by] = pos - starts
        g = g[np.lexsort((g, rack, rank, -sp, d))]
    counts = np.bincount(dom, minlength=a.n_domains)
    first = np.cumsum(counts) - counts
    return g, counts, first


def domain_slot_table(instance: Instance, reduced: bool, spread: bool = False) -> SlotTable:
    """:func:`domain_slots` as a :class:`SlotTable` (``spread``: see :func:`fastest_first`)."""
    job = instance.job
    big_t = job.tp
    g, counts, first = fastest_first(instance, spread)
    n_dom = len(counts)
    full = counts // big_t
    dom = np.repeat(np.arange(n_dom, dtype=np.int64), full)
    rank = np.arange(len(dom)) - np.repeat(np.cumsum(full) - full, full)  # j-th full slot
    start = first[dom] + rank * big_t
    degree = np.full(len(dom), big_t, dtype=np.int64)
    if reduced:
        lookup = np.array([job.largest_allowed(r) or 0 for r in range(big_t)], dtype=np.int64)
        t_red = lookup[counts - full * big_t]
        has = np.flatnonzero((t_red > 0) & (t_red < big_t))
        dom = np.concatenate([dom, has])
        rank = np.concatenate([rank, full[has]])
        start = np.concatenate([start, first[has] + full[has] * big_t])
        degree = np.concatenate([degree, t_red[has]])
        order = np.lexsort((rank, dom))
        dom, start, degree = dom[order], start[order], degree[order]
    return _cut(instance, g, dom, start, degree, big_t)


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
    return domain_slot_table(instance, reduced).slots()


@dataclass(frozen=True, eq=False)
class Packing:
    """Replicas in array form: replica ``r`` runs at degree ``tp[r]`` on slots ``members[r]``.

    Each stage runs on the first ``tp[r]`` GPUs of its slot (its fastest).
    """

    slots: SlotTable
    members: np.ndarray
    tp: np.ndarray

    def __len__(self) -> int:
        return len(self.tp)

    @classmethod
    def from_groups(cls, instance: Instance, groups: Groups) -> Packing:
        """The packing of ``groups`` (every replica with ``pp`` stages)."""
        flat = [s for _, m in groups for s in m]
        pp = len(groups[0][1]) if groups else instance.job.pp
        return cls(
            SlotTable.from_slots(instance, flat),
            np.arange(len(flat), dtype=np.int64).reshape(len(groups), pp),
            np.array([t for t, _ in groups], dtype=np.int64),
        )

    def groups(self) -> Groups:
        """The replicas as ``(degree, slots)`` (:class:`Slot` objects)."""
        rows = self.slots.slots()
        return [
            (int(t), [rows[i] for i in m])
            for t, m in zip(self.tp.tolist(), self.members.tolist(), strict=True)
        ]

    def head(self, k: int) -> Packing:
        """The first ``k`` replicas."""
        return Packing(self.slots, self.members[:k], self.tp[:k])

    def with_tp(self, tp: np.ndarray) -> Packing:
        """The same slots at other degrees (each at most its slots' degree)."""
        return Packing(self.slots, self.members, np.asarray(tp, dtype=np.int64))

    def stage_speeds(self) -> np.ndarray:
        """Per replica and stage: the speed of its slowest GPU at the replica's degree."""
        if len(self.tp) == 0:
            return np.zeros(self.members.shape)
        out: np.ndarray = self.slots.prefix[self.members, self.tp[:, None] - 1]
        return out

    def stages(self) -> Stages:
        """The stages (each on its slot's first ``tp`` GPUs), replica after replica."""
        cache = self.__dict__.get("_stages")
        if cache is None:
            pp = self.members.shape[1] if self.members.ndim == 2 else 0
            width = self.slots.gpus.shape[1] if self.slots.gpus.ndim == 2 else 0
            rows = self.slots.gpus[self.members] if len(self.tp) else np.empty((0, pp, width))
            keep = np.broadcast_to(np.arange(width) < self.tp[:, None, None], rows.shape)
            gpus = rows[keep].astype(np.int64)
            sizes = np.repeat(self.tp, pp)
            cache = Stages(
                replica=np.repeat(np.arange(len(self.tp), dtype=np.int64), pp),
                gpus=gpus,
                start=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            )
            self.__dict__["_stages"] = cache  # a cache, not state: frozen is kept
        return cache

    def used(self, n_gpus: int, k: int | None = None) -> np.ndarray:
        """Boolean per GPU index: the GPUs the first ``k`` replicas (default all) use."""
        st = self.stages()
        k = len(self.tp) if k is None else k
        pp = self.members.shape[1] if self.members.ndim == 2 else 0
        used = np.zeros(n_gpus, dtype=bool)
        used[st.gpus[: st.start[k * pp]]] = True
        return used


def pack(
    instance: Instance, table: SlotTable, by_value: bool = False, spread: bool = False
) -> Packing:
    """:func:`pack_replicas` on a :class:`SlotTable`.

    With ``spread``, ties (same degree and speed) go to each domain's first
    slot before any domain's second one, and so on: the replicas draw on as
    many domains (and racks) as they can, each left room to boost.
    """
    job = instance.job
    n_slots = len(table)
    fast = table.speed(table.degree) if n_slots else np.zeros(0)
    idx = np.arange(n_slots)
    if spread and n_slots:
        new_dom = np.concatenate([[True], table.domain[1:] != table.domain[:-1]])
        # j-th slot of its domain (the tables list each domain's slots together)
        idx = idx - np.maximum.accumulate(np.where(new_dom, idx, 0))
        idx = idx * n_slots + np.arange(n_slots)
    if by_value:
        factors = {int(t): job.tp_factor(int(t)) for t in np.unique(table.degree)}
        factor = np.array([factors[t] for t in table.degree.tolist()], dtype=float)
        order = np.lexsort((idx, -table.degree, -(factor * fast)))
    else:
        order = np.lexsort((idx, -fast, -table.degree))
    n = min(job.replicas_max, n_slots // job.pp, job.global_batch)  # a sequence each
    members = order[: n * job.pp].reshape(n, job.pp)
    tp = table.degree[members].min(axis=1) if n else np.zeros(0, dtype=np.int64)
    return Packing(table, members, tp)


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
    packed = pack(instance, SlotTable.from_slots(instance, slots), by_value)
    return [
        (int(t), [slots[i] for i in m])
        for t, m in zip(packed.tp.tolist(), packed.members.tolist(), strict=True)
    ]


def boost_slowest(instance: Instance, groups: Groups) -> list[list[float]]:
    """Power multipliers per replica and stage: boost slow replicas, cheapest first.

    :func:`ntp_opt.rules.boost.boost_stages` (50 bisection steps) from power 1,
    for the replicas slower than nominal.
    """
    if not can_boost(instance):
        return [[1.0] * len(members) for _, members in groups]
    powers: list[list[float]] = boost_slowest_packed(
        instance, Packing.from_groups(instance, groups)
    ).tolist()
    return powers


def replica_speeds(instance: Instance, packing: Packing, powers: np.ndarray) -> np.ndarray:
    """Per replica, :func:`ntp_opt.rules.goodput.replica_speed` at ``powers`` (R x pp)."""
    job = instance.job
    if len(packing) == 0:
        return np.zeros(0)
    slowest = (powers**job.power_exponent * packing.stage_speeds()).min(axis=1)
    factors = {int(t): job.tp_factor(int(t)) for t in np.unique(packing.tp)}
    factor = np.array([factors[t] for t in packing.tp.tolist()], dtype=float)
    out: np.ndarray = factor * slowest / job.seq_time_s
    return out


def boost_slowest_packed(instance: Instance, packing: Packing) -> np.ndarray:
    """:func:`boost_slowest` on a :class:`Packing`: multipliers per replica and stage (R x pp)."""
    job = instance.job
    shape = packing.members.shape
    if not can_boost(instance) or len(packing) == 0:
        return np.ones(shape)
    rack_room, site_room = headroom(instance, used_mask(instance, packing).astype(float))
    target = 1.0 / job.seq_time_s  # nominal speed of a healthy full-TP replica
    speeds = replica_speeds(instance, packing, np.ones(shape))
    slow = np.flatnonzero(speeds < target * (1 - FLOAT_NOISE)).tolist()
    powers, _ = boost_stages(
        instance,
        packing.stages(),
        packing.tp,
        np.ones(shape[0] * shape[1]),
        slow,
        rack_room,
        site_room,
        steps=50,
    )
    return powers.reshape(shape)


def trim_packed(
    instance: Instance, packing: Packing, powers: np.ndarray, split: BatchSplit
) -> np.ndarray:
    """``powers`` (R x pp) lowered to what the split ``split`` uses, at the same goodput.

    :func:`ntp_opt.rules.boost.trim_powers` with each replica's need
    ``b_r (1 + rho) / theta``: a boost that raises no replica the split
    waits for (a stage boosted beside a stage that cannot be, a replica
    faster than its batch needs) is taken back. ``powers`` itself when the
    trimmed multipliers would lower the goodput (rounding) or change nothing.
    """
    job = instance.job
    if len(packing) == 0 or not np.isfinite(split.step_time) or split.step_time <= 0:
        return powers
    tps = packing.tp.tolist()
    factor = overhead_factor(job, tps)
    need = np.array(split.batches, dtype=float) * factor / split.step_time
    flat = trim_powers(instance, packing.stages(), packing.tp, powers.ravel(), need)
    trimmed = flat.reshape(powers.shape)
    if np.array_equal(trimmed, powers):
        return powers
    before = goodput(job, tps, split.batches, replica_speeds(instance, packing, powers).tolist())
    after = goodput(job, tps, split.batches, replica_speeds(instance, packing, trimmed).tolist())
    return trimmed if after >= before else powers


def used_mask(instance: Instance, groups: Groups | Packing) -> np.ndarray:
    """Boolean per GPU index: the GPUs the packed replicas ``groups`` use."""
    if isinstance(groups, Packing):
        return groups.used(instance.arrays.n_gpus)
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


def fit_power(instance: Instance, groups: Groups) -> Groups:
    """``groups`` without its last (worst) replicas until all fit the budgets at power 1.

    Only a budget below the GPUs' TDP makes this drop anything.
    """
    return list(groups)[: len(fit_packing(instance, Packing.from_groups(instance, groups)))]


def fit_packing(instance: Instance, packing: Packing) -> Packing:
    """:func:`fit_power` on a :class:`Packing`.

    The number of replicas kept is estimated from running per-rack sums, then
    confirmed with the exact check (:func:`fits_at_power_one`) on it and one
    more: the draw only grows with each replica, by far more than rounding.
    """
    n = len(packing)
    if n == 0 or _head_fits(instance, packing, n):
        return packing
    k = _fit_estimate(instance, packing)
    while k < n - 1 and _head_fits(instance, packing, k + 1):
        k += 1
    while k > 0 and not _head_fits(instance, packing, k):
        k -= 1
    return packing.head(k)


def _head_fits(instance: Instance, packing: Packing, k: int) -> bool:
    """Do the first ``k`` replicas of ``packing`` fit the budgets at power 1?"""
    return fits_at_power_one(instance, packing.used(instance.arrays.n_gpus, k))


def _fit_estimate(instance: Instance, packing: Packing) -> int:
    """How many replicas (first ones) fit at power 1, from running sums (rounding aside)."""
    a = instance.arrays
    idle = instance.job.idle_power_fraction
    n_racks = len(a.rack_ids)
    rack0, site0 = draw_at_power_one(instance, np.zeros(a.n_gpus, dtype=bool))
    rack_cap = budget_limit(a.rack_budget, tol=BUDGET_SLACK, slack=0.0)  # as fits_at_power_one
    site_cap = budget_limit(a.site_budget, tol=BUDGET_SLACK, slack=0.0)
    st = packing.stages()
    rep = np.repeat(st.replica, st.sizes)
    delta = extra_draw(a.tdp[st.gpus], 1.0, np.where(a.healthy[st.gpus], idle, 0.0))
    k = len(packing)
    site = site0 + np.cumsum(np.bincount(rep, weights=delta, minlength=len(packing)))
    over = np.flatnonzero(site > site_cap)
    if len(over):
        k = min(k, int(over[0]))
    rack = a.gpu_rack[st.gpus]
    order = np.argsort(rack, kind="stable")
    r_sorted, d_sorted = rack[order], np.cumsum(delta[order])
    group_start = np.searchsorted(r_sorted, np.arange(n_racks))
    before = np.concatenate([[0.0], d_sorted])[group_start]
    running = rack0[r_sorted] + d_sorted - before[r_sorted]
    hit = np.flatnonzero(running > rack_cap[r_sorted])
    if len(hit):
        k = min(k, int(rep[order][hit].min()))
    return k


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


def split_packing(instance: Instance, packing: Packing, powers: np.ndarray) -> BatchSplit | None:
    """:func:`split_groups` on a :class:`Packing` and multipliers ``powers`` (R x pp)."""
    speeds = replica_speeds(instance, packing, powers)
    return split_batch(instance.job, speeds.tolist(), packing.tp.tolist())


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


def packing_replicas(
    instance: Instance, packing: Packing, powers: np.ndarray, batches: tuple[int, ...]
) -> tuple[Replica, ...]:
    """:func:`to_replicas` on a :class:`Packing` and multipliers ``powers`` (R x pp)."""
    a = instance.arrays
    st = packing.stages()
    flat = st.gpus.tolist()
    names = itemgetter(*flat)(a.gpu_ids) if len(flat) > 1 else tuple(a.gpu_ids[i] for i in flat)
    start = st.start.tolist()
    domain_ids = a.domain_ids
    domains = packing.slots.domain[packing.members].tolist()
    pws = powers.tolist()
    pp = packing.members.shape[1] if packing.members.ndim == 2 else 0
    out = []
    for r, (t, b) in enumerate(zip(packing.tp.tolist(), batches, strict=True)):
        if b <= 0:
            continue
        k0 = r * pp
        stages = tuple(
            Stage(domain_ids[d], names[start[k0 + k] : start[k0 + k + 1]], pw)
            for k, (d, pw) in enumerate(zip(domains[r], pws[r], strict=True))
        )
        out.append(Replica(t, b, stages))
    return tuple(out)
