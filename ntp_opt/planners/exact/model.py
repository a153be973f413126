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
:func:`merged_capacity` bounds the same optimum with such units merged into
classes (one variable per rack configuration of a class).

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
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.planners.exact.choice import (
    ChoiceDomain,
    ChoiceTooLarge,
    choice_configs,
    choice_groups,
)
from ntp_opt.planners.exact.program import IntProgram, Row
from ntp_opt.rules.power import (
    ceil_mw,
    exceeds,
    extra_draw,
    fits_mw,
    floor_mw,
    idle_draw,
    site_idle_draw,
)
from ntp_opt.rules.power import (
    fits as budget_fits,
)
from ntp_opt.rules.tolerances import (
    BISECT_TOL,
    BUDGET_SLACK,
    EDGE_SLACK,
    FLOAT_NOISE,
    TIGHTEN_TOL,
)

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


#: Configurations of a chosen domain kept built (:attr:`ChoiceDomain.built`) before the
#: store is emptied.
MAX_BUILT = 50_000


def _check_deadline(deadline: float | None) -> None:
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
    caps = instance.max_multiplier
    idle_w = idle_draw(instance)  # per GPU
    # power units: union-find over domains joined by shared racks
    parent = list(range(a.n_domains))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    rack_first: dict[int, int] = {}
    for d, r in zip(a.gpu_domain.tolist(), a.gpu_rack.tolist(), strict=True):
        if r in rack_first:
            ra, rb = find(rack_first[r]), find(d)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
        else:
            rack_first[r] = d
    members: dict[int, list[int]] = {}
    for d in range(a.n_domains):
        members.setdefault(find(d), []).append(d)

    domains: list[Domain] = []
    unit_racks: dict[int, list[int]] = {}
    for root, ds in members.items():
        racks: list[int] = []
        for d in ds:
            for r in a.gpu_rack[a.domain_gpus[d]].tolist():
                if r not in racks:
                    racks.append(r)
        unit_racks[root] = racks
    unit_of_domain = {d: root for root, ds in members.items() for d in ds}
    for d in range(a.n_domains):
        idx = a.domain_gpus[d]
        idx = idx[a.healthy[idx]]
        racks = unit_racks[unit_of_domain[d]]
        if len(racks) == 1:
            rpos = np.zeros(len(idx), dtype=np.int64)
        else:
            pos_of = {r: i for i, r in enumerate(racks)}
            rpos = np.array([pos_of[r] for r in a.gpu_rack[idx].tolist()], dtype=np.int64)
        # fastest first; among equal speeds the highest cap first, then alternate
        # racks (round robin)
        if len(idx) == 0 or bool((rpos == rpos[0]).all()):
            # one rack: the round-robin rank grows with the index within each
            # (speed, cap) group, so the index alone breaks the ties (same order)
            order = np.lexsort((np.arange(len(idx)), -caps[idx], -a.speed[idx]))
            idx = idx[order]
            domains.append(
                Domain(
                    d, idx, a.speed[idx].copy(), a.tdp[idx].copy(), rpos[order], caps[idx].copy()
                )
            )
            continue
        rank = np.zeros(len(idx), dtype=np.int64)
        seen: dict[tuple[float, float, int], int] = {}
        for j, (s, cp, rp) in enumerate(
            zip(a.speed[idx].tolist(), caps[idx].tolist(), rpos.tolist(), strict=True)
        ):
            rank[j] = seen.get((s, cp, rp), 0)
            seen[(s, cp, rp)] = rank[j] + 1
        order = np.lexsort((np.arange(len(idx)), rpos, rank, -caps[idx], -a.speed[idx]))
        idx = idx[order]
        domains.append(
            Domain(d, idx, a.speed[idx].copy(), a.tdp[idx].copy(), rpos[order], caps[idx].copy())
        )

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
    healthy_speeds = sorted({float(s) for s in a.speed[a.healthy].tolist()}, reverse=True)
    # Fastest-first is optimal when a domain's healthy GPUs share one TDP and
    # one rack: then a faster GPU never costs more power anywhere.
    # Otherwise the domain's GPUs are chosen exactly (choice.py) where that stays small.
    inexact = ""
    choice: dict[int, ChoiceDomain] = {}
    single_domain = {unit.domains[0] for unit in units if len(unit.domains) == 1}
    for dom in domains:
        why = ""
        if len(set(dom.tdp.tolist())) > 1:
            why = f"domain {a.domain_ids[dom.index]!r} mixes GPU TDPs"
        elif len(set(dom.rack_pos.tolist())) > 1:
            why = f"domain {a.domain_ids[dom.index]!r} spans racks"
        elif len(dom.cap) > 1 and np.any(np.diff(dom.cap) > 0):
            why = (
                f"domain {a.domain_ids[dom.index]!r} has a faster GPU whose board accepts "
                "less power than a slower one's"
            )
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
    site_idle = site_idle_draw(instance)
    return Prepared(
        instance=instance,
        domains=tuple(domains),
        units=tuple(units),
        classes=tuple(tuple(us) for us in single.values()),
        multi=tuple(multi),
        site_budget_mw=floor_mw(a.site_budget),
        site_idle_w=site_idle,
        speeds=tuple(healthy_speeds),
        inexact=inexact,
        choice=choice,
    )


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
    gpu_rack = rack_map[a.gpu_rack]
    gpu_rack.setflags(write=False)
    budget.setflags(write=False)
    arrays = dataclasses.replace(a, gpu_rack=gpu_rack, rack_budget=budget)

    def no_graph() -> Any:
        raise NoClusterGraph("the rack-merged relaxation has no cluster graph")

    inst = prep.instance
    return Instance.from_arrays(inst.name, arrays, inst.job, dict(inst.meta), no_graph)


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


