"""Cluster events for re-planning: what happened since a plan was made.

:class:`ClusterEvent` (a failure, a repair or a speed change of GPUs or
trays) and :func:`apply_events`, which returns the instance after them,
sharing the unchanged graph structure (only the health and speed arrays are
copied). :mod:`ntp_opt.workflows.replan` re-plans after them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.topology.attrs import SPEED_MIN

__all__ = ["ClusterEvent", "EventKind", "apply_events", "as_events", "gpus_of"]

EventKind = Literal["fail", "repair", "speed"]


@dataclass(frozen=True)
class ClusterEvent:
    """Something that happened to the cluster since the plan was made.

    Attributes
    ----------
    kind
        ``"fail"`` (the GPUs go down), ``"repair"`` (they come back healthy)
        or ``"speed"`` (their relative speed becomes ``speed``: a new or
        recovered straggler).
    nodes
        GPU or tray ids (a tray stands for all of its GPUs); a single id
        (``ClusterEvent("fail", "d2.t0.g0")``) stands for a one-element tuple.
    speed
        The new speed, from :data:`~ntp_opt.model.topology.attrs.SPEED_MIN` (the
        smallest an instance file holds) to 1, for ``"speed"`` events only.
    """

    kind: EventKind
    nodes: tuple[Hashable, ...]
    speed: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fail", "repair", "speed"):
            raise ValueError(f"event kind must be fail, repair or speed, got {self.kind!r}")
        nodes: Any = self.nodes
        if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Iterable):
            nodes = (nodes,)  # one id, not a sequence of characters
        object.__setattr__(self, "nodes", tuple(nodes))
        if not self.nodes:
            raise ValueError("an event needs at least one GPU or tray")
        if self.kind == "speed":
            if self.speed is None or not (SPEED_MIN <= float(self.speed) <= 1.0):
                raise ValueError(
                    f"a speed event needs speed in [{SPEED_MIN:g}, 1], got {self.speed!r}"
                )
        elif self.speed is not None:
            raise ValueError(f"only speed events carry a speed ({self.kind} event has one)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterEvent:
        """Build from ``{"kind", "nodes", "speed"?}`` (unknown keys are an error)."""
        extra = set(data) - {"kind", "nodes", "speed"}
        if extra:
            raise ValueError(f"unknown event field(s): {', '.join(sorted(extra))}")
        if "kind" not in data or "nodes" not in data:
            raise ValueError("an event needs 'kind' and 'nodes'")
        nodes = data["nodes"]
        if isinstance(nodes, str) or not isinstance(nodes, Sequence):
            raise ValueError("event 'nodes' must be a list of node ids")
        return cls(data["kind"], tuple(nodes), data.get("speed"))


def as_events(events: Iterable[Any]) -> list[ClusterEvent]:
    """The events as :class:`ClusterEvent` objects.

    Parameters
    ----------
    events
        :class:`ClusterEvent` objects, dicts of their fields, or
        :class:`ntp_opt.workflows.simulate.Event` objects.

    Returns
    -------
    list of ClusterEvent

    Raises
    ------
    TypeError
        An item is none of these.
    ValueError
        A dict is not a valid event.
    """
    out = []
    for e in events:
        if isinstance(e, ClusterEvent):
            out.append(e)
        elif isinstance(e, Mapping):
            out.append(ClusterEvent.from_dict(e))
        elif hasattr(e, "kind") and hasattr(e, "gpu_ids"):  # ntp_opt.workflows.simulate.Event
            out.append(ClusterEvent(e.kind, tuple(e.gpu_ids)))
        else:
            raise TypeError(f"not an event: {e!r}")
    return out


def gpus_of(
    instance: Instance, node: Hashable, trays: Mapping[Hashable, int] | None = None
) -> list[int]:
    """GPU indices of a GPU or tray id.

    Parameters
    ----------
    instance
        The instance the id belongs to.
    node
        A GPU or tray id.
    trays
        Tray id -> index (``instance.arrays.tray_ids``), when the caller has it:
        the tray's GPUs are then found in the arrays, never in the graph.

    Returns
    -------
    list of int
        Indices into ``instance.arrays``.

    Raises
    ------
    ValueError
        ``node`` is no GPU or tray of ``instance``.
    """
    a = instance.arrays
    if node in a.gpu_index:
        return [a.gpu_index[node]]
    if trays is not None:
        if node in trays:
            return np.flatnonzero(a.gpu_tray == trays[node]).tolist()
        raise ValueError(f"event names {node!r}, which is not a GPU or tray of {instance.name!r}")
    g = instance.cluster
    if node in g and g.nodes[node].get("kind") == "tray":
        return [a.gpu_index[n] for n in g.adj[node] if n in a.gpu_index]
    raise ValueError(f"event names {node!r}, which is not a GPU or tray of {instance.name!r}")


def apply_events(
    instance: Instance, events: Iterable[Any], *, trays: Mapping[Hashable, int] | None = None
) -> Instance:
    """The instance after ``events``, sharing the unchanged graph structure.

    Parameters
    ----------
    instance
        The instance before.
    events
        :class:`ClusterEvent` objects, dicts of their fields, or
        :class:`ntp_opt.workflows.simulate.Event` objects, applied in order.
    trays
        As for :func:`gpus_of`.

    Returns
    -------
    Instance
        A new instance (same name, job and meta); the input is unchanged.

    Raises
    ------
    ValueError
        An event names an unknown node, fails a failed GPU or repairs a
        healthy one.
    """
    a = instance.arrays
    healthy = a.healthy.copy()
    speed = a.speed.copy()
    for e in as_events(events):
        for node in e.nodes:
            for i in gpus_of(instance, node, trays):
                if e.kind == "fail":
                    if not healthy[i]:
                        raise ValueError(f"event fails GPU {a.gpu_ids[i]!r}, which is down")
                    healthy[i] = False
                elif e.kind == "repair":
                    if healthy[i]:
                        raise ValueError(f"event repairs GPU {a.gpu_ids[i]!r}, which is up")
                    healthy[i] = True
                else:
                    speed[i] = float(e.speed)  # type: ignore[arg-type]
    return instance.with_health(healthy, speed)
