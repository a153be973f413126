"""A replica's needs at several speeds: the inner step of the slow replicas' boost.

:func:`ntp_opt.rules.boost.boost_stages` bisects a replica's reachable speed
four levels of mids at a time; each batch of mids asks for the replica's
multipliers and extra watts (per touched rack and in all) at every mid.
:class:`ReplicaPart` holds what those depend on, read once per replica (its
stages' slices of the boost's arrays), and :func:`needs_at` computes them:
the same operations on the same numbers as reading the slices at each call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["ReplicaPart", "needs_at"]


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
        sums = watts.sum(axis=2)
    else:
        watts = part.tdp[None] * np.repeat(step, part.sizes, axis=1)
        sums = np.array([part.sub.stage_sums(w) for w in watts]).reshape(n_g, n_s)
    extra = np.cumsum(sums, axis=1)[:, -1]  # stage after stage
    slot = part.slots.get(n_g)
    if slot is None:
        slot = (np.arange(n_g)[:, None] * part.width + part.local[None, :]).ravel()
        part.slots[n_g] = slot
    per_rack = np.bincount(slot, weights=watts.ravel(), minlength=n_g * part.width)
    return mult, per_rack.reshape(n_g, part.width), extra