def stage_power(
    prep: Prepared,
    t: int,
    b: int,
    slowest: float,
    theta: float,
    hi: float | None = None,
    factor: float | None = None,
) -> float | None:
    """Smallest power multiplier for a degree-``t`` stage to carry batch ``b`` at ``theta``.

    ``hi`` is the stage's cap (default ``1 + max_boost``: no board limit below
    it). ``factor`` is ``job.tp_factor(t)`` when the caller has it. Returns
    ``None`` when even ``hi`` is not enough.
    """
    job = prep.instance.job
    if factor is None:
        factor = job.tp_factor(t)
    speed_needed = b * job.seq_time_s / (theta * factor * slowest)
    if speed_needed <= 1.0 * (1 + FLOAT_NOISE):
        return 1.0
    alpha = job.power_exponent
    if hi is None:
        hi = 1.0 + job.max_boost
    if alpha <= 0 or job.max_boost <= 0 or hi <= 1.0:
        return None
    pi = speed_needed ** (1.0 / alpha)
    if pi > hi * (1 + BUDGET_SLACK):
        return None
    return min(pi, hi)


def max_level(prep: Prepared, t: int, slowest: float, theta: float) -> int:
    """Largest batch level a degree-``t`` stage whose slowest GPU has speed
    ``slowest`` can carry at ``theta`` (at most ``min(M, B)``; may be 0).

    One above the exact value at most (float slack): :func:`stage_power`
    decides each level.
    """
    job = prep.instance.job
    cap = min(job.local_batch_max, job.global_batch)
    boost = 1.0
    if job.power_exponent > 0 and job.max_boost > 0:
        boost = (1.0 + job.max_boost) ** job.power_exponent
    top = theta * job.tp_factor(t) * slowest * boost / job.seq_time_s
    if not math.isfinite(top) or top >= cap:
        return cap
    return min(cap, math.floor(top * (1 + EDGE_SLACK)) + 1)


