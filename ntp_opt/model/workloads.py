"""Several workloads on one cluster: the description and the plan (issue #7, part 3).

One *training* workload (the instance's :class:`~ntp_opt.model.job.Job`, docs/model.md
goodput) shares the cluster with *serving* fleets: many small model replicas,
each one TP group of one NVLink domain. The weighted goodput of a plan is::

    W = w_T * relative_goodput_T + sum_i w_i * min(1, X_i / D_i)

where ``X_i`` is fleet ``i``'s throughput (requests/s): the sum over its
replicas of ``throughput_i[t] * (speed of the replica's slowest GPU)``, and
``D_i`` its demand. ``docs/workloads.md`` gives every rule.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan

#: Name reserved for the training workload in reports.
TRAINING = "training"


class ServingWorkload(BaseModel):
    """A fleet of identical serving replicas (one TP group each, ``pp = 1``).

    Parameters
    ----------
    name
        Unique name (not ``"training"``).
    throughput
        Allowed TP degrees and, for each, requests/s of one replica whose GPUs
        all run at speed 1.0 (a replica runs at the speed of its slowest GPU).
    demand
        Requests/s the fleet is asked for; serving more earns nothing.
    weight
        Priority weight ``w_i >= 0`` in the weighted goodput.
    min_replicas
        Smallest number of replicas a plan must give the fleet.
    min_fraction
        Smallest share of ``demand`` a plan must serve, in ``[0, 1]``.
    max_replicas
        Largest number of replicas (``None``: no limit besides the demand).
    latency_ms
        ``{TP degree: ms}``, the latency of one replica of that degree at speed
        1.0 (a replica whose slowest GPU has speed ``s`` takes ``latency_ms[t] / s``);
        every degree of ``throughput`` needs one. ``None``: not known.
    max_latency_ms
        The latency target: a replica slower than this serves nothing
        (``None``: no target; needs ``latency_ms``).
    min_tp
        Smallest TP degree whose replica holds the model's weights and KV cache;
        a replica of a smaller degree cannot run.

    Examples
    --------
    >>> s = ServingWorkload(name="chat", throughput={4: 10.0, 8: 18.0}, demand=100.0)
    >>> s.degrees
    (4, 8)
    >>> a = ServingWorkload(name="agents", throughput={2: 2.0, 4: 3.5, 8: 6.0}, demand=9.0,
    ...                     latency_ms={2: 90.0, 4: 50.0, 8: 30.0}, max_latency_ms=60.0,
    ...                     min_tp=4)
    >>> a.fitting_degrees, a.latency(4, 0.8)
    ((4, 8), 62.5)

    Whether a replica counts (the latency target, ``min_tp``) is a rule:
    :func:`ntp_opt.rules.multi.usable`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100)
    throughput: dict[int, float]
    demand: float = Field(ge=1e-6, le=1e12, allow_inf_nan=False)
    weight: float = Field(default=1.0, ge=0.0, le=1e6, allow_inf_nan=False)
    min_replicas: int = Field(default=0, ge=0, le=10_000_000)
    min_fraction: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    max_replicas: int | None = Field(default=None, ge=0, le=10_000_000)
    latency_ms: dict[int, float] | None = None
    max_latency_ms: float | None = Field(default=None, gt=0.0, le=1e9, allow_inf_nan=False)
    min_tp: int = Field(default=1, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _check(self) -> ServingWorkload:
        if self.name == TRAINING:
            raise ValueError(f"name: {TRAINING!r} is reserved for the training workload")
        if not self.throughput:
            raise ValueError(f"throughput of {self.name!r}: give at least one TP degree")
        for t, rate in self.throughput.items():
            if t < 1:
                raise ValueError(f"throughput of {self.name!r}: TP degree {t} must be >= 1")
            if not (math.isfinite(rate) and 0 < rate <= 1e12):
                raise ValueError(
                    f"throughput of {self.name!r}[{t}]: {rate!r} must be a number in (0, 1e12]"
                )
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas of {self.name!r} ({self.max_replicas}) is below "
                f"min_replicas ({self.min_replicas})"
            )
        self._check_latency()
        if self.min_tp > max(self.throughput):
            raise ValueError(
                f"min_tp of {self.name!r}: {self.min_tp} is above every TP degree of "
                f"throughput {list(self.degrees)}: no replica can hold the model"
            )
        return self

    def _check_latency(self) -> None:
        if self.latency_ms is not None:
            missing = sorted(set(self.throughput) - set(self.latency_ms))
            extra = sorted(set(self.latency_ms) - set(self.throughput))
            if missing or extra:
                raise ValueError(
                    f"latency_ms of {self.name!r}: give one latency per TP degree of "
                    f"throughput {list(self.degrees)}"
                    + (f"; missing {missing}" if missing else "")
                    + (f"; not in throughput {extra}" if extra else "")
                )
            for t, ms in self.latency_ms.items():
                if not (math.isfinite(ms) and 0 < ms <= 1e9):
                    raise ValueError(
                        f"latency_ms of {self.name!r}[{t}]: {ms!r} must be a number in (0, 1e9]"
                    )
        if self.max_latency_ms is not None and self.latency_ms is None:
            raise ValueError(
                f"max_latency_ms of {self.name!r}: a latency target needs latency_ms "
                "(the latency of each TP degree)"
            )

    @property
    def degrees(self) -> tuple[int, ...]:
        """Allowed TP degrees, ascending."""
        return tuple(sorted(self.throughput))

    def rate(self, t: int, speed: float = 1.0) -> float:
        """Requests/s of one replica of degree ``t`` whose slowest GPU has ``speed``."""
        return float(self.throughput[t]) * float(speed)

    @property
    def fitting_degrees(self) -> tuple[int, ...]:
        """Allowed TP degrees that hold the model (``>= min_tp``), ascending."""
        return tuple(t for t in self.degrees if t >= self.min_tp)

    def latency(self, t: int, speed: float = 1.0) -> float | None:
        """Latency in ms of a replica of degree ``t`` whose slowest GPU has ``speed``
        (``None``: ``latency_ms`` not given)."""
        if self.latency_ms is None:
            return None
        return float(self.latency_ms[t]) / float(speed)


