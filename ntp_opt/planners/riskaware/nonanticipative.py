"""A bound on expected goodput with the plan's domains non-anticipative (``docs/risk.md``).

The wait-and-see bound (:mod:`~ntp_opt.planners.riskaware.waitandsee`) lets
every scenario choose its own plan. This one makes the *domains* of the plan
a first-stage decision, the same in every scenario:

* A plan has at most ``pp · dp_max`` stages and each stage lies in one
  domain, so it uses at most ``K = min(pp · dp_max, usable domains)``
  domains; extend its domains to a set ``D`` of exactly ``K`` (a choice made
  from the plan alone, never from the scenario).
* Recourse (``docs/failures.md``) never brings a domain outside the plan into
  the job and never raises a power multiplier; when every domain lies in one
  rack with one TDP and one board limit, each GPU it takes from a pool
  replaces a failed GPU of the same stage and rack, so no draw rises when the
  failed GPUs are counted at their idle draw. The recourse plan is then
  feasible for the *restricted* instance (:func:`restricted_instance`): the
  scenario's failed GPUs and every GPU outside ``D`` unusable, still drawing
  idle power. So ``G(P, s) <= v_s(D)``, the exact planner's bound on it.
* When every usable domain is alone in its rack and all have the same
  healthy GPUs and rack budget, ``v_s(D)`` depends on ``D`` only through
  ``T = D ∩ A_s`` (``A_s``: the domains ``s`` fails GPUs in): the other
  ``K - |T|`` domains of ``D`` are interchangeable failure-free domains.
  Restricted instances with the same failed-domain profiles are isomorphic and
  solved once (:func:`domain_bound` keys them).
* *Replica groups*, when a domain can hold only one stage (fewer than
  ``2 · tp_min`` healthy GPUs) and ``pp >= 2``: a domain that ``s`` leaves
  with fewer than ``tp_min`` healthy GPUs is *dead*, and every replica with a
  stage there drops out. Binaries ``u_de`` (domains ``d``, ``e`` in one
  replica, at most ``pp - 1`` partners each) are first-stage too; ``c``
  groups of dead domains leave at most ``dp_max - c`` replicas, so
  ``v_s(T, c)`` is solved with ``dp_max - c`` and the dead domains unusable.
  ``c >= ceil(m / pp)`` and ``c >= m - (pairs of them in one replica)`` for
  ``m`` dead domains. The padding domains of ``D`` are grouped ``pp`` at a
  time, so their dead groups never exceed the replicas the plan lacks.
* *Degraded replica groups*, in the same setting when every domain's
  healthy GPUs are alike: with no dead domain, the live domains of ``T``
  (each lost a GPU) lie in at least ``g`` replicas (``g >= ceil(|T| / pp)``
  and ``g >= |T| - (pairs of them in one replica)``, the same ``u``). A
  replica's stages share its degree, so after recourse every stage of such a
  replica keeps at most the survivors of its degraded domain; its
  ``g · pp - |T|`` failure-free partners are failure-free domains of ``D``
  (the padding, whole groups of ``pp`` when ``K = pp · dp_max``, is
  interchangeable), and ``v_s(T, g)`` is solved with that
  many of them keeping only the most survivors of a domain of ``T`` (their
  other GPUs unusable, drawing idle power, as recourse leaves them).
* *The power cap*, given the least nominal goodput ``min_nominal`` a plan
  must keep (:func:`power_cap`): when the exact planner proves that no plan
  leaving a healthy GPU of one of its domains unused reaches it (its bound
  on ``restricted_instance(D, one GPU of a domain of D failed)``, every such
  plan being feasible there up to a permutation of the identical domains and
  of a domain's identical GPUs), every admissible plan uses every healthy
  GPU of its domains, so a stage's multiplier is at most what the rack budget
  leaves with the other GPUs at ``π >= 1``. Recourse keeps each stage's
  multiplier, so the restricted instances are solved with ``max_boost``
  lowered to that cap: the scenario programs can no longer spend the failed
  GPUs' freed watts on boost, which recourse never does.

Hence, for every plan (every plan keeping ``min_nominal`` with the cap),

    sum_s w_s G(P, s)  <=  max_{|D| = K, u}  sum_s w_s v_s(D ∩ A_s, c_s),

a small integer program over the domain indicators ``z_d`` and ``u`` (CP-SAT,
one binary per domain and one per scenario option ``(T, c)`` or ``(T, g)``;
its proven bound is used, so a cut solve stays valid;
:func:`~ntp_opt.planners.exact.backends.domains.domain_master` builds it). It
is the extensive form of the two-stage relaxation; its Lagrangian dual over
the non-anticipativity of ``z`` (one copy per scenario, multipliers summing
to zero) is never tighter, and with zero multipliers it is the wait-and-see
bound over the same ``v_s``. ``v_s(T)`` is computed lazily: an option whose
value is not known yet counts with the scenario's own bound ``U_s``; after
each master solve the options its optimum uses and whose value is unknown are
solved, until the master's optimum uses only known values, the time runs out
or the cancel is set. The bound is valid at every step.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

from ntp_opt.model.control import Control, Deadline
from ntp_opt.model.instance import Instance
from ntp_opt.planners.base import Limit
from ntp_opt.planners.bounds import capacity_bound
from ntp_opt.planners.exact.backends.domains import domain_master
from ntp_opt.planners.riskaware.scenarios import Scenarios
from ntp_opt.planners.riskaware.scorer import refills_keep_power
from ntp_opt.planners.riskaware.waitandsee import bound_solve, idle_instance, solve_share
from ntp_opt.rules.power import budget_limit
from ntp_opt.rules.tolerances import REL_TOL

__all__ = [
    "MAX_AFFECTED",
    "DomainBound",
    "domain_bound",
    "domain_limit",
    "power_cap",
    "restricted_instance",
]

#: A scenario failing GPUs in more than this many domains is not coupled
#: (its only option is its own bound ``U_s``).
MAX_AFFECTED = 7
#: Largest share of the remaining time one master program may use.
MASTER_SHARE = 0.25
#: Seconds the last master program may use once the time is up.
MASTER_MIN = 0.5
#: Scale of the master's integer objective (its largest coefficient).
SCALE = 1e12
#: Largest share of the remaining time the power cap's proof may use.
CAP_SHARE = 0.1
#: The power cap's proof needs the exact bound this far (relative) below
#: ``min_nominal`` (well above the exact planner's tolerance).
CAP_MARGIN = 100 * REL_TOL


@dataclass(frozen=True)
class DomainBound:
    """The non-anticipative domain bound and how it was obtained.

    Attributes
    ----------
    bound
        Upper bound on ``sum_s w_s G(P, s)`` over every plan ``P``.
    domains
        ``K``: the domains any plan may use (``pp · dp_max``, at most the
        usable domains).
    chosen
        The domains (``instance.arrays`` indices) of the master's last optimum.
    options
        Scenario options ``(s, T)`` in the master program.
    solved
        Distinct restricted instances solved by the exact planner.
    proven
        Of those, the ones solved to optimality.
    masters
        Master programs solved.
    limit_hit
        Time or a cancel stopped it before the master's optimum used only
        known option values (the bound is valid, but might be tightened).
    power_cap
        The largest multiplier of an admissible plan's stage
        (:func:`power_cap`) the restricted instances were solved with, or
        ``None`` (the job's ``1 + max_boost``).
    """

    bound: float
    domains: int
    chosen: tuple[int, ...]
    options: int
    solved: int
    proven: int
    masters: int
    limit_hit: bool
    power_cap: float | None = None


def domain_limit(instance: Instance) -> int | None:
    """``K``, the domains a plan may use, when the domain bound applies, else ``None``.

    It applies when a plan cannot use every usable domain (``pp · dp_max``
    below their number), every domain lies in one rack with one TDP and one
    board limit (:func:`~ntp_opt.planners.riskaware.scorer.refills_keep_power`),
    every usable domain is alone in its rack, and all usable domains have the
    same healthy GPUs (speed, TDP, board limit) and rack budget.
    """
    a = instance.arrays
    job = instance.job
    assert job.dp_max is not None
    usable = _usable(instance)
    k = min(job.pp * job.dp_max, len(usable))
    if (k >= len(usable) and not _grouped(instance)) or not refills_keep_power(instance):
        return None
    profiles = set()
    racks_seen: set[int] = set()
    for d in usable:
        gpus = a.domain_gpus[d]
        racks = np.unique(a.gpu_rack[gpus])
        if len(racks) != 1:
            return None
        r = int(racks[0])
        if r in racks_seen or (a.gpu_rack == r).sum() != len(gpus):
            return None  # the rack holds GPUs of another domain
        racks_seen.add(r)
        profiles.add((_profile(instance, gpus[a.healthy[gpus]]), float(a.rack_budget[r])))
    return k if len(profiles) == 1 else None


def power_cap(
    instance: Instance,
    min_nominal: float,
    *,
    time_limit: float | None = None,
    seed: int = 0,
    threads: int = 1,
    control: Control | None = None,
) -> float | None:
    """The largest stage multiplier of a plan keeping ``min_nominal``, when proven below the job's.

    Parameters
    ----------
    instance
        The instance (:func:`domain_limit` must apply).
    min_nominal
        The least nominal goodput a plan may have.
    time_limit, seed, threads, control
        For the exact planner's proof.

    Returns
    -------
    float or None
        ``π_cap < 1 + max_boost`` such that every stage of every plan with
        nominal goodput at least ``min_nominal`` has ``π <= π_cap``; ``None``
        when not proven (or no lower than the job's cap). The proof: every
        healthy GPU of a domain is alike (speed, TDP, board limit), so a plan
        leaving one unused in one of its domains is, up to a permutation of
        the identical domains and GPUs, feasible for the restricted instance
        of ``K`` domains with one GPU of the first failed (it drew idle
        power anyway); when the exact planner's bound there is below
        ``min_nominal``, every admissible plan uses every healthy GPU of its
        domains, each at ``π >= 1``, so a stage of ``t`` GPUs in a rack of
        budget ``B`` (the domain alone in it, ``n`` healthy GPUs of TDP
        ``w``) has ``t π + n - t <= B / w``: ``π <= 1 + (B / w - n) / t``
        with ``t = n`` when a domain holds one stage, else ``t >= tp_min``.
    """
    k = domain_limit(instance)
    if k is None:
        return None
    a = instance.arrays
    job = instance.job
    usable = _usable(instance)
    first = a.domain_gpus[usable[0]]
    healthy = first[a.healthy[first]]
    if len(set(_profile(instance, healthy))) != 1:
        return None  # a domain's GPUs differ: which one is left unused matters
    n, w = len(healthy), float(a.tdp[healthy[0]])
    # the validator's slack: an admissible plan may draw that much more
    budget = budget_limit(float(a.rack_budget[int(a.gpu_rack[healthy[0]])]))
    t = n if _grouped(instance) else job.min_tp
    cap = max(1.0, 1.0 + (budget / w - n) / t)
    if cap >= 1.0 + job.max_boost:
        return None
    inst = restricted_instance(instance, np.array(usable[:k], dtype=np.int64), healthy[:1])
    out = bound_solve(inst, time_limit, seed, threads, control)
    bound = out.bound if out.bound is not None else capacity_bound(inst)
    return cap if bound * (1 + CAP_MARGIN) < min_nominal else None


def _alike(instance: Instance, domains: list[int]) -> bool:
    """The healthy GPUs of each of ``domains`` are alike (speed, TDP, board limit)."""
    a = instance.arrays
    for d in domains:
        gpus = a.domain_gpus[d]
        if len(set(_profile(instance, gpus[a.healthy[gpus]]))) > 1:
            return False
    return True


def _grouped(instance: Instance) -> bool:
    """Replicas span ``pp >= 2`` domains and a domain holds at most one stage.

    Every domain has fewer than two stages' worth (``2 · tp_min``) of healthy
    GPUs, so in any plan a domain belongs to at most one replica, and a
    replica's stages lie in ``pp`` distinct domains.
    """
    a = instance.arrays
    job = instance.job
    most = int(max((int(a.healthy[m].sum()) for m in a.domain_gpus), default=0))
    return job.pp >= 2 and most < 2 * job.min_tp


def _profile(instance: Instance, gpus: np.ndarray) -> tuple[tuple[float, float, float], ...]:
    a = instance.arrays
    return tuple(
        sorted(
            zip(
                a.speed[gpus].tolist(),
                a.tdp[gpus].tolist(),
                a.max_power[gpus].tolist(),
                strict=True,
            )
        )
    )


def restricted_instance(instance: Instance, usable: np.ndarray, failed: np.ndarray) -> Instance:
    """The scenario's instance with only the ``usable`` domains' GPUs usable.

    Parameters
    ----------
    instance
        The instance.
    usable
        Domain indices whose GPUs (those not in ``failed``) stay usable.
    failed
        GPU indices failed in the scenario.

    Returns
    -------
    Instance
        :func:`~ntp_opt.planners.riskaware.waitandsee.idle_instance` with
        ``failed`` and every GPU outside ``usable`` unusable (still drawing
        their idle power). When :func:`domain_limit` applies, the recourse of
        every plan whose domains lie in ``usable`` is feasible here.
    """
    a = instance.arrays
    keep = np.zeros(a.n_domains, dtype=bool)
    keep[np.asarray(usable, dtype=np.int64)] = True
    mask = ~keep[a.gpu_domain]
    mask[np.asarray(failed, dtype=np.int64)] = True
    return idle_instance(instance, mask)


@dataclass
class _Option:
    scenario: int
    domains: tuple[int, ...]  # T: the affected domains in D
    key: object  # None: uncoupled (value U_s, no constraint)
    dead: tuple[int, ...] = ()  # the domains of T left without a stage's worth of GPUs
    lost: int = 0  # replicas those take down at least (classes of ``dead``)
    degraded: tuple[int, ...] = ()  # no dead domain: the live domains of T
    groups: int = 0  # replicas those lie in at least (classes of ``degraded``)
    limit: int = 0  # the most GPUs a stage of those replicas may keep


def domain_bound(
    instance: Instance,
    scenarios: Scenarios,
    scenario_bounds: np.ndarray,
    *,
    deadline: float | None = None,
    seed: int = 0,
    threads: int = 1,
    cancel: threading.Event | None = None,
    min_nominal: float | None = None,
) -> DomainBound | None:
    """Upper bound on ``sum_s w_s G(P, s)`` over every plan (module docstring).

    Parameters
    ----------
    instance
        The instance.
    scenarios
        The scenarios and weights.
    scenario_bounds
        ``U_s`` per scenario: a proven bound on each scenario's optimum (e.g.
        :attr:`WaitAndSee.scenario_bounds`); options not solved count with it.
    deadline
        ``time.perf_counter()`` value by which to stop (``None``: no limit).
    seed, threads
        Passed to the exact planner and to the master's CP-SAT.
    cancel
        Once set, no further program is solved; the bound so far is returned.
    min_nominal
        The least nominal goodput a plan may have (the planner's
        ``nominal_tolerance``): the bound is then over those plans only, and
        :func:`power_cap` may lower the restricted instances' ``max_boost``.
        ``None``: over every plan, no cap.

    Returns
    -------
    DomainBound or None
        ``None`` when the bound does not apply (:func:`domain_limit`).
    """
    k = domain_limit(instance)
    if k is None:
        return None
    clock = Deadline(Control("risk-aware", None, cancel), deadline)
    cap = _power_cap(instance, min_nominal, clock, seed, threads)
    options, per_scenario, affected = _scenario_options(instance, scenarios, k)
    search = _Coupling(
        instance,
        scenarios,
        np.asarray(scenarios.weights, dtype=float),
        np.asarray(scenario_bounds, dtype=float),
        k,
        {} if cap is None else {"max_boost": cap - 1.0},
        clock,
        seed,
        threads,
        options,
        per_scenario,
        affected,
    )
    best = search.run()
    return DomainBound(
        bound=best,
        domains=k,
        chosen=search.chosen,
        options=len(options),
        solved=search.solved,
        proven=search.proven,
        masters=search.masters,
        limit_hit=search.limit_hit,
        power_cap=cap,
    )


def _power_cap(
    instance: Instance, min_nominal: float | None, clock: Deadline, seed: int, threads: int
) -> float | None:
    """:func:`power_cap` within its share of the time left (``None``: no ``min_nominal``)."""
    if min_nominal is None or clock.stopped():
        return None
    left = clock.remaining()
    return power_cap(
        instance,
        min_nominal,
        time_limit=None if left is None else CAP_SHARE * left,
        seed=seed,
        threads=threads,
        control=clock.control,
    )


def _usable(instance: Instance) -> list[int]:
    """The domains with a healthy GPU."""
    a = instance.arrays
    return [d for d in range(a.n_domains) if a.healthy[a.domain_gpus[d]].any()]


def _scenario_options(
    instance: Instance, scenarios: Scenarios, k: int
) -> tuple[list[_Option], list[list[int]], list[tuple[int, ...]]]:
    """The master's options, each scenario's options and each scenario's affected domains."""
    a = instance.arrays
    job = instance.job
    grouped = _grouped(instance)
    assert job.dp_max is not None  # domain_limit applies
    # the padding then forms whole groups of pp (their partners are padding)
    degrade = grouped and _alike(instance, _usable(instance)) and k == job.pp * job.dp_max
    options: list[_Option] = []
    per_scenario: list[list[int]] = []
    affected: list[tuple[int, ...]] = []
    for s, gpus in enumerate(scenarios.gpus):
        g = np.asarray(gpus, dtype=np.int64)
        g = g[a.healthy[g]]
        dom = tuple(int(d) for d in np.unique(a.gpu_domain[g]))
        affected.append(dom)
        mine: list[int] = []
        if len(dom) > MAX_AFFECTED:
            mine.append(len(options))
            options.append(_Option(s, (), None))
        else:
            alive = {}
            for d in dom:
                dg = a.domain_gpus[d]
                alive[d] = dg[a.healthy[dg] & ~np.isin(dg, g)]
            for size in range(min(len(dom), k) + 1):
                for t in combinations(dom, size):
                    _add_options(instance, s, t, alive, grouped, degrade, options, mine)
        per_scenario.append(mine)
    return options, per_scenario, affected


def _add_options(
    instance: Instance,
    s: int,
    t: tuple[int, ...],
    alive: dict[int, np.ndarray],
    grouped: bool,
    degrade: bool,
    options: list[_Option],
    mine: list[int],
) -> None:
    """Append scenario ``s``'s options with ``T = t`` to ``options`` (their indices to ``mine``)."""
    job = instance.job
    prof = tuple(sorted(_profile(instance, alive[d]) for d in t))
    dead = tuple(d for d in t if grouped and len(alive[d]) < job.min_tp)
    m = len(dead)
    if degrade and t and m == 0:
        # the replicas of the degraded domains: each partner
        # keeps at most the most GPUs one of them has left
        limit = max(len(alive[d]) for d in t)
        for groups in range(-(-len(t) // job.pp), len(t) + 1):
            mine.append(len(options))
            key = (prof, 0, groups)
            options.append(_Option(s, t, key, (), 0, t, groups, limit))
        return
    for lost in range(-(-m // job.pp), m + 1):
        mine.append(len(options))
        options.append(_Option(s, t, (prof, lost, 0), dead, lost))


@dataclass
class _Coupling:
    """:func:`domain_bound`'s loop: master programs, and the options their optima use solved."""

    instance: Instance
    scenarios: Scenarios
    weights: np.ndarray
    caps: np.ndarray  # U_s
    k: int
    updates: dict[str, object]  # to the job of every restricted instance
    clock: Deadline
    seed: int
    threads: int
    options: list[_Option]
    per_scenario: list[list[int]]
    affected: list[tuple[int, ...]]
    values: dict[object, float] = field(default_factory=dict)
    solved: int = 0
    proven: int = 0
    masters: int = 0
    limit_hit: bool = False
    chosen: tuple[int, ...] = ()
    usable: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.usable = _usable(self.instance)

    def value(self, o: _Option) -> float:
        """The option's value: its restricted instance's bound if known, at most ``U_s``."""
        v = self.values.get(o.key, math.inf) if o.key is not None else math.inf
        return float(min(v, self.caps[o.scenario]))

    def run(self) -> float:
        """Master programs until their optimum uses only known values: the bound."""
        best = float(np.dot(self.weights, self.caps))
        fresh_values = True  # values changed since the last master
        while fresh_values and not self.clock.control.cancelled:
            left = self.clock.remaining()
            if left is not None and left <= 0:
                self.limit_hit = True
                if self.masters > 0:  # one last master (short) uses what was solved
                    left = MASTER_MIN / MASTER_SHARE
            values = [self.value(o) for o in self.options]
            top = max(values)  # the objective scaled to SCALE
            ub, z, picked = domain_master(
                self.options,
                self.per_scenario,
                self.affected,
                self.usable,
                self.k,
                self.instance.job.pp,
                self.weights,
                values,
                None if left is None else MASTER_SHARE * left,
                self.seed,
                SCALE / top if top > 0 else 1.0,
            )
            self.masters += 1
            fresh_values = False
            if ub < best or not self.chosen:
                best, self.chosen = min(best, ub), z
            if self.clock.stopped():
                self.limit_hit = True
                break
            todo = self._todo(picked)
            if not todo:
                break
            fresh_values = self._solve(todo)
        return best

    def _todo(self, picked: list[int]) -> dict[object, tuple[float, _Option]]:
        """The options ``picked`` whose value is unknown, by key, with their total weight."""
        todo: dict[object, tuple[float, _Option]] = {}
        for i in picked:
            o = self.options[i]
            if o.key is not None and o.key not in self.values:
                w, _ = todo.get(o.key, (0.0, o))
                todo[o.key] = (w + float(self.weights[o.scenario]), o)
        return todo

    def _solve(self, todo: dict[object, tuple[float, _Option]]) -> bool:
        """Solve the options of ``todo``, heaviest first; whether a value was found."""
        values, seed, threads, control = self.values, self.seed, self.threads, self.clock.control
        fresh_values = False
        for n_left, (_, o) in enumerate(sorted(todo.values(), key=lambda x: -x[0]), start=0):
            if self.clock.stopped():
                self.limit_hit = True
                break
            inst = self._instance(o)
            if inst is None:  # the replicas of the dead domains are all gone
                values[o.key] = 0.0
                fresh_values = True
                continue
            share = solve_share(self.clock, len(todo) - n_left)
            out = bound_solve(inst, share, seed, threads, control)
            self.limit_hit = self.limit_hit or out.limit != Limit.NONE
            values[o.key] = out.bound if out.bound is not None else capacity_bound(inst)
            fresh_values = True
            self.solved += 1
            self.proven += int(out.proven)
        return fresh_values

    def _instance(self, o: _Option) -> Instance | None:
        """The restricted instance of option ``o`` (``None``: no replica is left)."""
        a = self.instance.arrays
        job = self.instance.job
        s = o.scenario
        dom = self.affected[s]
        fresh = [d for d in self.usable if d not in dom][: self.k - len(o.domains)]
        live = [d for d in o.domains if d not in o.dead]
        failed = np.asarray(self.scenarios.gpus[s], dtype=np.int64)
        if o.groups:  # the partners keep `limit` GPUs, the others draw idle
            partners = fresh[: o.groups * job.pp - len(o.degraded)]
            extra = [a.domain_gpus[d][a.healthy[a.domain_gpus[d]]][o.limit :] for d in partners]
            failed = np.concatenate([failed, *extra]).astype(np.int64)
        inst = restricted_instance(self.instance, np.array([*live, *fresh], dtype=np.int64), failed)
        change = dict(self.updates)
        if o.lost > 0:  # the replicas of the dead domains are gone
            replicas = job.replicas_max - o.lost
            if replicas <= 0:
                return None
            change["dp_max"] = replicas
        if change:
            inst = Instance(inst.name, inst.cluster, job.model_copy(update=change), inst.meta)
        return inst