def domain_configs(
    prep: Prepared,
    dom: Domain,
    n_racks: int,
    theta: float,
    degrees: tuple[int, ...],
    deadline: float | None = None,
    min_batch: int = 1,
) -> list[Config]:
    """Every configuration of one domain at step time ``theta`` (the empty one first).

    Stages are listed with non-increasing speed requirement ``b / f(t)``, so
    that the most demanding stage takes the fastest block and no multiset of
    stages appears twice. Only the batch levels a stage on the domain's
    fastest block can carry are listed (:func:`max_level`), so the work grows
    with the configurations, not with ``max_local_batch``; and none below
    ``min_batch`` (:func:`level_floor`: a question ``C >= target`` needs no lower one).

    Raises
    ------
    ModelTooLarge
        More than :data:`MAX_CONFIGS` configurations (checked before listing
        them when the single-stage ones alone are too many).
    DeadlineReached
        ``deadline`` (a :func:`time.perf_counter` value) passed.
    """
    job = prep.instance.job
    idle_frac = job.idle_power_fraction
    h = len(dom.gpus)
    options: list[tuple[float, int, int]] = []  # (requirement, t, b)
    for t in degrees:
        if t > h or h == 0:
            continue
        top = max_level(prep, t, float(dom.speed[t - 1]), theta)
        if top > MAX_CONFIGS + 1 or len(options) + top > MAX_CONFIGS + len(degrees):
            # each level below the top is a single-stage configuration on the fastest block
            raise ModelTooLarge(
                f"domain {prep.instance.arrays.domain_ids[dom.index]!r} has more than "
                f"{MAX_CONFIGS} stage configurations at this step time"
            )
        for b in range(max(1, min_batch), top + 1):
            options.append((b / job.tp_factor(t), t, b))
    options.sort(key=lambda o: (-o[0], -o[1], -o[2]))
    grouped = prep.choice.get(dom.index)
    if grouped is not None:  # fastest-first may miss the optimum: exact GPU choice
        unit = next(u for u in prep.units if dom.index in u.domains)
        try:
            listed = choice_configs(
                job,
                grouped,
                unit.idle_w,
                unit.budget_mw,
                theta,
                degrees,
                [(t, b) for _, t, b in options],
                lambda: _check_deadline(deadline),
                str(prep.instance.arrays.domain_ids[dom.index]),
                MAX_CONFIGS,
            )
        except ChoiceTooLarge as err:
            raise ModelTooLarge(str(err)) from None
        # the same configurations come back at most step times: built once
        built = grouped.built
        if len(built) > MAX_BUILT:
            built.clear()
        out: list[Config] = []
        for item in listed:
            cfg = built.get(item)
            if not isinstance(cfg, Config):
                stages, extra = item
                cfg = Config(
                    tuple(StageChoice(t, b, min(pos), pi, pos) for t, b, pi, pos in stages), extra
                )
                built[item] = cfg
            out.append(cfg)
        return out
    configs: list[Config] = [Config((), (0.0,) * n_racks)]
    tdp_cum = dom.tdp
    min_t = min((t for t in degrees), default=h + 1)
    _check_deadline(deadline)
    factors = {t: job.tp_factor(t) for t in degrees}
    # per block (start, t): its cap, its slowest GPU's speed, racks and TDPs
    blocks: dict[tuple[int, int], tuple[float, float, np.ndarray, np.ndarray]] = {}

    def extend(start: int, first_opt: int, stages: list[StageChoice], extra: np.ndarray) -> None:
        if start + min_t > h:
            return
        for oi in range(first_opt, len(options)):
            _, t, b = options[oi]
            if start + t > h:
                continue
            block = blocks.get((start, t))
            if block is None:
                span = slice(start, start + t)
                block = blocks[(start, t)] = (
                    float(dom.cap[span].min()),
                    float(dom.speed[start + t - 1]),
                    dom.rack_pos[span],
                    tdp_cum[span],
                )
            hi, slowest, racks, tdps = block
            pi = stage_power(prep, t, b, slowest, theta, hi, factors[t])
            if pi is None:
                continue
            # in GPU order, as np.add.at would add them
            add = np.bincount(racks, weights=extra_draw(tdps, pi, idle_frac), minlength=n_racks)
            new_extra = extra + add
            new_stages = [*stages, StageChoice(t, b, start, pi)]
            configs.append(Config(tuple(new_stages), tuple(new_extra.tolist())))
            if len(configs) % 512 == 0:
                _check_deadline(deadline)
            if len(configs) > MAX_CONFIGS:
                raise ModelTooLarge(
                    f"domain {prep.instance.arrays.domain_ids[dom.index]!r} has more than "
                    f"{MAX_CONFIGS} stage configurations at this step time"
                )
            extend(start + t, oi, new_stages, new_extra)

    extend(0, 0, [], np.zeros(n_racks))
    return configs


@dataclass(frozen=True)
class Capacity:
    """The capacity program at one step time and how to read its solution."""

    theta: float
    degrees: tuple[int, ...]
    program: IntProgram
    # variable blocks: (unit indices sharing the variable, domain position in unit, config)
    columns: tuple[tuple[tuple[int, ...], int, Config], ...]
    classes: tuple[tuple[int, int], ...]  # replica class (t, b) of each n variable
    n_offset: int


