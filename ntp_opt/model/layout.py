"""A plan in index space: every stage's replica, domain and GPUs as integer indices.

Node ids (``Hashable``) appear only at the edges: :meth:`Layout.from_plan`
reads a :class:`~ntp_opt.model.plan.Plan` against an instance's arrays
(``instance.arrays`` order), :meth:`Layout.to_plan` writes one back. Rules and
planners work on the indices in between.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage

__all__ = ["SLOT", "Layout"]

#: Stages per replica in an :meth:`Layout.assignment` code (``replica * SLOT + stage``).
SLOT = 65536


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
    def from_plan(cls, instance: Instance, plan: Plan) -> Layout:
        """The layout of ``plan``; every domain and GPU must be a node of ``instance``.

        Parameters
        ----------
        instance
            The instance whose arrays give the indices.
        plan
            The plan.

        Returns
        -------
        Layout

        Raises
        ------
        KeyError
            A stage names an unknown domain or GPU (the validator reports these first).
        """
        a = instance.arrays
        index, dindex = a.gpu_index, a.domain_index
        replica: list[int] = []
        stage: list[int] = []
        domain: list[int] = []
        sizes: list[int] = []
        power: list[float] = []
        gpus: list[int] = []
        for r, rep in enumerate(plan.replicas):
            for k, st in enumerate(rep.stages):
                replica.append(r)
                stage.append(k)
                domain.append(dindex[st.domain])
                sizes.append(len(st.gpus))
                power.append(float(st.power))
                gpus.extend(index[g] for g in st.gpus)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return cls(
            replica=np.asarray(replica, dtype=np.int64),
            stage=np.asarray(stage, dtype=np.int64),
            domain=np.asarray(domain, dtype=np.int64),
            offsets=offsets,
            gpus=np.asarray(gpus, dtype=np.int64),
            power=np.asarray(power, dtype=float),
            degree=np.asarray([rep.tp for rep in plan.replicas], dtype=np.int64),
            batch=np.asarray([int(rep.local_batch) for rep in plan.replicas], dtype=np.int64),
            metrics=dict(plan.metrics),
            instance=plan.instance,
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
