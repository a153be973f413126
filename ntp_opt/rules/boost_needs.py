"""A replica's needs at several speeds: the inner step of the slow replicas' boost.

:func:`ntp_opt.rules.boost.boost_stages` bisects a replica's reachable speed
four levels of mids at a time; each batch of mids asks for the replica's
multipliers and extra watts (per touched rack and in all) at every mid.
:class:`ReplicaPart` holds what those depend on, read once per replica (its
stages' slices of the boost's arrays), and :func:`needs_at` computes them:
the same operations on the same numbers as reading the slices at each call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ReplicaPart", "bisect_levels", "needs_at"]

Needs = Callable[[list[float]], tuple[np.ndarray, np.ndarray, np.ndarray]]


class ReplicaPart(NamedTuple):
    """One replica's stages, as the boost's needs read them.

    Attributes
    ----------
    fs, pw, top
        Per stage: degree factor times slowest speed, current multiplier, and
        the largest multiplier.
    tdp
        Per GPU of the replica (stage after stage): its TDP.
    sizes
        GPUs per stage.
    matrix
        ``tdp`` as a ``(1, stages, size)`` array when every stage has one size
        (its stages are then summed as the rows of a matrix), else ``None``.
    sub
        The replica's :class:`~ntp_opt.rules.boost.Stages` (renumbered to its
        GPUs), for stages of several sizes.
    local
        Per GPU: its (replica, rack) group, ``0 .. width - 1``.
    width
        The replica's (replica, rack) groups.
    slots
        Per number of speeds asked: the groups of every (speed, GPU), as
        :func:`numpy.bincount` sums them (filled as asked).
    """

    fs: np.ndarray
    pw: np.ndarray
    top: np.ndarray
    tdp: np.ndarray
    sizes: np.ndarray
    matrix: np.ndarray | None
    sub: Any
    local: np.ndarray
    width: int
    slots: dict[int, np.ndarray]


def needs_at(
    part: ReplicaPart, goals: list[float], inv_alpha: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Multipliers, extra watts per touched rack and in all, at each speed of ``goals``.

    Parameters
    ----------
    part
        The replica.
    goals
        Speeds to reach.
    inv_alpha
        ``1 / power_exponent``.

    Returns
    -------
    tuple of numpy.ndarray
        Per speed: the stages' multipliers, the extra watts per (replica,
        rack) group (summed in GPU order), and the extra watts in all (the
        stages' sums added stage after stage).
    """
    n_s, n_g = len(part.fs), len(goals)
    mult = np.minimum(
        np.maximum((np.array(goals)[:, None] / part.fs) ** inv_alpha, part.pw), part.top
    )
    step = mult - part.pw
    if part.matrix is not None:
        # one size: stages are the rows of a matrix, summed as each alone
        watts = part.matrix * step[:, :, None]
        sums = np.add.reduce(watts, axis=2)  # as ndarray.sum
    else:
        watts = part.tdp[None] * np.repeat(step, part.sizes, axis=1)
        sums = np.array([part.sub.stage_sums(w) for w in watts]).reshape(n_g, n_s)
    extra = np.add.accumulate(sums, axis=1)[:, -1]  # stage after stage (as numpy.cumsum)
    slot = part.slots.get(n_g)
    if slot is None:
        slot = (np.arange(n_g)[:, None] * part.width + part.local[None, :]).ravel()
        part.slots[n_g] = slot
    per_rack = np.bincount(slot, weights=watts.ravel(), minlength=n_g * part.width)
    return mult, per_rack.reshape(n_g, part.width), extra


def bisect_levels(
    need: Needs, room: np.ndarray, site: float, lo: float, up: float, steps: int
) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """``steps`` bisection steps on a replica's speed, four levels of mids at a time.

    Each batch asks ``need`` for the 15 mids of the next four levels (level
    by level, each level's intervals left to right: the children of mid ``j``
    are ``2 j + 1``, below it, and ``2 j + 2``, above it) and follows the path
    the rooms decide: a mid fits when every touched rack's extra watts are at
    most its room and the extra watts in all at most ``site``.

    Parameters
    ----------
    need
        Per list of speeds: multipliers, extra watts per touched rack, extra
        watts in all (:func:`needs_at`).
    room
        Per touched rack (the replica's groups' racks), the watts it may take.
    site
        The watts the site may take.
    lo, up
        The bisection's start: a speed that fits and a goal.
    steps
        Bisection steps.

    Returns
    -------
    tuple
        The end (the last mid that fitted, or ``lo``), and per step the extra
        watts per touched rack and in all at its mid and whether they fitted.
    """
    left, base = steps, 0
    picked: list[int] = []
    per_racks: list[np.ndarray] = []
    extras: list[np.ndarray] = []
    oks: list[np.ndarray] = []
    while left > 0:
        depth = min(4, left)
        bounds, mids = [(lo, up)], []
        for _ in range(depth):  # the mids of the next levels, level by level
            nxt = []
            for x, y in bounds:
                m = 0.5 * (x + y)
                mids.append(m)
                nxt += [(x, m), (m, y)]
            bounds = nxt
        _, per_rack, extra = need(mids)
        fit = np.logical_and.reduce(per_rack <= room, axis=-1) & (extra <= site)
        ok = fit.tolist()
        node = 0
        for _ in range(depth):
            picked.append(base + node)
            if ok[node]:
                lo, node = mids[node], 2 * node + 2
            else:
                up, node = mids[node], 2 * node + 1
        per_racks.append(per_rack)
        extras.append(extra)
        oks.append(fit)
        base += len(mids)
        left -= depth
    if not picked:  # no step: nothing to check
        return lo, np.zeros((0, len(room))), np.zeros(0), np.zeros(0, dtype=bool)
    at = np.array(picked)
    return (
        lo,
        np.concatenate(per_racks)[at],
        np.concatenate(extras)[at],
        np.concatenate(oks)[at],
    )