def _unit_fits(unit: Unit, extra_w: tuple[float, ...]) -> bool:
    return all(
        fits_mw(idle + x, budget)
        for idle, x, budget in zip(unit.idle_w, extra_w, unit.budget_mw, strict=True)
    )


class CapacityBuilder:
    """Columns and rows of a capacity program, then its common tail.

    Callers add the configuration columns (:meth:`add_column`) and their own
    rows (``rows``: one per domain class or owner, rack budgets); :meth:`finish`
    adds the replica-class variables ``n[t, b]`` with their rows
    (``sum of stages of class (t, b) = pp * n[t, b]``), ``dp_max``,
    ``global_batch`` and the site budget, in that order.

    Parameters
    ----------
    prep
        From :func:`prepare`.
    limit
        Largest number of columns (:class:`ModelTooLarge` beyond), or ``None``.
    """

    def __init__(self, prep: Prepared, limit: int | None = None) -> None:
        self.prep = prep
        self.limit = limit
        self.lb: list[int] = []
        self.ub: list[int] = []
        self.obj: list[int] = []
        self.names: list[str] = []
        self.columns: list[tuple[tuple[int, ...], int, Config]] = []
        self.rows: list[Row] = []
        self.class_terms: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.site_var: list[int] = []
        self.site_coef: list[int] = []

    def add_column(self, units: tuple[int, ...], pos: int, cfg: Config, upper: int) -> int:
        """Add a variable ``0..upper`` counting ``cfg`` on domain ``pos`` of ``units``."""
        j = len(self.lb)
        if self.limit is not None and j >= self.limit:
            raise ModelTooLarge(f"more than {self.limit} domain configurations in all")
        self.lb.append(0)
        self.ub.append(upper)
        self.obj.append(0)
        self.names.append(f"u{units[0]}d{pos}c{j}")
        self.columns.append((units, pos, cfg))
        counts: dict[tuple[int, int], int] = {}
        for st in cfg.stages:
            counts[(st.t, st.b)] = counts.get((st.t, st.b), 0) + 1
        for key, k in counts.items():
            self.class_terms.setdefault(key, []).append((j, k))
        extra = ceil_mw(sum(cfg.extra_w))
        if extra:
            self.site_var.append(j)
            self.site_coef.append(extra)
        return j

    def finish(self, theta: float, degrees: tuple[int, ...]) -> Capacity:
        """The program, with the replica classes, ``dp_max``, ``global_batch`` and site rows."""
        job = self.prep.instance.job
        lb, ub, obj, names, rows = self.lb, self.ub, self.obj, self.names, self.rows
        n_offset = len(lb)
        classes = tuple(sorted(self.class_terms, key=lambda k: (-k[0], -k[1])))
        for t, b in classes:
            lb.append(0)
            ub.append(job.replicas_max)
            obj.append(b)
            names.append(f"n[{t},{b}]")
        for i, key in enumerate(classes):
            column_counts = self.class_terms[key]
            rows.append(
                Row(
                    (*(j for j, _ in column_counts), n_offset + i),
                    (*(k for _, k in column_counts), -job.pp),
                    0,
                    0,
                    f"stages{key}",
                )
            )
        n_vars = tuple(range(n_offset, n_offset + len(classes)))
        if classes:
            rows.append(Row(n_vars, (1,) * len(classes), None, job.replicas_max, "dp_max"))
            rows.append(
                Row(n_vars, tuple(b for _, b in classes), None, job.global_batch, "global_batch")
            )
        if self.site_var:
            room = self.prep.site_budget_mw - ceil_mw(self.prep.site_idle_w)
            rows.append(Row(tuple(self.site_var), tuple(self.site_coef), None, room, "site"))
        program = IntProgram.from_lists(lb, ub, obj, rows, names)
        return Capacity(theta, degrees, program, tuple(self.columns), classes, n_offset)


def level_floor(prep: Prepared, target: int) -> int:
    """The smallest batch level a replica of any plan carrying ``target`` can have.

    A plan with at most ``dp_max`` replicas, each carrying at most
    ``min(M, B)``, whose batches add up to ``target`` or more, has every batch
    at least ``target - (dp_max - 1) min(M, B)``: the others carry the rest.
    So whether ``C(theta) >= target`` is decided by the configurations with
    levels from there on (:func:`build_capacity` with ``min_batch``). At least 1.
    """
    job = prep.instance.job
    cap = min(job.local_batch_max, job.global_batch)
    return max(1, target - (job.replicas_max - 1) * cap)


