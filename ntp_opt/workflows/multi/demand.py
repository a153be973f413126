"""Demand over time: the ``ntp-opt/demand@1`` trace file and a seeded trace generator.

A demand trace is a list of steps in time order; each step sets the demand
(requests/s) of some serving fleets from its ``time_s`` on, and may carry
cluster health events in the format of ``ntp-opt replan`` (``{"kind": "fail" |
"repair" | "speed", "nodes": [...], "speed"?}``, applied by
:func:`ntp_opt.workflows.events.apply_events`)::

    {"format": "ntp-opt/demand@1",
     "steps": [{"time_s": 0, "demand": {"chat": 300.0, "agents": 120.0}},
               {"time_s": 900, "demand": {"chat": 340.0},
                "events": [{"kind": "fail", "nodes": ["d3.t0.g1"]}]}]}

A fleet a step does not name keeps its demand (before the first step that
names it: the workloads file's ``demand``). :func:`generate_demand` draws
diurnal, bursty, ramping or flat-with-noise traces (``docs/workloads.md``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ntp_opt.model.files import (
    InputError,
    check_format,
    read_json,
    validation_problems,
    write_json,
)
from ntp_opt.model.workloads import Workloads
from ntp_opt.workflows.replan import ClusterEvent

DEMAND_FORMAT = "ntp-opt/demand@1"
#: Most steps a trace file may hold.
MAX_STEPS = 100_000
#: Trace shapes :func:`generate_demand` draws.
SHAPES: tuple[str, ...] = ("diurnal", "bursty", "ramp", "flat")
#: Fleet roles: how a fleet's demand moves in each shape (see :func:`generate_demand`).
ROLES: tuple[str, ...] = ("chat", "agent", "batch")

Shape = Literal["diurnal", "bursty", "ramp", "flat"]


class _EventData(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["fail", "repair", "speed"]
    nodes: list[str | int] = Field(min_length=1)
    speed: float | None = Field(default=None, allow_inf_nan=False)


class _StepData(BaseModel):
    model_config = ConfigDict(extra="forbid")

    time_s: float = Field(ge=0.0, le=1e10, allow_inf_nan=False)
    demand: dict[str, float] = {}
    events: list[_EventData] = []

    @model_validator(mode="after")
    def _positive(self) -> _StepData:
        for name, value in self.demand.items():
            if not (math.isfinite(value) and 1e-6 <= value <= 1e12):
                raise ValueError(f"demand of {name!r}: {value!r} must be in [1e-6, 1e12] req/s")
        return self


class _DemandFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["ntp-opt/demand@1"]
    steps: list[_StepData] = Field(min_length=1, max_length=MAX_STEPS)
    meta: dict[str, Any] = {}


@dataclass(frozen=True)
class DemandStep:
    """One step of a demand trace.

    Attributes
    ----------
    time_s
        Seconds from the start of the trace.
    demand
        Requests/s of the fleets this step changes (others keep theirs).
    events
        Cluster health events at this time, applied before planning.
    """

    time_s: float
    demand: Mapping[str, float]
    events: tuple[ClusterEvent, ...] = ()


@dataclass(frozen=True)
class DemandTrace:
    """A demand trace: steps with strictly increasing ``time_s``.

    Attributes
    ----------
    steps
        The steps.
    meta
        How the trace was made (the generator's arguments, or the file's ``meta``).
    """

    steps: tuple[DemandStep, ...]
    meta: Mapping[str, Any]

    def check_fleets(self, workloads: Workloads, source: str = "<demand>") -> None:
        """Raise :class:`InputError` (naming ``source`` and the step) if a step names a
        fleet that ``workloads`` does not have."""
        known = set(workloads.by_name())
        problems = [
            (
                f"steps[{i}].demand.{name}",
                f"no serving fleet named {name!r} (known: {sorted(known)})",
            )
            for i, s in enumerate(self.steps)
            for name in s.demand
            if name not in known
        ]
        if problems:
            raise InputError(source, problems)

    def demands(self, workloads: Workloads) -> list[dict[str, float]]:
        """Every fleet's demand at each step (unnamed fleets keep their previous demand)."""
        now = {s.name: float(s.demand) for s in workloads.serving}
        out = []
        for step in self.steps:
            now = {**now, **{k: float(v) for k, v in step.demand.items() if k in now}}
            out.append(dict(now))
        return out


