"""The capacity model: the integer program solved at a fixed step time.

At a fixed (pre-overhead) step time ``theta'``, a replica of TP degree ``t``
can take local batch ``b`` exactly when every one of its stages runs at speed
at least ``b / theta'``. A stage of degree ``t`` on a block of GPUs whose
slowest GPU has speed ``s`` reaches it with the power multiplier

    pi = max(1, (b c / (theta' f(t) s)) ** (1 / alpha)),  f(t) = t eta(t) / (T eta(T))

(infeasible above the stage's cap: ``1 + max_boost``, or less where a GPU's
board accepts less, ``max_power_w / tdp_w``; see :mod:`ntp_opt.rules.power`), which
fixes its power draw. So at fixed
``theta'`` the planning problem is linear and integer: choose, for every
domain, a *configuration* (the stages it hosts, each with its degree and
batch level), such that stages of each class ``(t, b)`` come in multiples of
``pp`` (they form the replicas), budgets hold, and ``sum b`` is maximal. That
maximum, the *capacity* ``C(theta')``, is monotone in ``theta'``; the search in
:mod:`ntp_opt.planners.exact.search` finds the best step time with it.

Symmetry: domains are grouped into *power units* (connected components of the
domain–rack containment graph). A unit with one domain (NVL32, NVL72,
NVL36x2: racks hold parts of one domain only) is interchangeable with every
unit of the same profile (healthy GPU speeds and TDPs in stage order, rack
budgets): such units are aggregated into classes and the program counts how
many units of a class take each configuration, so identical domains create no
symmetry at all. Units with several domains (NVL8: four DGX nodes per rack)
keep one binary per domain and configuration and their rack budgets as rows;
:func:`~ntp_opt.planners.exact.merged.merged_capacity` bounds the same optimum
with such units merged into classes (one variable per rack configuration of a
class).

Within a domain, GPUs are used fastest first (among equal speeds, the
highest board power cap first; remaining ties alternate between the domain's
racks, so that a boosted stage spreads its draw); a configuration's stages
take consecutive blocks of that order, the stage needing the highest speed
first. When a domain's healthy GPUs share one TDP and one rack, and no faster
GPU has a lower cap than a slower one, this choice is optimal (an earlier GPU
is never worse in speed nor in cap, and every GPU left out draws the same idle
power). Otherwise (mixed TDPs, a domain spanning racks such as NVL36x2, or
caps that disagree with speeds) a slower or lower-power GPU, or another rack
split, can be better: such a domain's configurations are listed with an exact
GPU choice (:mod:`ntp_opt.planners.exact.choice`: every split of a stage over
the groups of interchangeable GPUs) where that stays small
(:attr:`Prepared.choice`). Where it does not, the domain keeps fastest-first
and the search still returns a validated plan, but reports it as feasible with
the capacity bound, not as optimal (:attr:`Prepared.inexact` says why).

This module holds the model's data (:func:`prepare`: domains in stage order,
power units, unit classes) and its configurations' types; the rest lives in
its siblings: :mod:`~ntp_opt.planners.exact.configs` (a domain's
configurations at a step time), :mod:`~ntp_opt.planners.exact.capacity` (the
program ``C(theta)`` and reading its solution), :mod:`~ntp_opt.planners.exact.merged`
(its relaxation with multi-domain units merged) and
:mod:`~ntp_opt.planners.exact.tighten` (the smallest step time a solution fits).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ntp_opt.model.instance import ClusterArrays, Instance
from ntp_opt.planners.exact.choice import ChoiceDomain, choice_groups
from ntp_opt.rules.power import fits_mw, floor_mw, idle_draw, site_idle_draw

#: Largest number of configurations, per domain class and in one program.
MAX_CONFIGS = 20_000


class ModelTooLarge(RuntimeError):
    """The exact model would need more configurations than :data:`MAX_CONFIGS`."""


class NoClusterGraph(RuntimeError):
    """The cluster graph of a :func:`rack_relaxed` instance was asked for (it has none)."""


class DeadlineReached(RuntimeError):
    """The caller's deadline passed while a capacity program was being built."""