def build_capacity(
    prep: Prepared,
    theta: float,
    degrees: tuple[int, ...],
    deadline: float | None = None,
    min_batch: int = 1,
) -> Capacity:
    """The integer program ``C(theta)``: maximise ``sum b`` at step time ``theta``.

    With ``min_batch`` (:func:`level_floor`) only replicas carrying at least
    that many sequences are in it: its optimum reaches a target exactly when
    ``C(theta)`` does, and is a lower bound on ``C(theta)`` otherwise.

    Parameters
    ----------
    prep
        From :func:`prepare`.
    theta
        Step time before the resharding overhead factor, in seconds.
    degrees
        TP degrees replicas may use.
    deadline
        :func:`time.perf_counter` value after which :class:`DeadlineReached` is raised.
    min_batch
        The smallest batch level listed.

    Returns
    -------
    Capacity
    """
    out = CapacityBuilder(prep, MAX_CONFIGS)
    rows = out.rows
    for members in prep.classes:
        unit = prep.units[members[0]]
        dom = prep.domains[unit.domains[0]]
        vars_here = []
        for cfg in domain_configs(prep, dom, len(unit.racks), theta, degrees, deadline, min_batch)[
            1:
        ]:
            if _unit_fits(unit, cfg.extra_w):
                vars_here.append(out.add_column(members, 0, cfg, len(members)))
        if vars_here:
            rows.append(
                Row(
                    tuple(vars_here),
                    (1,) * len(vars_here),
                    None,
                    len(members),
                    f"class{members[0]}",
                )
            )
    for u in prep.multi:
        unit = prep.units[u]
        rack_terms: list[dict[int, int]] = [dict() for _ in unit.racks]
        for pos, d in enumerate(unit.domains):
            dom = prep.domains[d]
            vars_here = []
            for cfg in domain_configs(
                prep, dom, len(unit.racks), theta, degrees, deadline, min_batch
            )[1:]:
                if not _unit_fits(unit, cfg.extra_w):
                    continue
                j = out.add_column((u,), pos, cfg, 1)
                vars_here.append(j)
                for r, x in enumerate(cfg.extra_w):
                    if x:
                        rack_terms[r][j] = ceil_mw(x)
            if vars_here:
                rows.append(Row(tuple(vars_here), (1,) * len(vars_here), None, 1, f"dom{d}"))
        for r, terms in enumerate(rack_terms):
            room = unit.budget_mw[r] - ceil_mw(unit.idle_w[r])
            if terms:
                rows.append(Row(tuple(terms), tuple(terms.values()), None, room, f"rack{r}@{u}"))
    return out.finish(theta, degrees)


def iter_stages(prep: Prepared, cap: Capacity, x: np.ndarray) -> Iterator[StagePick]:
    """Stages of a solution, in domain order (then GPU order)."""
    used_units: dict[tuple[int, int], int] = {}  # (class, domain position) -> units used
    out: list[StagePick] = []
    for j, (units, pos, cfg) in enumerate(cap.columns):
        count = int(x[j])
        for _ in range(count):
            k = used_units.get((units[0], pos), 0)
            used_units[(units[0], pos)] = k + 1
            unit = prep.units[units[k]]
            if pos == WHOLE_UNIT:
                whole = unit_domain(prep, units[k])
                assert whole.domain_of is not None
                for st in cfg.stages:
                    gpus = tuple(int(g) for g in whole.gpus[st.start : st.start + st.t])
                    d = int(whole.domain_of[st.start])
                    out.append(StagePick(st.t, st.b, d, gpus, st.power))
                continue
            dom = prep.domains[unit.domains[pos]]
            for st in cfg.stages:
                block = list(st.pos) if st.pos else slice(st.start, st.start + st.t)
                gpus = tuple(int(g) for g in dom.gpus[block])
                out.append(StagePick(st.t, st.b, dom.index, gpus, st.power))
    out.sort(key=lambda s: (s.domain, s.gpus))
    yield from out


