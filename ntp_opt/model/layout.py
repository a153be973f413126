"""A plan in index space: every stage's replica, domain and GPUs as integer indices.

Node ids (``Hashable``) appear only at the edges: :meth:`Layout.from_plan`
reads a :class:`~ntp_opt.model.plan.Plan` against an instance's arrays
(``instance.arrays`` order), :meth:`Layout.to_plan` writes one back. Rules and
planners work on the indices in between.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage

__all__ = ["SLOT", "Layout"]

#: Stages per replica in an :meth:`Layout.assignment` code (``replica * SLOT + stage``).
SLOT = 65536

_INT64 = np.iinfo(np.int64)


def _lenient_int(x: Any) -> int:
    """``x`` as an ``int64`` value when it is an integer (or an integral float), else -1."""
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if isinstance(x, int | np.integer) and _INT64.min <= x <= _INT64.max:
        return int(x)
    return -1


def _lenient_float(x: Any) -> float:
    """``float(x)``, or ``nan`` when ``x`` is no number."""
    try:
        return float(x)
    except (TypeError, ValueError, OverflowError):
        return math.nan


@dataclass(frozen=True, eq=False)
class Layout:
    """Stages of a plan as flat integer arrays (one entry per stage, replica order).

    Attributes
    ----------
    replica
        Per stage: its replica's index.
    stage
        Per stage: its index inside its replica.
    domain
        Per stage: its domain's index (``instance.arrays.domain_ids`` order).
    offsets
        ``gpus[offsets[s]:offsets[s + 1]]`` are stage ``s``'s GPU indices, in plan order.
    gpus
        Every stage's GPU indices, concatenated.
    power
        Per stage: its power multiplier.
    degree
        Per replica: its TP degree.
    batch
        Per replica: its local batch.
    metrics
        The plan's metrics, carried unchanged.
    instance
        The plan's instance name.
    """

    replica: np.ndarray
    stage: np.ndarray
    domain: np.ndarray
    offsets: np.ndarray
    gpus: np.ndarray
    power: np.ndarray
    degree: np.ndarray
    batch: np.ndarray
    metrics: Mapping[str, Any] = field(default_factory=dict)
    instance: str = ""

    @classmethod
    def from_plan(cls, instance: Instance, plan: Plan, *, strict: bool = True) -> Layout:
        """The layout of ``plan``; every domain and GPU must be a node of ``instance``.

        Parameters
        ----------
        instance
            The instance whose arrays give the indices.
        plan
            The plan.
        strict
            ``False``: read any plan, as the validator does. An unknown domain
            or GPU becomes index ``-1``; a power multiplier that is no number
            becomes ``nan``; a TP degree or local batch that is no integer (or
            out of ``int64`` range) becomes ``-1``. Such a layout is for
            checking only: :meth:`to_plan` needs a strict one.

        Returns
        -------
        Layout

        Raises
        ------
        KeyError
            ``strict`` and a stage names an unknown domain or GPU (the validator
            reports these first).
        """
        a = instance.arrays
        stages = [st for rep in plan.replicas for st in rep.stages]
        counts = np.fromiter((len(rep.stages) for rep in plan.replicas), np.int64)
        n = len(stages)
        replica = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        starts = np.cumsum(counts) - counts
        stage = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)
        sizes = np.fromiter((len(st.gpus) for st in stages), np.int64, n)
        flat = list(chain.from_iterable(st.gpus for st in stages))
        if strict:
            dindex = a.domain_index
            domain = np.fromiter((dindex[st.domain] for st in stages), np.int64, n)
            gpus = np.fromiter(map(a.gpu_index.__getitem__, flat), np.int64, len(flat))
            power = np.fromiter((float(st.power) for st in stages), float, n)
            degree = [rep.tp for rep in plan.replicas]
            batch = [int(rep.local_batch) for rep in plan.replicas]
        else:
            dget = a.domain_index.get
            domain = np.fromiter((dget(st.domain, -1) for st in stages), np.int64, n)
            try:  # the usual case: every GPU known, looked up in C
                gpus = np.fromiter(map(a.gpu_index.__getitem__, flat), np.int64, len(flat))
            except (KeyError, TypeError):
                get = a.gpu_index.get
                gpus = np.fromiter((get(g, -1) for g in flat), np.int64, len(flat))
            power = np.fromiter((_lenient_float(st.power) for st in stages), float, n)
            degree = [_lenient_int(rep.tp) for rep in plan.replicas]
            batch = [_lenient_int(rep.local_batch) for rep in plan.replicas]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return cls(
            replica=replica,
            stage=stage,
            domain=domain,
            offsets=offsets,
            gpus=gpus,
            power=power,
            degree=np.asarray(degree, dtype=np.int64),
            batch=np.asarray(batch, dtype=np.int64),
            metrics=dict(plan.metrics),
            instance=plan.instance,
        )

    @classmethod
    def from_indices(
        cls,
        instance: str,
        replicas: Sequence[tuple[int, int, Sequence[tuple[int, Sequence[int], float]]]],
        metrics: Mapping[str, Any] | None = None,
    ) -> Layout:
        """A layout from index-space replicas.

        Parameters
        ----------
        instance
            The instance name the plan is for.
        replicas
            Per replica: its TP degree, its local batch and its stages, each
            ``(domain index, GPU indices, power multiplier)``.
        metrics
            The plan's metrics.

        Returns
        -------
        Layout
        """
        replica: list[int] = []
        stage: list[int] = []
        domain: list[int] = []
        sizes: list[int] = []
        power: list[float] = []
        gpus: list[int] = []
        for r, (_, _, stages) in enumerate(replicas):
            for k, (d, g, pw) in enumerate(stages):
                replica.append(r)
                stage.append(k)
                domain.append(int(d))
                sizes.append(len(g))
                power.append(float(pw))
                gpus.extend(int(i) for i in g)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return cls(
            replica=np.asarray(replica, dtype=np.int64),
            stage=np.asarray(stage, dtype=np.int64),
            domain=np.asarray(domain, dtype=np.int64),
            offsets=offsets,
            gpus=np.asarray(gpus, dtype=np.int64),
            power=np.asarray(power, dtype=float),
            degree=np.asarray([t for t, _, _ in replicas], dtype=np.int64),
            batch=np.asarray([b for _, b, _ in replicas], dtype=np.int64),
            metrics=dict(metrics or {}),
            instance=instance,
        )

    @property
    def n_stages(self) -> int:
        """Number of stages over all replicas."""
        return len(self.replica)

    @property
    def n_replicas(self) -> int:
        """Number of replicas."""
        return len(self.degree)

    def stage_gpus(self, s: int) -> np.ndarray:
        """GPU indices of stage ``s`` (flat stage index)."""
        return self.gpus[self.offsets[s] : self.offsets[s + 1]]

    def per_replica(self) -> list[list[np.ndarray]]:
        """GPU indices of every stage, per replica, per stage."""
        out: list[list[np.ndarray]] = [[] for _ in range(self.n_replicas)]
        for s, r in enumerate(self.replica.tolist()):
            out[r].append(self.stage_gpus(s))
        return out

    def stages(self) -> Iterator[tuple[int, int, np.ndarray, float]]:
        """Per stage: replica index, stage index, GPU indices, power multiplier."""
        for s in range(self.n_stages):
            yield (
                int(self.replica[s]),
                int(self.stage[s]),
                self.stage_gpus(s),
                float(self.power[s]),
            )

    def owner(self, n_gpus: int) -> np.ndarray:
        """Per GPU index: the flat index of the first stage using it, or -1."""
        out = np.full(n_gpus, -1, dtype=np.int64)
        sizes = np.diff(self.offsets)
        owners = np.repeat(np.arange(self.n_stages, dtype=np.int64), sizes)
        # reversed so that the first stage wins where GPUs repeat
        out[self.gpus[::-1]] = owners[::-1]
        return out

    def assignment(self, n_gpus: int) -> np.ndarray:
        """Per GPU index: ``replica * 65536 + stage`` of the (last) stage using it, or -1."""
        out = np.full(n_gpus, -1, dtype=np.int64)
        sizes = np.diff(self.offsets)
        out[self.gpus] = np.repeat(self.replica * SLOT + self.stage, sizes)
        return out

    def to_plan(self, instance: Instance) -> Plan:
        """The plan back in node ids (metrics unchanged).

        Parameters
        ----------
        instance
            The instance whose arrays give the node ids.

        Returns
        -------
        Plan
            Equal to the plan :meth:`from_plan` read.
        """
        a = instance.arrays
        stages: list[list[Stage]] = [[] for _ in range(self.n_replicas)]
        for s, (r, _, g, pw) in enumerate(self.stages()):
            d = int(self.domain[s])
            stages[r].append(
                Stage(domain=a.domain_ids[d], gpus=tuple(a.gpu_ids[i] for i in g), power=pw)
            )
        replicas = tuple(
            Replica(tp=int(t), local_batch=int(b), stages=tuple(st))
            for t, b, st in zip(self.degree.tolist(), self.batch.tolist(), stages, strict=True)
        )
        return Plan(self.instance, replicas, dict(self.metrics))