class StagePick(NamedTuple):
    """One stage of a capacity solution, in index space.

    Attributes
    ----------
    degree
        TP degree ``t``.
    batch
        Batch level ``b`` of its class (the replica's local batch before the
        exact re-split).
    domain
        Domain index (``instance.arrays`` order).
    gpus
        GPU indices, in the domain's use order.
    power
        Power multiplier at the step time it was found at.
    """

    degree: int
    batch: int
    domain: int
    gpus: tuple[int, ...]
    power: float


def check_deadline(deadline: float | None) -> None:
    """Raise :class:`DeadlineReached` once ``deadline`` (a :func:`time.perf_counter`
    value) has passed; ``None``: no deadline.

    Parameters
    ----------
    deadline
        The caller's deadline, or ``None``.

    Raises
    ------
    DeadlineReached
        The deadline passed.
    """
    if deadline is not None and time.perf_counter() >= deadline:
        raise DeadlineReached("time limit reached while building a capacity program")


@dataclass(frozen=True)
class Domain:
    """A domain's healthy GPUs in stage order, and where they draw power."""

    index: int
    gpus: np.ndarray  # GPU indices, fastest first
    speed: np.ndarray
    tdp: np.ndarray
    rack_pos: np.ndarray  # position of each GPU's rack in its unit's rack list
    cap: np.ndarray  # largest power multiplier of each GPU (job and board)
    # A whole multi-domain unit seen as one domain (:func:`unit_domain`): per
    # position, the end of its segment (one real domain) and that domain's index.
    # ``None`` for a real domain (one segment).
    seg_end: np.ndarray | None = None
    domain_of: np.ndarray | None = None


@dataclass(frozen=True)
class Unit:
    """A power unit: domains and the racks they share."""

    domains: tuple[int, ...]
    racks: tuple[int, ...]
    budget_mw: tuple[int, ...]  # per rack
    idle_w: tuple[float, ...]  # per rack: draw when no stage runs in the unit


@dataclass(frozen=True)
class Prepared:
    """Everything about an instance the capacity model needs, computed once."""

    instance: Instance
    domains: tuple[Domain, ...]
    units: tuple[Unit, ...]
    classes: tuple[tuple[int, ...], ...]  # single-domain units grouped: unit indices
    multi: tuple[int, ...]  # units with several domains
    site_budget_mw: int
    site_idle_w: float
    speeds: tuple[float, ...]  # distinct healthy GPU speeds
    inexact: str = ""  # why "fastest GPUs first" may miss the optimum ("" = it cannot)
    # domains where fastest-first may miss the optimum, listed exactly by choice.py
    choice: dict[int, ChoiceDomain] = field(default_factory=dict)
    # unit_domain's result per multi-domain unit (computed on first use)
    whole_units: dict[int, Domain] = field(default_factory=dict, compare=False, repr=False)


def prepare(instance: Instance) -> Prepared:
    """Compile an instance into domains, power units and unit classes.

    Parameters
    ----------
    instance
        The instance.

    Returns
    -------
    Prepared
    """
    a = instance.arrays
    members = _power_units(a)
    unit_racks: dict[int, list[int]] = {}
    for root, ds in members.items():
        racks: list[int] = []
        for d in ds:
            for r in a.gpu_rack[a.domain_gpus[d]].tolist():
                if r not in racks:
                    racks.append(r)
        unit_racks[root] = racks
    unit_of_domain = {d: root for root, ds in members.items() for d in ds}
    domains = [_stage_order(instance, d, unit_racks[unit_of_domain[d]]) for d in range(a.n_domains)]
    units = _units(instance, members, unit_racks, domains)
    classes, multi = _unit_classes(units, domains)
    healthy_speeds = sorted({float(s) for s in a.speed[a.healthy].tolist()}, reverse=True)
    inexact, choice = _exact_choices(instance, domains, units)
    site_idle = site_idle_draw(instance)
    return Prepared(
        instance=instance,
        domains=tuple(domains),
        units=tuple(units),
        classes=classes,
        multi=multi,
        site_budget_mw=floor_mw(a.site_budget),
        site_idle_w=site_idle,
        speeds=tuple(healthy_speeds),
        inexact=inexact,
        choice=choice,
    )