def tighten(prep: Prepared, stages: Sequence[StagePick], theta: float) -> tuple[float, list[float]]:
    """Smallest step time at which the same stages still fit, and their powers there.

    Lowering the step time raises every stage's power need; the stages keep
    fitting while every multiplier stays within its stage's cap and every
    rack and the site stay within budget. That set of step times is an
    interval ending at ``theta``; its left end is found by bisection (to a
    relative ``BISECT_TOL``), or exactly when power cannot be boosted.

    Parameters
    ----------
    prep
        From :func:`prepare`.
    stages
        As from :func:`iter_stages`, feasible at ``theta``.
    theta
        The step time they were found at.

    Returns
    -------
    (float, list of float)
        The tightened step time and each stage's power multiplier there.
    """
    inst = prep.instance
    job = inst.job
    a = inst.arrays
    if not stages:
        return theta, []
    # the stages' GPUs, concatenated in stage order, and where each stage starts
    sizes = np.array([len(st.gpus) for st in stages], dtype=np.int64)
    gpus = np.fromiter(
        (g for st in stages for g in st.gpus), dtype=np.int64, count=int(sizes.sum())
    )
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    stage_of = np.repeat(np.arange(len(stages)), sizes)
    batch = np.array([st.batch for st in stages], dtype=float)
    factor = np.array([job.tp_factor(st.degree) for st in stages])
    slowest = np.minimum.reduceat(a.speed[gpus], starts)
    need = batch * job.seq_time_s / (factor * slowest)  # theta * (speed-up needed) per stage
    if job.max_boost <= 0 or job.power_exponent <= 0:
        return float(need.max()), [1.0] * len(stages)
    alpha = job.power_exponent
    # per stage: 1 + max_boost, or less where a board accepts less
    hi_pi = np.minimum.reduceat(inst.max_multiplier[gpus], starts)
    idle = job.idle_power_fraction
    tdp = a.tdp[gpus]
    stage_tdp = np.array([float(x.sum()) for x in np.split(tdp, starts[1:])])
    base_rack = np.bincount(a.gpu_rack, weights=idle_draw(inst), minlength=len(a.rack_ids))
    n_racks = len(base_rack)
    # one bincount adds the idle draw first, then every stage GPU's extra draw in
    # stage order: the same additions in the same order as one np.add.at per stage
    rack_idx = np.concatenate((np.arange(n_racks), a.gpu_rack[gpus]))
    rack_budget = a.rack_budget

    def powers(th: float) -> np.ndarray:
        return np.maximum(1.0, (need / th) ** (1.0 / alpha))

    def fits(th: float) -> bool:
        pi = powers(th)
        if np.any(pi > hi_pi * (1 + BUDGET_SLACK)):
            return False
        extra = extra_draw(tdp, pi[stage_of], idle)
        rack = np.bincount(rack_idx, weights=np.concatenate((base_rack, extra)), minlength=n_racks)
        if np.any(exceeds(rack, rack_budget, tol=TIGHTEN_TOL, slack=0.0)):
            return False
        site = float(base_rack.sum() + extra_draw(stage_tdp, pi, idle).sum())
        return bool(budget_fits(site, a.site_budget, tol=TIGHTEN_TOL, slack=0.0))

    lo = float((need / hi_pi**alpha).max())  # below this some stage needs too much power
    hi = theta
    if not fits(hi):
        return theta, [float(p) for p in powers(theta)]
    if fits(lo):
        hi = lo
    else:
        while hi / lo - 1 > BISECT_TOL:
            mid = math.sqrt(lo * hi)
            if fits(mid):
                hi = mid
            else:
                lo = mid
    return hi, [min(float(p), float(c)) for p, c in zip(powers(hi), hi_pi, strict=True)]


#: Largest number of rack combinations :func:`merged_capacity` tries per unit class.
MERGED_COMBOS = 200_000
#: Largest number of configurations of one domain :func:`merged_capacity` compares.
MERGED_DOMAIN_CONFIGS = 1_000


def _covers(big: tuple[tuple[int, int], ...], small: tuple[tuple[int, int], ...]) -> bool:
    """Whether every stage of ``small`` can be matched to its own stage of ``big``
    of the same degree and an equal or higher batch level (both sorted by
    decreasing ``(t, b)``: per degree, the i-th highest level of ``small`` is at
    most the i-th highest of ``big``)."""
    for t in {k[0] for k in small}:
        lo = [b for tt, b in small if tt == t]
        hi = [b for tt, b in big if tt == t]
        if len(hi) < len(lo) or any(x > y for x, y in zip(lo, hi, strict=False)):
            return False
    return True


