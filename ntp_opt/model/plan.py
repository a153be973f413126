"""Plans: replicas, stages, GPUs and power (docs/model.md, spec section 3).

A plan is immutable. Its ``metrics`` are whatever the planner that made it
reported (goodput, bound, ...): the validator recomputes goodput and never
trusts them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a TP group inside one NVLink domain.

    Parameters
    ----------
    domain
        Node id of the domain.
    gpus
        Node ids of the stage's GPUs (exactly the replica's TP degree).
    power
        Power multiplier ``pi`` in ``[1, 1 + max_boost]``.
    """

    domain: Hashable
    gpus: tuple[Hashable, ...]
    power: float = 1.0


@dataclass(frozen=True)
class Replica:
    """One data-parallel replica.

    Parameters
    ----------
    tp
        TP degree ``t_r`` of every stage.
    local_batch
        Sequences per step ``b_r``.
    stages
        The ``pp`` stages, in pipeline order.
    """

    tp: int
    local_batch: int
    stages: tuple[Stage, ...]

    def gpus(self) -> Iterator[Hashable]:
        """Every GPU id of the replica, stage by stage."""
        for stage in self.stages:
            yield from stage.gpus


@dataclass(frozen=True)
class Plan:
    """A placement of the job on the cluster.

    Parameters
    ----------
    instance
        Name of the instance the plan is for.
    replicas
        The replicas; an empty tuple is the paused job (goodput 0).
    metrics
        Figures reported by the planner (``goodput``, ``relative_goodput``,
        ``bound``, ``policy``, ...).
    """

    instance: str
    replicas: tuple[Replica, ...]
    metrics: Mapping[str, Any] = field(default_factory=dict)

    @property
    def n_replicas(self) -> int:
        """Number of replicas."""
        return len(self.replicas)

    def used_gpus(self) -> Iterator[Hashable]:
        """Every GPU id the plan uses (with repetitions, if the plan has any)."""
        for replica in self.replicas:
            yield from replica.gpus()

    def with_metrics(self, **metrics: Any) -> Plan:
        """A copy with ``metrics`` merged into the existing ones."""
        return Plan(self.instance, self.replicas, {**self.metrics, **metrics})
