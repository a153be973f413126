"""Failures over time (docs/model.md, spec section 5): failure traces and their replay.

* :func:`generate_trace` draws a :class:`Trace`, a time-ordered list of
  failure and repair events, from the Llama 3 failure rates.
* :func:`simulate` replays a trace under one policy, re-planning from scratch
  with :func:`ntp_opt.solve` at every event, and returns a :class:`SimResult`
  with the time-averaged relative goodput and the paused hours.
* :func:`spares_search` finds the fewest spare domains for which a policy
  never stalls (pauses, or falls below a goodput threshold) on a trace drawn
  on the largest cluster and restricted (:func:`restrict_trace`) to smaller
  ones; :func:`spares_needed` draws the trace and asks it about pauses.

The choices the spec left open are recorded in ``docs/simulation.md``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ntp_opt.model.failures import failed_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.solve import POLICIES, Result, solve

__all__ = [
    "LLAMA3_HARDWARE_SHARE",
    "LLAMA3_RATE_PER_GPU_DAY",
    "PRUNES",
    "Event",
    "SimResult",
    "SimStep",
    "SparesResult",
    "Trace",
    "generate_trace",
    "interchangeable_domains",
    "restrict_trace",
    "simulate",
    "spares_needed",
    "spares_search",
]

#: 419 unexpected interruptions in 54 days on 16,384 H100 (Llama 3 report).
LLAMA3_RATE_PER_GPU_DAY = 4.7e-4
#: Share of those interruptions that were hardware (repair 3-5 days).
LLAMA3_HARDWARE_SHARE = 0.78

EventKind = Literal["fail", "repair"]
Cause = Literal["hardware", "software"]


@dataclass(frozen=True)
class Event:
    """One failure or repair.

    Attributes
    ----------
    t_hours
        Time from the start of the trace, in hours.
    kind
        ``"fail"`` or ``"repair"``.
    gpu_ids
        The GPUs that go down or come back (a repair lists exactly the GPUs
        its failure took down).
    cause
        ``"hardware"`` or ``"software"`` (a repair carries its failure's cause).
    """

    t_hours: float
    kind: EventKind
    gpu_ids: tuple[Hashable, ...]
    cause: Cause

    def __post_init__(self) -> None:
        if self.kind not in ("fail", "repair"):
            raise ValueError(f"event kind must be 'fail' or 'repair', got {self.kind!r}")
        if self.cause not in ("hardware", "software"):
            raise ValueError(f"event cause must be 'hardware' or 'software', got {self.cause!r}")
        if not (math.isfinite(self.t_hours) and self.t_hours >= 0):
            raise ValueError(f"event time must be finite and >= 0, got {self.t_hours!r}")
        if not self.gpu_ids:
            raise ValueError("an event needs at least one GPU")
        object.__setattr__(self, "gpu_ids", tuple(self.gpu_ids))


@dataclass(frozen=True)
class Trace:
    """A failure trace: events in time order over ``[0, horizon_hours]``.

    Events at equal times are applied together, in list order. The trace is
    checked on construction: times inside the horizon and non-decreasing, no
    GPU failed while down, no GPU repaired while up.

    Attributes
    ----------
    events
        The events.
    horizon_hours
        Length of the trace in hours.
    meta
        How the trace was made (the arguments of :func:`generate_trace`).
    """

    events: tuple[Event, ...]
    horizon_hours: float
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        if not (math.isfinite(self.horizon_hours) and self.horizon_hours > 0):
            raise ValueError(f"horizon_hours must be finite and > 0, got {self.horizon_hours!r}")
        down: set[Hashable] = set()
        last = 0.0
        for i, e in enumerate(self.events):
            if e.t_hours < last or e.t_hours > self.horizon_hours:
                raise ValueError(
                    f"event {i} at {e.t_hours} h is out of order or beyond the horizon"
                )
            last = e.t_hours
            ids = set(e.gpu_ids)
            if len(ids) != len(e.gpu_ids):
                raise ValueError(f"event {i} lists a GPU twice")
            if e.kind == "fail":
                if ids & down:
                    raise ValueError(
                        f"event {i} fails GPUs already down: {sorted(map(str, ids & down))}"
                    )
                down |= ids
            else:
                if ids - down:
                    raise ValueError(
                        f"event {i} repairs GPUs that are up: {sorted(map(str, ids - down))}"
                    )
                down -= ids

    @property
    def failures(self) -> tuple[Event, ...]:
        """The failure events."""
        return tuple(e for e in self.events if e.kind == "fail")

    @property
    def repairs(self) -> tuple[Event, ...]:
        """The repair events."""
        return tuple(e for e in self.events if e.kind == "repair")


def generate_trace(
    instance: Instance,
    *,
    days: float,
    seed: int = 0,
    rate_per_gpu_day: float = LLAMA3_RATE_PER_GPU_DAY,
    multiplier: float = 1.0,
    hardware_share: float = LLAMA3_HARDWARE_SHARE,
    hw_repair_days: tuple[float, float] = (3.0, 5.0),
    sw_repair_hours: float = 3.0,
    unit: Literal["gpu", "tray"] = "gpu",
) -> Trace:
    """Draw a failure trace for ``instance`` over ``days`` days.

    Every GPU that is up fails as a Poisson process of rate
    ``rate_per_gpu_day * multiplier``; a GPU that is down (failed in the
    instance, or failed earlier in the trace and not yet repaired) does not
    fail. A failure is hardware with probability ``hardware_share`` and is
    repaired after a uniform ``hw_repair_days`` days, otherwise software,
    repaired after ``sw_repair_hours`` hours. With ``unit="tray"`` a failure
    takes down every GPU of the failing GPU's tray that is up, and they come
    back together. GPUs failed in the instance itself stay down throughout
    and never appear in the trace. Repairs after the horizon are left out.

    The simulation is exact (event by event, memoryless): the next failure
    comes after an exponential gap of rate ``rate * n_up`` unless a repair
    comes first, and hits a uniformly chosen up GPU. Deterministic by
    ``seed`` (``numpy.random.default_rng``).
    """
    if not (math.isfinite(days) and days > 0):
        raise ValueError(f"days must be finite and > 0, got {days!r}")
    if not (rate_per_gpu_day >= 0 and multiplier >= 0):
        raise ValueError("rate_per_gpu_day and multiplier must be >= 0")
    if not 0.0 <= hardware_share <= 1.0:
        raise ValueError(f"hardware_share must lie in [0, 1], got {hardware_share!r}")
    lo, hi = hw_repair_days
    if not 0 < lo <= hi or not sw_repair_hours > 0:
        raise ValueError("repair durations must be positive (hw_repair_days as (lo, hi), lo <= hi)")
    if unit not in ("gpu", "tray"):
        raise ValueError(f"unit must be 'gpu' or 'tray', got {unit!r}")
    a = instance.arrays
    rng = np.random.default_rng(seed)
    horizon = float(days) * 24.0
    rate_h = rate_per_gpu_day * multiplier / 24.0  # per up GPU per hour

    up = np.asarray(a.healthy, dtype=bool).copy()
    # Position of every up GPU in a dense list, for O(1) uniform choice and removal.
    pool: list[int] = [int(i) for i in np.flatnonzero(up)]
    where: dict[int, int] = {g: k for k, g in enumerate(pool)}

    def take(g: int) -> None:
        k = where.pop(g)
        last = pool.pop()
        if last != g:
            pool[k] = last
            where[last] = k

    def give(g: int) -> None:
        where[g] = len(pool)
        pool.append(g)

    tray_members: dict[int, list[int]] = {}
    if unit == "tray":
        for g in range(a.n_gpus):
            tray_members.setdefault(int(a.gpu_tray[g]), []).append(g)

    events: list[Event] = []
    repairs: list[tuple[float, int, tuple[int, ...], Cause]] = []  # heap
    t = 0.0
    seq = 0
    while True:
        total = rate_h * len(pool)
        gap = rng.exponential(1.0 / total) if total > 0 else math.inf
        t_fail = t + gap
        if repairs and repairs[0][0] <= t_fail:
            t_rep, _, gpus, rep_cause = heapq.heappop(repairs)
            if t_rep > horizon:
                break
            for g in gpus:
                up[g] = True
                give(g)
            events.append(Event(t_rep, "repair", tuple(a.gpu_ids[g] for g in gpus), rep_cause))
            t = t_rep  # memoryless: the pending failure gap is redrawn
            continue
        if t_fail > horizon:
            break
        t = t_fail
        hit = pool[int(rng.integers(len(pool)))]
        if unit == "tray":
            gpus = tuple(g for g in tray_members[int(a.gpu_tray[hit])] if up[g])
        else:
            gpus = (hit,)
        hardware = bool(rng.random() < hardware_share)
        cause: Cause = "hardware" if hardware else "software"
        duration = float(rng.uniform(lo, hi)) * 24.0 if hardware else float(sw_repair_hours)
        for g in gpus:
            up[g] = False
            take(g)
        events.append(Event(t, "fail", tuple(a.gpu_ids[g] for g in gpus), cause))
        heapq.heappush(repairs, (t + duration, seq, gpus, cause))
        seq += 1
    meta = {
        "days": days,
        "seed": seed,
        "rate_per_gpu_day": rate_per_gpu_day,
        "multiplier": multiplier,
        "hardware_share": hardware_share,
        "hw_repair_days": (lo, hi),
        "sw_repair_hours": sw_repair_hours,
        "unit": unit,
    }
    return Trace(tuple(events), horizon, meta)


@dataclass(frozen=True)
class SimStep:
    """One piece of the piecewise-constant goodput.

    The state holds from ``t_hours`` until the next step (or the horizon).
    """

    t_hours: float
    relative_goodput: float
    failed_gpus: int
    """GPUs down in the trace at this time (not counting those failed in the instance)."""
    plan: Plan | None
    status: str
    """The planner's status (``infeasible`` / ``no_solution`` count as goodput 0)."""


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`.

    Attributes
    ----------
    policy
        The planner name.
    horizon_hours
        Length of the trace.
    mean_relative_goodput
        Time average of the relative goodput over the horizon.
    paused_hours
        Hours with relative goodput 0 (the paused job, or no plan).
    replans
        Re-plans: the start plus one per distinct event time.
    solves
        Calls to :func:`ntp_opt.solve` (re-plans of a state already seen are
        taken from the cache).
    steps
        The per-event series.
    """

    policy: str
    horizon_hours: float
    mean_relative_goodput: float
    paused_hours: float
    replans: int
    solves: int
    steps: tuple[SimStep, ...]

    @property
    def times(self) -> np.ndarray:
        """Start time of every step, in hours."""
        return np.array([s.t_hours for s in self.steps], dtype=float)

    @property
    def relative_goodputs(self) -> np.ndarray:
        """Relative goodput of every step."""
        return np.array([s.relative_goodput for s in self.steps], dtype=float)


def _state_instance(instance: Instance, down: Iterable[int]) -> Instance:
    mask = np.zeros(instance.arrays.n_gpus, dtype=bool)
    mask[list(down)] = True
    return failed_instance(instance, mask) if mask.any() else instance


def simulate(
    instance: Instance,
    trace: Trace,
    policy: str,
    *,
    time_limit: float = 5.0,
    solver: Callable[..., Result] = solve,
) -> SimResult:
    """Replay ``trace`` on ``instance`` under ``policy``.

    At the start and at every distinct event time the job is re-planned from
    scratch with ``solve(current_instance, policy, time_limit=time_limit)``;
    the relative goodput of the plan holds until the next event. Plans are
    cached by the set of GPUs down, so a state seen before is not solved
    again. A planner returning no plan (an infeasible power budget) counts as
    paused.

    Re-planning that limits migration from the previous plan is not done: a
    re-plan may move every replica. ``solver`` replaces :func:`ntp_opt.solve`
    (same signature), e.g. to count or instrument calls.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    _check_trace(instance, trace)
    cache: dict[frozenset[int], tuple[float, Plan | None, str]] = {}
    steps = []
    for t, down in _trace_states(instance, trace):
        if down not in cache:
            res = solver(_state_instance(instance, down), policy, time_limit=time_limit)
            if res.limit == "interrupted":  # Ctrl-C: stop the whole simulation
                raise KeyboardInterrupt
            g = res.relative_objective if res.plan is not None else None
            cache[down] = (float(g) if g is not None else 0.0, res.plan, str(res.status))
        g, plan, status = cache[down]
        steps.append(SimStep(t, g, len(down), plan, status))
    horizon = trace.horizon_hours
    area = 0.0
    paused = 0.0
    for k, s in enumerate(steps):
        end = steps[k + 1].t_hours if k + 1 < len(steps) else horizon
        area += s.relative_goodput * (end - s.t_hours)
        if s.relative_goodput <= 0.0:
            paused += end - s.t_hours
    return SimResult(
        policy=policy,
        horizon_hours=horizon,
        mean_relative_goodput=area / horizon,
        paused_hours=paused,
        replans=len(steps),
        solves=len(cache),
        steps=tuple(steps),
    )


# ---------------------------------------------------------------- spares

#: Ways :func:`spares_search` may skip states (see its docstring).
Prune = Literal["none", "maximal", "symmetric"]
PRUNES: tuple[str, ...] = ("none", "maximal", "symmetric")
#: Relative slack when comparing a relative goodput with a threshold.
_STALL_TOL = 1e-9


def restrict_trace(trace: Trace, gpu_ids: Iterable[Hashable]) -> Trace:
    """The trace as seen by a sub-cluster that holds only ``gpu_ids``.

    Every event keeps the GPUs of ``gpu_ids`` it names; events left with none
    are dropped. :func:`generate_trace` fails every GPU independently, so the
    restriction of a trace drawn on a cluster is distributed like a trace drawn
    on the sub-cluster (with ``unit="tray"`` too, when the sub-cluster holds
    whole trays). Drawing one trace on the largest cluster and restricting it
    therefore *couples* the traces of smaller clusters: the GPUs they share
    fail at the same times.

    Parameters
    ----------
    trace
        The trace.
    gpu_ids
        GPU node ids of the sub-cluster.

    Returns
    -------
    Trace
        Same horizon; ``meta`` gains ``"restricted_to"`` (the number of GPU ids).
    """
    keep = set(gpu_ids)
    events = []
    for e in trace.events:
        ids = tuple(g for g in e.gpu_ids if g in keep)
        if ids:
            events.append(Event(e.t_hours, e.kind, ids, e.cause))
    meta = dict(trace.meta)
    meta["restricted_to"] = len(keep)
    return Trace(tuple(events), trace.horizon_hours, meta)


def interchangeable_domains(instance: Instance) -> str | None:
    """Why the domains of ``instance`` are not interchangeable, or ``None`` if they are.

    Interchangeable: every domain has the same number of GPUs, is a rack of its
    own (one domain per rack, equal rack budgets), and every GPU is healthy with
    the same speed, TDP, ``max_power_w`` and ``p_fail`` (and every tray the same
    ``p_fail``).
    Then any permutation of the domains, and of the GPUs inside a domain, maps
    the cluster onto itself for every planner that sees a domain only through
    its count of healthy GPUs (every policy of :data:`ntp_opt.solve.POLICIES`),
    so a state of failures matters only through its sorted per-domain counts of
    down GPUs. The paper's NVL32 cluster is such a cluster.
    """
    a = instance.arrays
    if a.n_gpus == 0:
        return "the cluster has no GPU"
    if len({len(m) for m in a.domain_gpus}) > 1:
        return "domains differ in size"
    if not bool(a.healthy.all()):
        return "some GPUs are failed in the instance"
    for name, arr in (
        ("speed", a.speed),
        ("tdp_w", a.tdp),
        ("max_power_w", a.max_power),
        ("p_fail", a.p_fail),
    ):
        if not bool(np.all(arr == arr[0])):
            return f"GPUs differ in {name}"
    if len(a.tray_p_fail) and not bool(np.all(a.tray_p_fail == a.tray_p_fail[0])):
        return "trays differ in p_fail"
    pairs = {(int(d), int(r)) for d, r in zip(a.gpu_domain, a.gpu_rack, strict=True)}
    if len(pairs) != a.n_domains or len({r for _, r in pairs}) != a.n_domains:
        return "racks and domains are not one to one"
    if len(a.rack_ids) != a.n_domains or not bool(np.all(a.rack_budget == a.rack_budget[0])):
        return "racks differ in power budget (or some rack holds no domain)"
    return None


@dataclass(frozen=True)
class SparesResult:
    """Outcome of :func:`spares_search`.

    Attributes
    ----------
    policy
        The planner name.
    spares
        Fewest spare domains (``0 .. max_spares``) with which the policy never
        stalls on the trace; ``None`` when it stalls even with ``max_spares``.
    max_spares
        Largest number of spare domains tried.
    min_relative_goodput
        The stall threshold (0: only a paused job stalls).
    probes
        Every number of spares tried, and whether the policy ran the whole
        trace without a stall with it.
    binding
        ``(t_hours, relative_goodput)`` of a state that stalls with
        ``spares - 1`` spares (why one fewer is not enough), or with
        ``max_spares`` when ``spares`` is ``None``; ``None`` when ``spares``
        is 0.
    states
        Distinct states of failures in the trace (on ``build(max_spares)``).
    planned
        Calls to the planner (states of failures planned, all probes together).
    """

    policy: str
    spares: int | None
    max_spares: int
    min_relative_goodput: float
    probes: dict[int, bool]
    binding: tuple[float, float] | None
    states: int
    planned: int


def _check_trace(instance: Instance, trace: Trace) -> None:
    a = instance.arrays
    index = a.gpu_index
    for e in trace.events:
        bad = [g for g in e.gpu_ids if g not in index or not a.healthy[index[g]]]
        if bad:
            raise ValueError(
                f"trace event at {e.t_hours} h names GPUs that are unknown or failed "
                f"in the instance: {', '.join(map(str, bad[:5]))}"
            )


def _trace_states(instance: Instance, trace: Trace) -> list[tuple[float, frozenset[int]]]:
    """``(time, GPUs down)`` at the start and after every distinct event time."""
    index = instance.arrays.gpu_index
    by_time: dict[float, list[Event]] = {}
    for e in trace.events:
        by_time.setdefault(e.t_hours, []).append(e)
    down: set[int] = set()
    states = []
    for t in sorted(by_time.keys() | {0.0}):
        for e in by_time.get(t, []):
            ids = {index[g] for g in e.gpu_ids}
            if e.kind == "fail":
                down.update(ids)
            else:
                down.difference_update(ids)
        states.append((t, frozenset(down)))
    return states


def _signature(instance: Instance, down: frozenset[int]) -> tuple[int, ...]:
    """Per-domain counts of down GPUs, largest first, domains with none left out."""
    if not down:
        return ()
    counts = np.bincount(instance.arrays.gpu_domain[list(down)])
    return tuple(sorted((int(c) for c in counts if c > 0), reverse=True))


def _dominated(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    return len(small) <= len(big) and all(x <= y for x, y in zip(small, big, strict=False))


def _candidates(
    instance: Instance, states: list[tuple[float, frozenset[int]]], prune: str
) -> list[tuple[float, frozenset[int], Hashable]]:
    """The states to plan, as ``(time, down set, cache key)``, most GPUs down first."""
    out: list[tuple[float, frozenset[int], Hashable]] = []
    if prune == "symmetric":
        first: dict[tuple[int, ...], tuple[float, frozenset[int]]] = {}
        for t, down in states:
            first.setdefault(_signature(instance, down), (t, down))
        kept: list[tuple[int, ...]] = []
        for sig in sorted(first, key=lambda s: (-sum(s), s)):
            if not any(_dominated(sig, k) for k in kept):
                kept.append(sig)
        out = [(*first[sig], sig) for sig in kept]
    else:
        seen: dict[frozenset[int], float] = {}
        for i, (t, down) in enumerate(states):
            if prune == "maximal" and i + 1 < len(states) and down <= states[i + 1][1]:
                continue  # the next state has every failure of this one
            seen.setdefault(down, t)
        sets = sorted(seen, key=lambda d: (-len(d), seen[d]))
        if prune == "maximal":
            maximal: list[frozenset[int]] = []
            for d in sets:
                if not any(d < m for m in maximal):
                    maximal.append(d)
            sets = maximal
        out = [(seen[d], d, d) for d in sets]
    out.sort(key=lambda c: (-len(c[1]), c[0]))
    return out


def spares_search(
    build: Callable[[int], Instance],
    trace: Trace,
    policy: str,
    *,
    max_spares: int,
    min_relative_goodput: float = 0.0,
    time_limit: float = 5.0,
    prune: Prune = "none",
    start: int = 0,
    solver: Callable[..., Result] = solve,
) -> SparesResult:
    """Fewest spare domains for which ``policy`` never stalls on ``trace``.

    ``build(k)`` returns the instance with ``k`` spare domains (for example a
    cluster of ``dp * pp + k`` domains for the same job); its GPU ids must be
    among those of ``build(max_spares)``, on which ``trace`` is drawn. With
    ``k`` spares the policy sees :func:`restrict_trace` of ``trace`` to
    ``build(k)``, so every ``k`` faces the same failures on the GPUs it shares
    with the others (spares fail too).

    A state *stalls* when the planner's relative goodput is 0 (the job pauses,
    or there is no plan) or below ``min_relative_goodput``; the policy never
    stalls with ``k`` spares when no state of the restricted trace stalls.

    The search assumes that more spares never hurt (if ``k`` spares suffice,
    so do ``k + 1``): from ``k = start`` it steps up (``start + 1, + 2, + 4,
    ...``, at most ``max_spares``) until one suffices, or down (``start - 1,
    - 2, - 4, ...``) while they suffice, then bisects between the last ``k``
    that stalls and the first that does not, planning ``O(log |answer -
    start|)`` restricted traces; a good guess for ``start`` (e.g. the peak
    count of domains with a GPU down, for ``dp-drop``) makes it two probes.
    That more spares never hurt holds for ``dp-drop`` and for exact planners
    proven optimal (more domains only add plans, and, when ``dp_max`` grows
    with ``k``, more replicas); for the other heuristics it is an assumption,
    checked against the linear scan in the tests. A trace is planned state by
    state with early exit at the first stall, states with the most GPUs down
    first, and ``prune`` skips states that cannot stall when a state with more
    failures does not:

    * ``"none"``: plan every distinct state;
    * ``"maximal"``: plan only states whose set of GPUs down is maximal under
      inclusion (assumes failures never help: exact for ``dp-drop`` and proven
      optimal plans, an assumption for the other heuristics);
    * ``"symmetric"``: with interchangeable domains
      (:func:`interchangeable_domains`), a state is its sorted per-domain counts
      of GPUs down, and only the counts that no other state dominates
      entry by entry are planned (same assumption as ``"maximal"``).

    Parameters
    ----------
    build
        ``k -> Instance`` with ``k`` spare domains.
    trace
        Failure trace on ``build(max_spares)``.
    policy
        A name of :data:`ntp_opt.solve.POLICIES`.
    max_spares
        Largest number of spare domains to try (>= 0).
    min_relative_goodput
        Stall threshold in ``[0, inf)``; 0 (default) counts only pauses.
    time_limit
        Seconds per exact solve.
    prune
        ``"none"``, ``"maximal"`` or ``"symmetric"`` (above).
    start
        First number of spares to try (``0 .. max_spares``); any value gives
        the same answer when more spares never hurt, a close guess is faster.
    solver
        Replaces :func:`ntp_opt.solve` (same signature).

    Returns
    -------
    SparesResult

    Raises
    ------
    ValueError
        On an unknown policy or prune, a negative ``max_spares`` or threshold,
        ``start`` outside ``0 .. max_spares``,
        a trace naming GPUs unknown to (or failed in) ``build(max_spares)``,
        ``build(k)`` holding GPUs that ``build(max_spares)`` lacks, or
        ``prune="symmetric"`` on a cluster whose domains are not
        interchangeable.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if prune not in PRUNES:
        raise ValueError(f"prune must be one of {', '.join(PRUNES)}, got {prune!r}")
    if not (isinstance(max_spares, int) and max_spares >= 0):
        raise ValueError(f"max_spares must be an integer >= 0, got {max_spares!r}")
    if not (isinstance(start, int) and 0 <= start <= max_spares):
        raise ValueError(f"start must be an integer in [0, max_spares={max_spares}], got {start!r}")
    thr = float(min_relative_goodput)
    if not (math.isfinite(thr) and thr >= 0):
        raise ValueError(f"min_relative_goodput must be finite and >= 0, got {thr!r}")
    big = build(max_spares)
    _check_trace(big, trace)
    instances: dict[int, Instance] = {max_spares: big}
    cache: dict[tuple[int, Hashable], float] = {}
    probes: dict[int, bool] = {}
    stall_at: dict[int, tuple[float, float]] = {}

    def instance_for(k: int) -> Instance:
        if k not in instances:
            inst = build(k)
            extra = [g for g in inst.arrays.gpu_ids if g not in big.arrays.gpu_index]
            if extra:
                raise ValueError(
                    f"build({k}) has GPUs that build({max_spares}) lacks: "
                    f"{', '.join(map(str, extra[:5]))}"
                )
            if prune == "symmetric":
                why = interchangeable_domains(inst)
                if why is not None:
                    raise ValueError(f"prune='symmetric' needs interchangeable domains: {why}")
            instances[k] = inst
        return instances[k]

    def runs(k: int) -> bool:
        if k in probes:
            return probes[k]
        inst = instance_for(k)
        sub = trace if k == max_spares else restrict_trace(trace, inst.arrays.gpu_ids)
        _check_trace(inst, sub)
        for t, down, key in _candidates(inst, _trace_states(inst, sub), prune):
            if (k, key) not in cache:
                res = solver(_state_instance(inst, down), policy, time_limit=time_limit)
                if res.limit == "interrupted":  # Ctrl-C: stop the whole simulation
                    raise KeyboardInterrupt
                g = res.relative_objective if res.plan is not None else None
                cache[k, key] = float(g) if g is not None else 0.0
            g = cache[k, key]
            if g <= 0.0 or g < thr * (1.0 - _STALL_TOL):
                probes[k] = False
                stall_at[k] = (t, g)
                return False
        probes[k] = True
        return True

    if prune == "symmetric":
        why = interchangeable_domains(big)
        if why is not None:
            raise ValueError(f"prune='symmetric' needs interchangeable domains: {why}")
    n_states = len({d for _, d in _trace_states(big, trace)})
    # Exponential search from `start` (start, start + 1, start + 2, start + 4,
    # ... up to max_spares, or downwards when `start` already suffices), then
    # bisection between the last k that stalls and the first that runs. Probes
    # that stall stop at their first stalling state, so they are cheap.
    lo, hi = -1, None  # lo: a k that stalls (-1: none); hi: a k that runs
    if runs(start):
        hi, step = start, 1
        while hi - lo > 1:
            k = max(lo, hi - step)
            if k <= lo or k < 0:
                break
            if runs(k):
                hi, step = k, 2 * step
            else:
                lo = k
                break
    else:
        lo, step = start, 1
        while lo < max_spares:
            k = min(max_spares, lo + step)
            if runs(k):
                hi = k
                break
            lo, step = k, 2 * step
    answer: int | None = None
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if runs(mid):
                hi = mid
            else:
                lo = mid
        answer = hi
    binding = stall_at.get(max_spares if answer is None else answer - 1)
    return SparesResult(
        policy=policy,
        spares=answer,
        max_spares=max_spares,
        min_relative_goodput=thr,
        probes=dict(sorted(probes.items())),
        binding=binding,
        states=n_states,
        planned=len(cache),
    )


def spares_needed(
    build: Callable[[int], Instance],
    policy: str,
    *,
    days: float,
    seed: int = 0,
    max_spares: int = 8,
    time_limit: float = 5.0,
    **trace_kw: Any,
) -> int | None:
    """Fewest spare domains for which ``policy`` never pauses.

    ``build(k)`` must return the instance with ``k`` spare domains (for
    example a cluster of ``dp * pp + k`` domains for the same job, whose GPU
    ids are among those of ``build(max_spares)``). One trace is drawn on
    ``build(max_spares)`` with ``seed`` and ``trace_kw`` (spares fail too) and
    every ``k`` sees its restriction (:func:`restrict_trace`); the fewest
    ``k`` in ``0 .. max_spares`` with no paused state is returned, ``None`` if
    there is none. This is :func:`spares_search` with its defaults (search
    on ``k``, every distinct state planned); use it directly for a stall
    threshold, pruning or the details. Pausing is only possible under the
    ``fixed`` batch policy (or with power budgets below the idle draw).
    """
    trace = generate_trace(build(max_spares), days=days, seed=seed, **trace_kw)
    return spares_search(build, trace, policy, max_spares=max_spares, time_limit=time_limit).spares