_Option = tuple[tuple[tuple[int, int], ...], tuple[int, ...], int]  # stages, rack and site mW


def _dominates(a: _Option, b: _Option) -> bool:
    """``a`` draws no more than ``b`` in every rack and at the site, and covers its stages."""
    return (
        a[2] <= b[2]
        and all(x <= y for x, y in zip(a[1], b[1], strict=True))
        and _covers(a[0], b[0])
    )


def merged_capacity(
    prep: Prepared,
    theta: float,
    degrees: tuple[int, ...],
    deadline: float | None = None,
) -> IntProgram | None:
    """A smaller integer program whose optimum bounds ``C(theta)`` from above.

    :func:`build_capacity` keeps one binary per domain and configuration in
    units of several domains (NVL8: four DGX nodes per rack), so 100 identical
    racks are 100 copies of the same choice, and the branch and bound over
    them cannot close a gap of a few sequences (4,096 DGX GPUs: 15,568
    variables, open after 40 s). Here:

    * *interchangeable units are merged*: units with equal
      :func:`unit_key` form a class, a variable counts the units of a class
      that take one *rack configuration* (one configuration per domain, every
      rack within its budget, exactly the rack rows of :func:`build_capacity`),
      up to the class size;
    * *stages may serve a lower level*: the rows ``stages of (t, b) = pp n[t, b]``
      become, per degree ``t`` and level ``b``, ``stages of (t, >= b) >= pp
      n[t, >= b]``; a domain configuration whose stages are each matched
      (:func:`_covers`) by a stage of the same degree and an equal or higher
      level of another configuration of the same domain that draws no more in
      every rack and at the site is dropped; rack configurations with the
      same stages keep the smallest site draw. Replicas ``n[t, b]`` are
      listed for every level ``b`` up to the highest one of degree ``t``.

    It is a relaxation of the capacity program. Take any solution of
    :func:`build_capacity`. In every multi-domain unit, replace each domain's
    configuration by a kept one that dominates it (one exists: the dropped
    ones are dominated by a kept one, by transitivity of domination); its draws
    are no larger, so the unit still fits its racks, and its stage multiset,
    together with the unit's other domains, forms a listed rack configuration
    (or one with the same stages and a smaller site draw); count those per
    class. The site draw does not grow. Every stage was replaced by a stage of
    the same degree and a level at least as high, or kept, so for every
    ``(t, b)`` the stages of level ``>= b`` are at least as many as before,
    where they were exactly ``pp n[t, >= b]``. ``n``, ``dp_max``,
    ``global_batch`` and the objective are unchanged. So the optimum here is
    at least ``C(theta)``. (It is in fact equal: a stage may run a lower level
    at no more power, and sorting stages by level matches the ``>= b`` rows;
    only the bound is used.)

    Parameters
    ----------
    prep
        From :func:`prepare`.
    theta
        Step time before the resharding overhead factor, in seconds.
    degrees
        TP degrees replicas may use.
    deadline
        :func:`time.perf_counter` value after which :class:`DeadlineReached` is raised.

    Returns
    -------
    IntProgram or None
        ``None`` when there is no multi-domain unit, a domain of one has more
        than :data:`MERGED_DOMAIN_CONFIGS` configurations, or a unit class has
        more than :data:`MERGED_COMBOS` rack combinations to try.

    Raises
    ------
    ModelTooLarge
        As :func:`domain_configs`.
    """
    if not prep.multi:
        return None
    job = prep.instance.job
    cols: list[tuple[int, dict[tuple[int, int], int], int]] = []  # (owner row, stages, site)
    sizes: list[int] = []
    for members in prep.classes:  # single-domain units: as in build_capacity
        unit = prep.units[members[0]]
        dom = prep.domains[unit.domains[0]]
        for cfg in domain_configs(prep, dom, len(unit.racks), theta, degrees, deadline)[1:]:
            if _unit_fits(unit, cfg.extra_w):
                counts: dict[tuple[int, int], int] = {}
                for st in cfg.stages:
                    counts[(st.t, st.b)] = counts.get((st.t, st.b), 0) + 1
                cols.append((len(sizes), counts, ceil_mw(sum(cfg.extra_w))))
        sizes.append(len(members))
    by_key: dict[tuple[object, ...], list[int]] = {}
    for u in prep.multi:
        by_key.setdefault(unit_key(prep, u), []).append(u)
    for units in by_key.values():
        unit = prep.units[units[0]]
        rooms = [b - ceil_mw(i) for b, i in zip(unit.budget_mw, unit.idle_w, strict=True)]
        per_domain: list[list[_Option]] = []
        for d in unit.domains:
            kept: list[_Option] = []
            listed = domain_configs(
                prep, prep.domains[d], len(unit.racks), theta, degrees, deadline
            )
            if len(listed) > MERGED_DOMAIN_CONFIGS:
                return None  # the pairwise domination test would take too long
            for cfg in listed:
                if cfg.stages and not _unit_fits(unit, cfg.extra_w):
                    continue  # (an unused domain is always allowed, as in build_capacity)
                kinds = tuple(sorted(((st.t, st.b) for st in cfg.stages), reverse=True))
                draw = tuple(ceil_mw(x) for x in cfg.extra_w)
                opt: _Option = (kinds, draw, ceil_mw(sum(cfg.extra_w)))
                if any(_dominates(k, opt) for k in kept):
                    continue
                kept = [k for k in kept if not _dominates(opt, k)] + [opt]
            per_domain.append(kept)
        if math.prod(len(p) for p in per_domain) > MERGED_COMBOS:
            return None
        best: dict[tuple[tuple[int, int], ...], int] = {}
        for n_combo, combo in enumerate(itertools.product(*per_domain)):
            if n_combo % 4096 == 0:
                _check_deadline(deadline)
            if any(sum(o[1][r] for o in combo) > room for r, room in enumerate(rooms)):
                continue
            kinds = tuple(sorted((k for o in combo for k in o[0]), reverse=True))
            site = sum(o[2] for o in combo)
            if kinds and site < best.get(kinds, site + 1):
                best[kinds] = site
        for kinds, site in best.items():
            counts = {}
            for k in kinds:
                counts[k] = counts.get(k, 0) + 1
            cols.append((len(sizes), counts, site))
        sizes.append(len(units))
    lb: list[int] = []
    ub: list[int] = []
    obj: list[int] = []
    names: list[str] = []
    rows: list[Row] = []
    owner_vars: dict[int, list[int]] = {}
    for j, (owner, _, _) in enumerate(cols):
        lb.append(0)
        ub.append(sizes[owner])
        obj.append(0)
        names.append(f"o{owner}c{j}")
        owner_vars.setdefault(owner, []).append(j)
    for owner, js in owner_vars.items():
        rows.append(Row(tuple(js), (1,) * len(js), None, sizes[owner], f"owner{owner}"))
    # a replica may carry less than its stages could (global_batch): every level
    # up to the highest listed one of its degree
    top: dict[int, int] = {}
    for _, c, _ in cols:
        for t, b in c:
            top[t] = max(top.get(t, 0), b)
    classes = [(t, b) for t in sorted(top, reverse=True) for b in range(top[t], 0, -1)]
    n_offset = len(lb)
    for t, b in classes:
        lb.append(0)
        ub.append(job.replicas_max)
        obj.append(b)
        names.append(f"n[{t},{b}]")
    for t, b in classes:
        terms = [
            (j, sum(k for (tt, bb), k in c.items() if tt == t and bb >= b))
            for j, (_, c, _) in enumerate(cols)
        ]
        terms = [(j, k) for j, k in terms if k]
        n_terms = [n_offset + i for i, (tt, bb) in enumerate(classes) if tt == t and bb >= b]
        rows.append(
            Row(
                (*(j for j, _ in terms), *n_terms),
                (*(k for _, k in terms), *(-job.pp for _ in n_terms)),
                0,
                None,
                f"stages{(t, b)}+",
            )
        )
    n_vars = tuple(range(n_offset, n_offset + len(classes)))
    if classes:
        rows.append(Row(n_vars, (1,) * len(classes), None, job.replicas_max, "dp_max"))
        rows.append(
            Row(n_vars, tuple(b for _, b in classes), None, job.global_batch, "global_batch")
        )
    site_terms = [(j, s) for j, (_, _, s) in enumerate(cols) if s]
    if site_terms:
        room = prep.site_budget_mw - ceil_mw(prep.site_idle_w)
        rows.append(
            Row(
                tuple(j for j, _ in site_terms), tuple(s for _, s in site_terms), None, room, "site"
            )
        )
    return IntProgram.from_lists(lb, ub, obj, rows, names)
