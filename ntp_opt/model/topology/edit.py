"""In-place cluster edits: fail and repair GPUs or trays, stragglers, failure probabilities."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Literal

import numpy as np

from ntp_opt.model.topology.attrs import (
    FAILED,
    HEALTHY,
    is_int,
    is_real,
    require_pos_finite,
)
from ntp_opt.model.topology.query import gpus, tray_gpus, trays

if TYPE_CHECKING:
    import networkx as nx


def _resolve(G: nx.Graph, ids: Iterable[Hashable], kinds: tuple[str, ...]) -> list[Hashable]:
    """Validate ids (unknown -> KeyError, wrong kind -> ValueError); return them deduplicated."""
    if isinstance(ids, str):
        ids = [ids]
    seen: dict[Hashable, None] = {}
    nodes = G.nodes
    for n in ids:
        if n not in nodes:
            raise KeyError(f"unknown node id {n!r}")
        kind = nodes[n].get("kind")
        if kind not in kinds:
            raise ValueError(f"node {n!r} has kind {kind!r}, expected {' or '.join(kinds)}")
        seen[n] = None
    return list(seen)


def _in_graph_order(G: nx.Graph, changed: Iterable[Hashable]) -> list[Hashable]:
    s = set(changed)
    if not s:
        return []
    return [n for n in G if n in s]


def _set_state(G: nx.Graph, gpu_ids: Iterable[Hashable], state: str) -> list[Hashable]:
    nodes = G.nodes
    changed = []
    for g in gpu_ids:
        data = nodes[g]
        if data.get("state", HEALTHY) != state:
            data["state"] = state
            changed.append(g)
    return _in_graph_order(G, changed)


def _mark_gpus(G: nx.Graph, ids: Iterable[Hashable], state: str) -> list[Hashable]:
    return _set_state(G, _resolve(G, ids, ("gpu",)), state)


def fail_gpus(G: nx.Graph, ids: Iterable[Hashable]) -> list[Hashable]:
    """Mark GPUs failed, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    ids : iterable of Hashable
        GPU ids (a single string is treated as one id).

    Returns
    -------
    list of Hashable
        The GPUs that were healthy and are now failed, in graph order.

    Raises
    ------
    KeyError
        If an id is not in the graph.
    ValueError
        If an id is not a GPU.
    """
    return _mark_gpus(G, ids, FAILED)


def repair_gpus(G: nx.Graph, ids: Iterable[Hashable]) -> list[Hashable]:
    """Mark GPUs healthy again, in place: the inverse of :func:`fail_gpus`.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    ids : iterable of Hashable
        GPU ids, as for :func:`fail_gpus`.

    Returns
    -------
    list of Hashable
        The GPUs that were failed and are now healthy, in graph order.

    Raises
    ------
    KeyError, ValueError
        As :func:`fail_gpus`.
    """
    return _mark_gpus(G, ids, HEALTHY)


def fail_trays(G: nx.Graph, tray_ids: Iterable[Hashable]) -> list[Hashable]:
    """Fail every GPU of each given tray, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    tray_ids : iterable of Hashable
        Tray ids (a single string is treated as one id).

    Returns
    -------
    list of Hashable
        The GPU ids that were healthy and are now failed, in graph order.

    Raises
    ------
    KeyError
        If an id is not in the graph.
    ValueError
        If an id is not a tray.
    """
    targets = [g for t in _resolve(G, tray_ids, ("tray",)) for g in tray_gpus(G, t)]
    return _set_state(G, targets, FAILED)


def _resolve_count(fraction: float | None, count: int | None, total: int) -> int:
    if (fraction is None) == (count is None):
        raise ValueError("give exactly one of fraction and count")
    if count is not None:
        if not is_int(count) or count < 0:
            raise ValueError(f"count must be a non-negative integer, got {count!r}")
        return int(count)
    if not is_real(fraction) or not 0.0 <= fraction <= 1.0:  # type: ignore[operator]
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    return round(fraction * total)  # type: ignore[operator]


def _choose(
    rng: np.random.Generator, candidates: list[Hashable], count: int, what: str
) -> list[Hashable]:
    if count > len(candidates):
        raise ValueError(f"cannot pick {count} {what}: only {len(candidates)} candidates")
    if count == 0:
        return []
    idx = np.sort(rng.choice(len(candidates), size=count, replace=False))
    return [candidates[i] for i in idx.tolist()]


def fail_random(
    G: nx.Graph,
    *,
    fraction: float | None = None,
    count: int | None = None,
    unit: Literal["gpu", "tray"] = "gpu",
    seed: int = 0,
) -> list[Hashable]:
    """Fail randomly chosen healthy GPUs or trays, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    fraction : float, optional
        Fraction of *all* GPUs (``unit="gpu"``) or *all* trays (``unit="tray"``) to fail;
        the number picked is ``round(fraction * total)``. Exactly one of `fraction` and
        `count` must be given.
    count : int, optional
        Number of GPUs or trays to pick.
    unit : {"gpu", "tray"}, default "gpu"
        Pick individual GPUs, or whole trays (every GPU of a picked tray fails).
    seed : int, default 0
        Seed for ``numpy.random.default_rng``; the result is deterministic given the graph.

    Returns
    -------
    list of Hashable
        The GPU ids newly failed, in graph order.

    Raises
    ------
    ValueError
        If both or neither of `fraction`/`count` are given, they are out of range, `unit` is
        unknown, or more units are requested than there are candidates (healthy GPUs, or trays
        with at least one healthy GPU).
    """
    nodes = G.nodes
    if unit == "gpu":
        all_gpus = gpus(G)
        n = _resolve_count(fraction, count, len(all_gpus))
        cand = [g for g in all_gpus if nodes[g].get("state", HEALTHY) == HEALTHY]
        picked = _choose(np.random.default_rng(seed), cand, n, "healthy GPUs")
        return _set_state(G, picked, FAILED)
    if unit == "tray":
        all_trays = trays(G)
        n = _resolve_count(fraction, count, len(all_trays))
        members = {t: tray_gpus(G, t) for t in all_trays}
        cand = [
            t
            for t in all_trays
            if any(nodes[g].get("state", HEALTHY) == HEALTHY for g in members[t])
        ]
        picked = _choose(np.random.default_rng(seed), cand, n, "trays with a healthy GPU")
        return _set_state(G, [g for t in picked for g in members[t]], FAILED)
    raise ValueError(f"unit must be 'gpu' or 'tray', got {unit!r}")


def set_speed(G: nx.Graph, ids: Iterable[Hashable], speed: float) -> list[Hashable]:
    """Set the relative speed of GPUs, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    ids : iterable of Hashable
        GPU ids (a single string is treated as one id).
    speed : float
        Relative throughput, finite and > 0 (1.0 = nominal, < 1 = straggler).

    Returns
    -------
    list of Hashable
        The GPU ids whose speed was assigned (deduplicated), in graph order.

    Raises
    ------
    KeyError
        If an id is not in the graph.
    ValueError
        If an id is not a GPU or `speed` is invalid.
    """
    value = require_pos_finite("speed", speed)
    targets = _resolve(G, ids, ("gpu",))
    nodes = G.nodes
    for g in targets:
        nodes[g]["speed"] = value
    return _in_graph_order(G, targets)


def add_stragglers(
    G: nx.Graph,
    *,
    fraction: float | None = None,
    count: int | None = None,
    speed: float | tuple[float, float] = 0.9,
    seed: int = 0,
) -> list[Hashable]:
    """Slow down randomly chosen healthy GPUs, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    fraction : float, optional
        Fraction of *all* GPUs to slow down (``round(fraction * num_gpus)`` are picked among
        the healthy ones). Exactly one of `fraction` and `count` must be given.
    count : int, optional
        Number of GPUs to slow down.
    speed : float or tuple of (float, float), default 0.9
        The new speed, or ``(lo, hi)`` to draw each speed uniformly from ``[lo, hi]``
        (``0 < lo <= hi``, finite).
    seed : int, default 0
        Seed for ``numpy.random.default_rng``.

    Returns
    -------
    list of Hashable
        The GPUs picked, in graph order (speeds are drawn in that order).

    Raises
    ------
    ValueError
        On invalid `fraction`/`count`/`speed`, or if more GPUs are requested than are healthy.
    """
    if isinstance(speed, tuple):
        if len(speed) != 2:
            raise ValueError(f"speed range must be (lo, hi), got {speed!r}")
        lo = require_pos_finite("speed lo", speed[0])
        hi = require_pos_finite("speed hi", speed[1])
        if lo > hi:
            raise ValueError(f"speed range must have lo <= hi, got {speed!r}")
    else:
        lo = hi = require_pos_finite("speed", speed)
    all_gpus = gpus(G)
    n = _resolve_count(fraction, count, len(all_gpus))
    nodes = G.nodes
    cand = [g for g in all_gpus if nodes[g].get("state", HEALTHY) == HEALTHY]
    rng = np.random.default_rng(seed)
    picked = _choose(rng, cand, n, "healthy GPUs")
    speeds = rng.uniform(lo, hi, size=len(picked)).tolist() if lo < hi else [lo] * len(picked)
    for g, s in zip(picked, speeds, strict=True):
        nodes[g]["speed"] = float(s)
    return picked


def set_p_fail(G: nx.Graph, p: float, ids: Iterable[Hashable] | None = None) -> list[Hashable]:
    """Set failure probabilities over the planning horizon, in place.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    p : float
        Probability in [0, 1].
    ids : iterable of Hashable, optional
        GPU and/or tray ids (a single string is treated as one id). A GPU id sets that GPU's
        ``p_fail``; a tray id sets the tray's own ``p_fail`` (whole-tray failure), not its GPUs'.
        Default: every GPU.

    Returns
    -------
    list of Hashable
        The node ids whose ``p_fail`` was assigned (deduplicated), in graph order.

    Raises
    ------
    KeyError
        If an id is not in the graph.
    ValueError
        If an id is neither a GPU nor a tray, or `p` is not in [0, 1].
    """
    if not is_real(p) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
    targets = gpus(G) if ids is None else _resolve(G, ids, ("gpu", "tray"))
    nodes = G.nodes
    value = float(p)
    for n in targets:
        nodes[n]["p_fail"] = value
    return targets if ids is None else _in_graph_order(G, targets)
