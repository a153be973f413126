"""Failure traces (docs/model.md, spec section 5): :class:`Event`, :class:`Trace`, drawing them.

* :func:`generate_trace` draws a :class:`Trace`, a time-ordered list of
  failure and repair events, from the Llama 3 failure rates.
* :func:`restrict_trace` restricts a trace drawn on a large cluster to a smaller one.
* :func:`state_instance` is the instance with a set of GPUs down.

The choices the spec left open are recorded in ``docs/simulation.md``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ntp_opt.model.failures import failed_instance
from ntp_opt.model.instance import ClusterArrays, Instance

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
    _check_trace_args(
        days, rate_per_gpu_day, multiplier, hardware_share, hw_repair_days, sw_repair_hours, unit
    )
    lo, hi = hw_repair_days
    draw = _Draw(
        horizon=float(days) * 24.0,
        rate_h=rate_per_gpu_day * multiplier / 24.0,  # per up GPU per hour
        hardware_share=hardware_share,
        hw_repair_days=(lo, hi),
        sw_repair_hours=sw_repair_hours,
        unit=unit,
    )
    events = draw.events(instance, np.random.default_rng(seed))
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
    return Trace(tuple(events), draw.horizon, meta)


def _check_trace_args(
    days: float,
    rate_per_gpu_day: float,
    multiplier: float,
    hardware_share: float,
    hw_repair_days: tuple[float, float],
    sw_repair_hours: float,
    unit: str,
) -> None:
    """Raise ``ValueError`` on an argument :func:`generate_trace` cannot use."""
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


class _UpPool:
    """The GPUs that are up, in a dense list for O(1) uniform choice and removal."""

    def __init__(self, up: np.ndarray) -> None:
        self.pool: list[int] = [int(i) for i in np.flatnonzero(up)]
        self.where: dict[int, int] = {g: k for k, g in enumerate(self.pool)}

    def take(self, g: int) -> None:
        """Remove GPU ``g`` (it goes down)."""
        k = self.where.pop(g)
        last = self.pool.pop()
        if last != g:
            self.pool[k] = last
            self.where[last] = k

    def give(self, g: int) -> None:
        """Add GPU ``g`` (it comes back up)."""
        self.where[g] = len(self.pool)
        self.pool.append(g)


@dataclass(frozen=True)
class _Draw:
    """The checked rates and durations of :func:`generate_trace` (hours)."""

    horizon: float
    rate_h: float  # failures per up GPU per hour
    hardware_share: float
    hw_repair_days: tuple[float, float]
    sw_repair_hours: float
    unit: str

    def events(self, instance: Instance, rng: np.random.Generator) -> list[Event]:
        """The events of one trace (module docstring of :func:`generate_trace`)."""
        a = instance.arrays
        up = np.asarray(a.healthy, dtype=bool).copy()
        pool = _UpPool(up)
        tray_members: dict[int, list[int]] = {}
        if self.unit == "tray":
            for g in range(a.n_gpus):
                tray_members.setdefault(int(a.gpu_tray[g]), []).append(g)
        events: list[Event] = []
        repairs: list[tuple[float, int, tuple[int, ...], Cause]] = []  # heap
        t = 0.0
        seq = 0
        while True:
            total = self.rate_h * len(pool.pool)
            gap = rng.exponential(1.0 / total) if total > 0 else math.inf
            t_fail = t + gap
            if repairs and repairs[0][0] <= t_fail:
                t_rep, _, gpus, rep_cause = heapq.heappop(repairs)
                if t_rep > self.horizon:
                    break
                for g in gpus:
                    up[g] = True
                    pool.give(g)
                events.append(Event(t_rep, "repair", tuple(a.gpu_ids[g] for g in gpus), rep_cause))
                t = t_rep  # memoryless: the pending failure gap is redrawn
                continue
            if t_fail > self.horizon:
                break
            t = t_fail
            gpus, cause, duration = self._failure(a, rng, pool, up, tray_members)
            for g in gpus:
                up[g] = False
                pool.take(g)
            events.append(Event(t, "fail", tuple(a.gpu_ids[g] for g in gpus), cause))
            heapq.heappush(repairs, (t + duration, seq, gpus, cause))
            seq += 1
        return events

    def _failure(
        self,
        a: ClusterArrays,
        rng: np.random.Generator,
        pool: _UpPool,
        up: np.ndarray,
        tray_members: dict[int, list[int]],
    ) -> tuple[tuple[int, ...], Cause, float]:
        """The GPUs one failure takes down, its cause and its repair time (hours)."""
        hit = pool.pool[int(rng.integers(len(pool.pool)))]
        if self.unit == "tray":
            gpus = tuple(g for g in tray_members[int(a.gpu_tray[hit])] if up[g])
        else:
            gpus = (hit,)
        hardware = bool(rng.random() < self.hardware_share)
        cause: Cause = "hardware" if hardware else "software"
        lo, hi = self.hw_repair_days
        duration = float(rng.uniform(lo, hi)) * 24.0 if hardware else float(self.sw_repair_hours)
        return gpus, cause, duration


def state_instance(instance: Instance, down: Iterable[int]) -> Instance:
    """Return the instance with the GPUs `down` failed.

    Parameters
    ----------
    instance : Instance
        The healthy instance.
    down : iterable of int
        Indices of the GPUs that are down.

    Returns
    -------
    Instance
        ``instance`` itself if nothing is down, else the failed instance.
    """
    mask = np.zeros(instance.arrays.n_gpus, dtype=bool)
    mask[list(down)] = True
    return failed_instance(instance, mask) if mask.any() else instance


def check_trace(instance: Instance, trace: Trace) -> None:
    """Check that every GPU a trace names is a healthy GPU of the instance.

    Parameters
    ----------
    instance : Instance
        The instance the trace is replayed on.
    trace : Trace
        The trace.

    Raises
    ------
    ValueError
        If an event names a GPU that is unknown or failed in `instance`.
    """
    a = instance.arrays
    index = a.gpu_index
    for e in trace.events:
        bad = [g for g in e.gpu_ids if g not in index or not a.healthy[index[g]]]
        if bad:
            raise ValueError(
                f"trace event at {e.t_hours} h names GPUs that are unknown or failed "
                f"in the instance: {', '.join(map(str, bad[:5]))}"
            )


def trace_states(instance: Instance, trace: Trace) -> list[tuple[float, frozenset[int]]]:
    """Return the states a trace goes through.

    Parameters
    ----------
    instance : Instance
        The instance the trace is replayed on.
    trace : Trace
        The trace.

    Returns
    -------
    list of (float, frozenset of int)
        ``(time, GPUs down)`` at the start and after every distinct event time.
    """
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