def _find(parent: list[int], i: int) -> int:
    """The root of ``i`` in the union-find forest ``parent`` (path halving)."""
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def _power_units(a: ClusterArrays) -> dict[int, list[int]]:
    """Power units: union-find over domains joined by shared racks (root -> domains)."""
    parent = list(range(a.n_domains))
    rack_first: dict[int, int] = {}
    for d, r in zip(a.gpu_domain.tolist(), a.gpu_rack.tolist(), strict=True):
        if r in rack_first:
            ra, rb = _find(parent, rack_first[r]), _find(parent, d)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
        else:
            rack_first[r] = d
    members: dict[int, list[int]] = {}
    for d in range(a.n_domains):
        members.setdefault(_find(parent, d), []).append(d)
    return members


def _stage_order(instance: Instance, d: int, racks: list[int]) -> Domain:
    """Domain ``d``'s healthy GPUs in stage order: fastest first; among equal speeds
    the highest cap first, then alternating racks (round robin)."""
    a = instance.arrays
    caps = instance.max_multiplier
    idx = a.domain_gpus[d]
    idx = idx[a.healthy[idx]]
    if len(racks) == 1:
        rpos = np.zeros(len(idx), dtype=np.int64)
    else:
        pos_of = {r: i for i, r in enumerate(racks)}
        rpos = np.array([pos_of[r] for r in a.gpu_rack[idx].tolist()], dtype=np.int64)
    if len(idx) == 0 or bool((rpos == rpos[0]).all()):
        # one rack: the round-robin rank grows with the index within each
        # (speed, cap) group, so the index alone breaks the ties (same order)
        order = np.lexsort((np.arange(len(idx)), -caps[idx], -a.speed[idx]))
        idx = idx[order]
        return Domain(d, idx, a.speed[idx].copy(), a.tdp[idx].copy(), rpos[order], caps[idx].copy())
    rank = np.zeros(len(idx), dtype=np.int64)
    seen: dict[tuple[float, float, int], int] = {}
    for j, (s, cp, rp) in enumerate(
        zip(a.speed[idx].tolist(), caps[idx].tolist(), rpos.tolist(), strict=True)
    ):
        rank[j] = seen.get((s, cp, rp), 0)
        seen[(s, cp, rp)] = rank[j] + 1
    order = np.lexsort((np.arange(len(idx)), rpos, rank, -caps[idx], -a.speed[idx]))
    idx = idx[order]
    return Domain(d, idx, a.speed[idx].copy(), a.tdp[idx].copy(), rpos[order], caps[idx].copy())


def _units(
    instance: Instance,
    members: dict[int, list[int]],
    unit_racks: dict[int, list[int]],
    domains: list[Domain],
) -> list[Unit]:
    """The power units: their domains, racks, rack budgets and idle draw per rack."""
    a = instance.arrays
    idle_w = idle_draw(instance)  # per GPU
    units: list[Unit] = []
    for root, ds in members.items():
        racks = unit_racks[root]
        idle = np.zeros(len(racks))
        for d in ds:
            dom = domains[d]
            np.add.at(idle, dom.rack_pos, idle_w[dom.gpus])
        units.append(
            Unit(
                tuple(ds),
                tuple(racks),
                tuple(floor_mw(float(a.rack_budget[r])) for r in racks),
                tuple(float(x) for x in idle),
            )
        )
    return units


