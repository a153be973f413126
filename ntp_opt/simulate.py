"""Failures over time (MODEL.md section 5): failure traces and their replay.

* :func:`generate_trace` draws a :class:`Trace`, a time-ordered list of
  failure and repair events, from the Llama 3 failure rates.
* :func:`simulate` replays a trace under one policy, re-planning from scratch
  with :func:`ntp_opt.solve` at every event, and returns a :class:`SimResult`
  with the time-averaged relative goodput and the paused hours.
* :func:`spares_needed` finds the fewest spare domains for which a policy
  never pauses on a trace.

The choices the spec left open are recorded in ``docs/simulation.md``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .failures import failed_instance
from .instance import Instance
from .plan import Plan
from .solve import POLICIES, Result, solve

__all__ = [
    "LLAMA3_HARDWARE_SHARE",
    "LLAMA3_RATE_PER_GPU_DAY",
    "Event",
    "SimResult",
    "SimStep",
    "Trace",
    "generate_trace",
    "simulate",
    "spares_needed",
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
    a = instance.arrays
    index = a.gpu_index
    for e in trace.events:
        bad = [g for g in e.gpu_ids if g not in index or not a.healthy[index[g]]]
        if bad:
            raise ValueError(
                f"trace event at {e.t_hours} h names GPUs that are unknown or failed "
                f"in the instance: {', '.join(map(str, bad[:5]))}"
            )
    cache: dict[frozenset[int], tuple[float, Plan | None, str]] = {}
    down: set[int] = set()

    def plan_now() -> tuple[float, Plan | None, str]:
        key = frozenset(down)
        if key not in cache:
            res = solver(_state_instance(instance, key), policy, time_limit=time_limit)
            g = res.relative_objective if res.plan is not None else None
            cache[key] = (float(g) if g is not None else 0.0, res.plan, str(res.status))
        return cache[key]

    times = sorted({e.t_hours for e in trace.events} - {0.0})
    by_time: dict[float, list[Event]] = {}
    for e in trace.events:
        by_time.setdefault(e.t_hours, []).append(e)

    def apply(events: list[Event]) -> None:
        for e in events:
            ids = {index[g] for g in e.gpu_ids}
            if e.kind == "fail":
                down.update(ids)
            else:
                down.difference_update(ids)

    apply(by_time.get(0.0, []))
    steps = [SimStep(0.0, *_unpack(plan_now(), len(down)))]
    for t in times:
        apply(by_time[t])
        steps.append(SimStep(t, *_unpack(plan_now(), len(down))))
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


def _unpack(
    cached: tuple[float, Plan | None, str], failed: int
) -> tuple[float, int, Plan | None, str]:
    g, plan, status = cached
    return g, failed, plan, status


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
    example a cluster of ``dp * pp + k`` domains for the same job). For
    ``k = 0, 1, ..., max_spares`` a trace is drawn for that instance with the
    same ``seed`` and ``trace_kw`` (spares fail too, so the traces differ) and
    replayed; the first ``k`` with no paused hour is returned, ``None`` if
    there is none. Pausing is only possible under the ``fixed`` batch policy
    (or with power budgets below the idle draw).
    """
    for k in range(max_spares + 1):
        inst = build(k)
        trace = generate_trace(inst, days=days, seed=seed, **trace_kw)
        if simulate(inst, trace, policy, time_limit=time_limit).paused_hours == 0.0:
            return k
    return None