def demand_from_dict(data: Any, source: str = "<demand>") -> DemandTrace:
    """Build a :class:`DemandTrace` from parsed JSON; errors name the field and ``source``."""
    check_format(data, DEMAND_FORMAT, source)
    try:
        model = _DemandFile.model_validate(data)
    except ValidationError as err:
        raise InputError(source, validation_problems(err)) from None
    problems: list[tuple[str, str]] = []
    steps = []
    last = -math.inf
    for i, s in enumerate(model.steps):
        if s.time_s <= last:
            problems.append(
                (f"steps[{i}].time_s", f"{s.time_s:g} is not after the previous step's {last:g}")
            )
        last = s.time_s
        events = []
        for k, e in enumerate(s.events):
            try:
                events.append(ClusterEvent.from_dict(e.model_dump(exclude_none=True)))
            except ValueError as err:
                problems.append((f"steps[{i}].events[{k}]", str(err)))
        steps.append(DemandStep(s.time_s, dict(s.demand), tuple(events)))
    if problems:
        raise InputError(source, problems)
    return DemandTrace(tuple(steps), dict(model.meta))


def demand_to_dict(trace: DemandTrace) -> dict[str, Any]:
    """The JSON form of ``trace``."""
    steps = []
    for s in trace.steps:
        step: dict[str, Any] = {"time_s": s.time_s, "demand": dict(s.demand)}
        if s.events:
            step["events"] = [
                {"kind": e.kind, "nodes": list(e.nodes)}
                | ({"speed": e.speed} if e.speed is not None else {})
                for e in s.events
            ]
        steps.append(step)
    return {"format": DEMAND_FORMAT, "meta": dict(trace.meta), "steps": steps}


def load_demand(path: str | os.PathLike[str]) -> DemandTrace:
    """Load a demand trace file (``.json`` or ``.json.gz``)."""
    p = Path(path)
    return demand_from_dict(read_json(p), str(p))


