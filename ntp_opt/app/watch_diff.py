"""What changed between two readings of a cluster (:func:`diff`), and flap hysteresis.

:func:`diff` turns two readings into fail, repair and speed events (or the
reason the structure differs, or the power changes); :class:`Flaps` holds out
GPUs that go down and up repeatedly. :class:`ntp_opt.app.watch.Watcher` uses
both every poll.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.workflows.replan import ClusterEvent

__all__ = [
    "DEFAULT_FLAP_COUNT",
    "DEFAULT_FLAP_HOLD_S",
    "Diff",
    "Flaps",
    "diff",
    "hosts_of",
    "short_list",
]

#: Seconds a flapping GPU is held out after it comes back (``--flap-hold``).
DEFAULT_FLAP_HOLD_S = 600.0
#: Failures within the hold window that make a GPU flapping (``--flap-count``).
DEFAULT_FLAP_COUNT = 2


# --- reading the difference --------------------------------------------------------------


@dataclass(frozen=True)
class Diff:
    """What changed between two readings of the same cluster.

    Attributes
    ----------
    events
        Fail, repair and speed events, GPU ids (:class:`ClusterEvent`).
    hosts
        Per event, the hosts of its GPUs (for the log).
    structure
        Why the cluster is another one (GPUs, hosts, domains, racks), or ``None``.
    power
        GPU ids whose power (``tdp_w``/``max_power_w``) changed, plus rack ids
        whose budget changed.
    """

    events: tuple[ClusterEvent, ...] = ()
    structure: str | None = None
    power: tuple[str, ...] = ()
    hosts: tuple[tuple[str, ...], ...] = ()

    @property
    def empty(self) -> bool:
        """Nothing changed."""
        return not self.events and self.structure is None and not self.power

    def describe(self) -> str:
        """A short text: ``fail 8 GPUs (h3), repair ...``."""
        parts = []
        if self.structure is not None:
            parts.append(f"new topology ({self.structure})")
        for i, e in enumerate(self.events):
            what = f"{e.kind} {len(e.nodes)} GPU{'s' if len(e.nodes) != 1 else ''}"
            if i < len(self.hosts):
                what += f" ({short_list(list(self.hosts[i]))})"
            if e.speed is not None:
                what += f" speed {e.speed:g}"
            parts.append(what)
        if self.power:
            parts.append(f"power limit of {len(self.power)} GPUs/racks")
        return ", ".join(parts) or "no change"


def short_list(items: list[str], n: int = 4) -> str:
    """The first ``n`` of ``items`` joined by commas, and how many more.

    Parameters
    ----------
    items
        Names (hosts).
    n
        How many are shown.

    Returns
    -------
    str
        ``a,b,c,d,+3``.
    """
    return ",".join(items[:n]) + (f",+{len(items) - n}" if len(items) > n else "")


def hosts_of(instance: Instance, gpus: list[int]) -> list[str]:
    """The hosts of some GPUs of ``instance``.

    Parameters
    ----------
    instance
        The cluster.
    gpus
        GPU indices.

    Returns
    -------
    list of str
        Their hosts (the GPU id where a GPU has none), sorted, each once.
    """
    a = instance.arrays
    g = instance.cluster
    out = set()
    for i in gpus:
        gid = a.gpu_ids[i]
        out.add(str(g.nodes[gid].get("host", gid)))
    return sorted(out)


def diff(old: Instance, new: Instance) -> Diff:
    """The events that turn ``old`` into ``new`` (two readings of one cluster).

    Parameters
    ----------
    old, new
        Instances of the same job; GPUs are matched by id.

    Returns
    -------
    Diff
        Fail, repair and speed events (grouped, GPU ids), or the reason the
        structure differs (then no events), or the power changes.
    """
    a, b = old.arrays, new.arrays
    if list(a.gpu_ids) != list(b.gpu_ids):
        gone = len(set(a.gpu_ids) - set(b.gpu_ids))
        added = len(set(b.gpu_ids) - set(a.gpu_ids))
        return Diff(structure=f"{added} GPUs added, {gone} removed" if gone or added else "order")
    for name in ("gpu_tray", "gpu_domain", "gpu_rack"):
        if not np.array_equal(getattr(a, name), getattr(b, name)):
            return Diff(structure=f"hosts, NVLink domains or racks regrouped ({name})")
    ids = list(b.gpu_ids)
    events: list[ClusterEvent] = []
    hosts: list[tuple[str, ...]] = []
    failed = np.flatnonzero(a.healthy & ~b.healthy).tolist()
    repaired = np.flatnonzero(~a.healthy & b.healthy).tolist()
    for kind, idx in (("fail", failed), ("repair", repaired)):
        if idx:
            events.append(ClusterEvent(kind, tuple(ids[i] for i in idx)))  # type: ignore[arg-type]
            hosts.append(tuple(hosts_of(new, idx)))
    changed = np.flatnonzero(~np.isclose(a.speed, b.speed, rtol=0, atol=1e-9))
    by_speed: dict[float, list[int]] = {}
    for i in changed.tolist():
        by_speed.setdefault(float(b.speed[i]), []).append(i)
    for s, idx in sorted(by_speed.items()):
        events.append(ClusterEvent("speed", tuple(ids[i] for i in idx), s))
        hosts.append(tuple(hosts_of(new, idx)))
    power = [
        str(ids[i])
        for i in np.flatnonzero(
            ~(np.isclose(a.tdp, b.tdp) & np.isclose(a.max_power, b.max_power, equal_nan=True))
        )
    ]
    if not np.allclose(a.rack_budget, b.rack_budget, equal_nan=True):
        power.append("racks")
    return Diff(tuple(events), None, tuple(power), tuple(hosts))


# --- hysteresis ----------------------------------------------------------------------------


@dataclass
class Flaps:
    """Hysteresis for GPUs that go down and up repeatedly.

    A GPU that failed ``count`` times within the ``hold`` seconds before it
    comes back is *flapping*: it is held out (kept failed in the plan) until
    it has stayed up for ``hold`` seconds; going down meanwhile restarts
    that probation.

    Parameters
    ----------
    hold
        Seconds (the window and the probation).
    count
        Failures within the window that make a GPU flapping (>= 1).
    """

    hold: float = DEFAULT_FLAP_HOLD_S
    count: int = DEFAULT_FLAP_COUNT
    failures: dict[str, list[float]] = field(default_factory=dict)
    up_since: dict[str, float] = field(default_factory=dict)
    holding: set[str] = field(default_factory=set)

    def failed(self, gpu: str, now: float) -> None:
        """Record that ``gpu`` went down at ``now``."""
        times = [t for t in self.failures.get(gpu, []) if now - t < self.hold]
        times.append(now)
        self.failures[gpu] = times
        self.up_since.pop(gpu, None)

    def held(self, gpu: str, now: float) -> bool:
        """Whether ``gpu``, seen up at ``now`` after being down, stays held out."""
        since = self.up_since.setdefault(gpu, now)
        if gpu not in self.holding:
            recent = [t for t in self.failures.get(gpu, []) if since - t < self.hold]
            if len(recent) >= self.count:
                self.holding.add(gpu)
        return gpu in self.holding and now - since < self.hold

    def down(self, gpu: str, now: float) -> None:
        """``gpu`` is seen down: a held GPU that was up failed again, its probation restarts."""
        if self.up_since.pop(gpu, None) is not None:
            self.failed(gpu, now)

    def released(self, gpu: str) -> None:
        """``gpu`` is back in the plan: forget its probation (not its failures)."""
        self.up_since.pop(gpu, None)
        self.holding.discard(gpu)