class Workloads(BaseModel):
    """The training job's weight and minimum share, and the serving fleets.

    Parameters
    ----------
    training_weight
        ``w_T >= 0``, the weight of the training job's relative goodput.
    training_min_relative_goodput
        Smallest relative goodput the training job must keep (0: it may pause).
    serving
        The serving fleets; names unique.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    training_weight: float = Field(default=1.0, ge=0.0, le=1e6, allow_inf_nan=False)
    training_min_relative_goodput: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    serving: tuple[ServingWorkload, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> Workloads:
        counts = Counter(s.name for s in self.serving)  # linear: 100k fleets load in seconds
        dup = sorted(n for n, c in counts.items() if c > 1)
        if dup:
            raise ValueError(f"serving: workload names must be unique, repeated: {dup}")
        return self

    def by_name(self) -> dict[str, ServingWorkload]:
        """Serving fleets by name."""
        return {s.name: s for s in self.serving}

    @property
    def serving_degrees(self) -> tuple[int, ...]:
        """Every TP degree some fleet allows, ascending."""
        return tuple(sorted({t for s in self.serving for t in s.throughput}))


@dataclass(frozen=True, eq=False)
class MultiInstance:
    """A cluster instance (with its training job) and the workloads sharing it.

    Construction checks that every serving degree fits some NVLink domain and
    raises ``ValueError`` naming the fleet otherwise.

    Parameters
    ----------
    instance
        The cluster and the training job.
    workloads
        The weights, minimum shares and serving fleets.
    """

    instance: Instance
    workloads: Workloads

    def __post_init__(self) -> None:
        a = self.instance.arrays
        largest = max((len(g) for g in a.domain_gpus), default=0)
        for s in self.workloads.serving:
            big = [t for t in s.degrees if t > largest]
            if big:
                raise ValueError(
                    f"serving workload {s.name!r}: TP degrees {big} exceed the largest "
                    f"NVLink domain ({largest} GPUs)"
                )

    @property
    def name(self) -> str:
        """The instance name (plans refer to it)."""
        return self.instance.name


@dataclass(frozen=True)
class ServingReplica:
    """One serving replica: a TP group of ``tp`` GPUs inside one domain.

    Parameters
    ----------
    workload
        Name of its serving fleet.
    tp
        TP degree (must equal ``len(gpus)``).
    domain
        Node id of the domain.
    gpus
        Node ids of its GPUs.
    """

    workload: str
    tp: int
    domain: Hashable
    gpus: tuple[Hashable, ...]


@dataclass(frozen=True)
class MultiPlan:
    """A plan for every workload: the training plan and the serving replicas.

    Parameters
    ----------
    training
        The training job's plan (docs/model.md, spec section 3; power multipliers may
        exceed 1 where the job allows it, but the planners here use 1).
    serving
        Every serving replica.
    metrics
        What the planner reported; the validator never trusts it.
    """

    training: Plan
    serving: tuple[ServingReplica, ...] = ()
    metrics: Mapping[str, Any] = field(default_factory=dict)

    @property
    def instance(self) -> str:
        """Name of the instance the plan is for."""
        return self.training.instance

    def used_gpus(self) -> Iterator[Hashable]:
        """Every GPU id in use, training first (with repetitions, if any)."""
        yield from self.training.used_gpus()
        for rep in self.serving:
            yield from rep.gpus

    def with_metrics(self, **metrics: Any) -> MultiPlan:
        """A copy with ``metrics`` merged into the existing ones."""
        return MultiPlan(self.training, self.serving, {**self.metrics, **metrics})