def save_demand(
    trace: DemandTrace,
    path: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Write ``trace`` to ``path`` atomically (never onto one of ``inputs``)."""
    write_json(demand_to_dict(trace), Path(path), inputs)


def fleet_role(name: str) -> str:
    """A fleet's role guessed from its name: ``agent`` if it contains "agent", ``batch``
    if it contains "batch" or "embed", else ``chat``."""
    low = name.lower()
    if "agent" in low:
        return "agent"
    if "batch" in low or "embed" in low:
        return "batch"
    return "chat"


#: Per role: (diurnal amplitude, peak hour, burst rate per hour, burst height, ramp end).
#: Chat follows the working day (peak 14:00, +-35 %); agents peak later with a
#: smaller swing and burst most (tool-calling loops fan out); batch work fills the
#: night (peak 02:00) and is throttled by day. A ramp grows agents 0.6x -> 1.5x
#: (a launch), chat 0.8x -> 1.2x, and shrinks batch 1.2x -> 0.7x.
ROLE_PARAMS: dict[str, tuple[float, float, float, float, float]] = {
    "chat": (0.35, 14.0, 0.5, 0.6, 1.2),
    "agent": (0.25, 16.0, 1.5, 1.0, 1.5),
    "batch": (0.30, 2.0, 0.2, 0.4, 0.7),
}
RAMP_START = {"chat": 0.8, "agent": 0.6, "batch": 1.2}


def _check_args(
    shape: str, steps: int, step_s: float, noise: float, roles: Mapping[str, str]
) -> None:
    """Raise ``ValueError`` naming the first bad argument of :func:`generate_demand`."""
    if shape not in SHAPES:
        raise ValueError(f"shape: {shape!r} is not one of {', '.join(SHAPES)}")
    if steps < 1 or not (math.isfinite(step_s) and step_s > 0):
        raise ValueError("steps must be >= 1 and step_s a positive number of seconds")
    if not (math.isfinite(noise) and 0 <= noise <= 1):
        raise ValueError(f"noise: {noise!r} must be in [0, 1]")
    for name, role in roles.items():
        if role not in ROLES:
            raise ValueError(f"roles.{name}: {role!r} is not one of {', '.join(ROLES)}")


def _bursts(
    rng: np.random.Generator, hours: np.ndarray, step_s: float, rate: float, height: float
) -> np.ndarray:
    """1 plus Poisson bursts (``rate`` per hour) of ``height * U(0.5, 1.5)``, each decaying
    with a 30-minute time constant."""
    f = np.ones(len(hours))
    horizon = float(hours[-1]) + step_s / 3600.0
    t = rng.exponential(1.0 / rate) if rate > 0 else math.inf
    while t < horizon:
        h = height * rng.uniform(0.5, 1.5)
        after = hours >= t
        f[after] += h * np.exp(-(hours[after] - t) / 0.5)
        t += rng.exponential(1.0 / rate)
    return f


def _shape_factor(
    shape: str, role: str, rng: np.random.Generator, hours: np.ndarray, step_s: float
) -> np.ndarray:
    """The shape factor of a fleet of ``role`` at each step (before the noise)."""
    amp, peak, rate, height, end = ROLE_PARAMS[role]
    steps = len(hours)
    if shape == "diurnal":
        return 1.0 + amp * np.cos(2 * math.pi * (hours % 24.0 - peak) / 24.0)
    if shape == "bursty":
        return _bursts(rng, hours, step_s, rate, height)
    if shape == "ramp":
        return np.linspace(RAMP_START[role], end, steps)
    return np.ones(steps)


def generate_demand(
    workloads: Workloads,
    shape: Shape,
    *,
    steps: int = 48,
    step_s: float = 1800.0,
    seed: int = 0,
    noise: float = 0.03,
    roles: Mapping[str, str] | None = None,
) -> DemandTrace:
    """Draw a demand trace around each fleet's ``demand`` in ``workloads``.

    Every fleet's demand at time ``t`` is its base demand (the workloads file's)
    times a shape factor times ``exp(noise * N(0, 1))`` (independent per step and
    fleet). Shape factors, with per-role parameters :data:`ROLE_PARAMS`:

    * ``diurnal``: ``1 + A cos(2 pi (h - peak) / 24)`` at hour of day ``h``;
    * ``bursty``: 1 plus bursts arriving as a Poisson process (rate per hour),
      each adding ``height * U(0.5, 1.5)`` that decays with a 30-minute time
      constant;
    * ``ramp``: linear from :data:`RAMP_START` to the ramp end over the trace;
    * ``flat``: 1 (noise only; what hysteresis must ignore).

    Parameters
    ----------
    workloads
        The fleets and their base demand.
    shape
        One of :data:`SHAPES`.
    steps, step_s
        Number of steps and seconds between them.
    seed
        Seed of ``numpy.random.default_rng``: same arguments, same trace.
    noise
        Log-normal noise ``sigma`` per step (0: none).
    roles
        Role (:data:`ROLES`) by fleet name; default :func:`fleet_role`.

    Returns
    -------
    DemandTrace
        Every step names every fleet; ``meta`` records the arguments.
    """
    _check_args(shape, steps, step_s, noise, roles or {})
    roles = dict(roles or {})
    rng = np.random.default_rng(seed)
    times = np.arange(steps) * float(step_s)
    hours = times / 3600.0
    factors: dict[str, np.ndarray] = {}
    for fleet in workloads.serving:
        role = roles.get(fleet.name, fleet_role(fleet.name))
        f = _shape_factor(shape, role, rng, hours, step_s)
        if noise > 0:
            f = f * np.exp(noise * rng.standard_normal(steps))
        factors[fleet.name] = f
    out = []
    for k in range(steps):
        demand = {
            s.name: round(max(1e-6, float(s.demand) * float(factors[s.name][k])), 3)
            for s in workloads.serving
        }
        out.append(DemandStep(float(times[k]), demand))
    meta = {
        "generator": "ntp_opt.workflows.multi.demand.generate_demand",
        "shape": shape,
        "steps": steps,
        "step_s": step_s,
        "seed": seed,
        "noise": noise,
        "roles": {s.name: roles.get(s.name, fleet_role(s.name)) for s in workloads.serving},
    }
    return DemandTrace(tuple(out), meta)