def _unit_classes(
    units: list[Unit], domains: list[Domain]
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Single-domain units grouped by profile and budgets (unit indices); and the
    units with several domains."""
    single: dict[tuple[object, ...], list[int]] = {}
    multi: list[int] = []
    for u, unit in enumerate(units):
        if len(unit.domains) == 1:
            dom = domains[unit.domains[0]]
            key = (
                tuple(dom.speed.tolist()),
                tuple(dom.tdp.tolist()),
                tuple(dom.rack_pos.tolist()),
                tuple(dom.cap.tolist()),
                unit.budget_mw,
                unit.idle_w,
            )
            single.setdefault(key, []).append(u)
        else:
            multi.append(u)
    return tuple(tuple(us) for us in single.values()), tuple(multi)


def _exact_choices(
    instance: Instance, domains: list[Domain], units: list[Unit]
) -> tuple[str, dict[int, ChoiceDomain]]:
    """Where fastest-first may miss the optimum, the exact GPU choice (choice.py) where
    that stays small; and why the model is not exact where it does not ("": it is)."""
    # Fastest-first is optimal when a domain's healthy GPUs share one TDP and
    # one rack: then a faster GPU never costs more power anywhere.
    a = instance.arrays
    inexact = ""
    choice: dict[int, ChoiceDomain] = {}
    single_domain = {unit.domains[0] for unit in units if len(unit.domains) == 1}
    for dom in domains:
        why = _not_fastest_first(dom, a.domain_ids[dom.index])
        if not why:
            continue
        grouped, too_many = choice_groups(
            dom.rack_pos,
            dom.tdp,
            dom.cap,
            dom.speed,
            instance.job.allowed,
            dom.index in single_domain,
        )
        if grouped is not None:
            choice[dom.index] = grouped
        elif not inexact:
            inexact = f"{why}; no exact GPU choice: {too_many}"
    return inexact, choice


def _not_fastest_first(dom: Domain, name: object) -> str:
    """Why fastest-first may miss the optimum in ``dom`` ("": it cannot)."""
    if len(set(dom.tdp.tolist())) > 1:
        return f"domain {name!r} mixes GPU TDPs"
    if len(set(dom.rack_pos.tolist())) > 1:
        return f"domain {name!r} spans racks"
    if len(dom.cap) > 1 and np.any(np.diff(dom.cap) > 0):
        return (
            f"domain {name!r} has a faster GPU whose board accepts less power than a slower one's"
        )
    return ""


def rack_relaxed(prep: Prepared) -> Instance | None:
    """The instance with the racks of every power unit that holds a domain spanning
    racks merged into one rack whose budget is their sum (``None``: no such unit).

    Every plan of the instance is a plan of the merged one with the same goodput
    (racks enter only through their power budgets, and a merged rack's draw is the
    sum of the draws its budget sums), so the merged instance's optimum bounds the
    instance's. Its domains lie in one rack each, where fastest-first needs no
    exact GPU choice for the rack split (:attr:`Prepared.inexact`): where their
    GPUs also share one TDP and caps that agree with speeds, the exact search
    proves the merged optimum, and with it a bound on an instance whose own
    model is not exact.

    Parameters
    ----------
    prep
        From :func:`prepare`.

    Returns
    -------
    Instance or None
        The merged instance. Its cluster graph is not available (the exact
        planner reads :attr:`~ntp_opt.model.instance.Instance.arrays` only):
        reading it raises :class:`NoClusterGraph`.
    """
    a = prep.instance.arrays
    rack_map = np.arange(len(a.rack_ids), dtype=np.int64)
    budget = a.rack_budget.astype(float).copy()
    merged = False
    for unit in prep.units:
        if len(unit.racks) < 2:
            continue
        if not any(len(set(prep.domains[d].rack_pos.tolist())) > 1 for d in unit.domains):
            continue
        first = unit.racks[0]
        budget[first] = float(sum(a.rack_budget[r] for r in unit.racks))
        for r in unit.racks[1:]:
            rack_map[r] = first
            budget[r] = 0.0  # no GPU left in it
        merged = True
    if not merged:
        return None
    arrays = dataclasses.replace(a, gpu_rack=rack_map[a.gpu_rack], rack_budget=budget)
    inst = prep.instance
    return Instance.from_arrays(inst.name, arrays, inst.job, dict(inst.meta), _no_graph)


def _no_graph() -> Any:
    """The cluster graph of a :func:`rack_relaxed` instance: there is none."""
    raise NoClusterGraph("the rack-merged relaxation has no cluster graph")


@dataclass(frozen=True)
class StageChoice:
    """One stage of a configuration: GPUs ``[start, start + t)`` of the domain's order,
    or the positions ``pos`` in that order when set (an exact GPU choice, choice.py)."""

    t: int
    b: int
    start: int
    power: float
    pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class Config:
    """What one domain hosts at a given step time, and its extra draw per rack."""

    stages: tuple[StageChoice, ...]
    extra_w: tuple[float, ...]  # per rack of the unit: draw above idle


#: ``pos`` of a column that holds a whole multi-domain unit (:func:`unit_domain`).
WHOLE_UNIT = -1


def profile_key(dom: Domain) -> tuple[object, ...]:
    """What makes two domains interchangeable inside a unit: healthy speeds, TDPs,
    rack positions and caps, in stage order."""
    return (
        tuple(dom.speed.tolist()),
        tuple(dom.tdp.tolist()),
        tuple(dom.rack_pos.tolist()),
        tuple(dom.cap.tolist()),
    )


def unit_domain(prep: Prepared, u: int) -> Domain:
    """A multi-domain unit as one segmented domain: its domains' GPUs (each in stage
    order) one after the other, in a canonical domain order.

    The domains are ordered by :func:`profile_key` (then index), so units whose
    domains have the same profiles give segments of the same profiles in the same
    order: such units are interchangeable (one class of the column generation).
    A stage never spans two segments; within a segment stages follow the same
    rules as in a real domain.

    Parameters
    ----------
    prep
        From :func:`prepare`.
    u
        Index of the unit in :attr:`Prepared.units`.

    Returns
    -------
    Domain
        ``seg_end`` and ``domain_of`` set; ``index`` is its first domain's.
        Computed once per unit (kept in :attr:`Prepared.whole_units`).
    """
    cached = prep.whole_units.get(u)
    if cached is not None:
        return cached
    doms = sorted(
        (prep.domains[d] for d in prep.units[u].domains),
        key=lambda dm: (profile_key(dm), dm.index),
    )
    ends = np.cumsum([len(dm.gpus) for dm in doms])
    whole = prep.whole_units[u] = Domain(
        doms[0].index,
        np.concatenate([dm.gpus for dm in doms]),
        np.concatenate([dm.speed for dm in doms]),
        np.concatenate([dm.tdp for dm in doms]),
        np.concatenate([dm.rack_pos for dm in doms]),
        np.concatenate([dm.cap for dm in doms]),
        seg_end=np.repeat(ends, [len(dm.gpus) for dm in doms]).astype(np.int64),
        domain_of=np.repeat([dm.index for dm in doms], [len(dm.gpus) for dm in doms]).astype(
            np.int64
        ),
    )
    return whole


def unit_key(prep: Prepared, u: int) -> tuple[object, ...]:
    """Units with equal keys are interchangeable as whole units (:func:`unit_domain`)."""
    unit = prep.units[u]
    profiles = sorted(profile_key(prep.domains[d]) for d in unit.domains)
    return (tuple(profiles), unit.budget_mw, unit.idle_w)


def unit_fits(unit: Unit, extra_w: tuple[float, ...]) -> bool:
    """Whether a unit's racks hold its idle draw plus ``extra_w`` (per rack) within budget.

    Parameters
    ----------
    unit
        The power unit.
    extra_w
        Draw above idle per rack of the unit, in watts.

    Returns
    -------
    bool
    """
    return all(
        fits_mw(idle + x, budget)
        for idle, x, budget in zip(unit.idle_w, extra_w, unit.budget_mw, strict=True)
    )
