"""A replica's needs at several speeds: the inner step of the slow replicas' boost.

:func:`ntp_opt.rules.boost.boost_stages` bisects a replica's reachable speed
a stretch of the path at a time (:func:`bisect_predicted`); each batch of mids
asks for the replica's multipliers and extra watts (per touched rack and in
all) at every mid.
:class:`ReplicaPart` holds what those depend on, read once per replica (its
stages' slices of the boost's arrays), and :func:`needs_at` computes them:
the same operations on the same numbers as reading the slices at each call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ntp_opt.rules.bisection import midpoints

__all__ = ["ReplicaPart", "bisect_predicted", "needs_at"]

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


def bisect_predicted(
    need: Needs,
    room: np.ndarray,
    site: float,
    lo: float,
    up: float,
    steps: int,
    *,
    power: float = 1.0,
) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """``steps`` bisection steps on a replica's speed, whole stretches of the path at a time.

    The first batch asks ``need`` for the 15 mids of the first four levels
    (level by level, each level's intervals left to right), which give the
    first four steps and where the fit changes. Each later batch asks for
    the mids of every remaining step along the path that a predicted
    threshold ``s`` gives (a mid fits when it is at most ``s``): the rooms
    decide each asked mid, and the path is taken as asked up to the first
    step they decide otherwise, which is then taken as they decide. ``s`` is
    interpolated from the slacks (room left at the tightest constraint) of
    the asked speeds closest to the interval left, linearly in ``speed **
    power`` (a stage's watts at speed ``x`` are its multiplier ``(x / base) **
    (1 / alpha)`` times its TDP: linear in ``x ** (1 / alpha)`` until a
    multiplier reaches a limit). Every step is thus the plain bisection's
    step, whatever the needs are (a wrong prediction only costs a batch);
    with needs that grow with the speed, a few batches do what the plain
    bisection does in ``steps`` calls.

    A mid fits when every touched rack's extra watts are at most its room and
    the extra watts in all at most ``site``.

    Parameters
    ----------
    need
        Per list of speeds: multipliers, extra watts per touched rack, extra
        watts in all (:func:`needs_at`); each speed's numbers must not depend
        on the other speeds asked with it.
    room
        Per touched rack (the replica's groups' racks), the watts it may take.
    site
        The watts the site may take.
    lo, up
        The bisection's start: a speed that fits and a goal.
    steps
        Bisection steps.
    power
        The needs are about linear in ``speed ** power`` (the boost gives
        ``1 / alpha``; not positive and finite: linear in the speed). Only the
        predictions use it.

    Returns
    -------
    tuple
        The end (the last mid that fitted, or ``lo``), and per step the extra
        watts per touched rack and in all at its mid and whether they fitted.
    """
    if steps <= 0:  # no step: nothing to check
        return lo, np.zeros((0, len(room))), np.zeros(0), np.zeros(0, dtype=bool)
    seen = _Asked()
    # the first four levels: the first steps, and a grid for the prediction
    depth = min(4, steps)
    mids = midpoints([lo], [up], depth)[0]
    fit = seen.ask(need, mids, room, site)
    picked, node = [], 0
    for _ in range(depth):
        picked.append(node)
        if fit[node]:
            lo, node = mids[node], 2 * node + 2
        else:
            up, node = mids[node], 2 * node + 1
    while len(picked) < steps:
        lo, up = _stretch(seen, need, room, site, lo, up, steps - len(picked), power, picked)
    at = np.array(picked)
    return (
        lo,
        np.concatenate(seen.per_rack)[at],
        np.concatenate(seen.extra)[at],
        np.concatenate(seen.fit)[at],
    )


def _stretch(
    seen: _Asked,
    need: Needs,
    room: np.ndarray,
    site: float,
    lo: float,
    up: float,
    left: int,
    power: float,
    picked: list[int],
) -> tuple[float, float]:
    """One batch of :func:`bisect_predicted`: the mids of the ``left`` remaining steps
    along the predicted path, asked at once, followed while the rooms decide as
    predicted and one step further; the steps taken are appended to ``picked`` (their
    indices among the asked speeds). Returns the interval left."""
    s = seen.predict(lo, up, power)
    mids, guess = [], []
    x, y = lo, up
    for _ in range(left):  # the path if the fit changes at s
        m = 0.5 * (x + y)
        mids.append(m)
        ok = m <= s
        guess.append(ok)
        if ok:
            x = m
        else:
            y = m
    base = len(seen.x)
    fit = seen.ask(need, mids, room, site)
    for k, ok in enumerate(fit):
        picked.append(base + k)
        if ok:
            lo = mids[k]
        else:
            up = mids[k]
        if ok != guess[k]:  # the path leaves the prediction here
            break
    return lo, up


class _Asked:
    """The speeds :func:`bisect_predicted` asked so far, in order, with their needs,
    slacks and fits."""

    def __init__(self) -> None:
        self.x: list[float] = []
        self.slack: list[float] = []
        self.ok: list[bool] = []
        self.per_rack: list[np.ndarray] = []
        self.extra: list[np.ndarray] = []
        self.fit: list[np.ndarray] = []

    def ask(self, need: Needs, mids: list[float], room: np.ndarray, site: float) -> list[bool]:
        """The needs at ``mids``, kept; whether each fits."""
        _, per_rack, extra = need(mids)
        fit = np.logical_and.reduce(per_rack <= room, axis=-1) & (extra <= site)
        with np.errstate(invalid="ignore"):
            slack = np.minimum(np.min(room - per_rack, axis=-1, initial=np.inf), site - extra)
        ok = fit.tolist()
        self.x += mids
        self.slack += slack.tolist()
        self.ok += ok
        self.per_rack.append(per_rack)
        self.extra.append(extra)
        self.fit.append(fit)
        return ok

    def predict(self, lo: float, up: float, power: float) -> float:
        """Where the fit changes in ``[lo, up]``: interpolated between the highest asked
        speed there that fits and the lowest above it that does not (their slacks),
        else the middle of what is known."""
        a = b = None
        for k, x in enumerate(self.x):
            if lo <= x <= up:
                if self.ok[k]:
                    if a is None or x > self.x[a]:
                        a = k
                elif b is None or x < self.x[b]:
                    b = k
        if a is not None and b is not None and self.x[a] < self.x[b]:
            xa, xb, sa, sb = self.x[a], self.x[b], self.slack[a], self.slack[b]
            if sa >= 0 > sb and math.isfinite(sa - sb) and xa > 0:
                s = _interpolated(xa, xb, sa / (sa - sb), power)
                if xa <= s <= xb:
                    return s
            return 0.5 * (xa + xb)
        if a is not None:  # everything asked here fits: so may the rest
            return up
        if b is not None:  # nothing asked here fits: nor may the rest
            return lo
        return 0.5 * (lo + up)


def _interpolated(xa: float, xb: float, share: float, power: float) -> float:
    """The speed ``share`` of the way from ``xa`` to ``xb``, linearly in ``speed **
    power`` (linearly in the speed where that power is unusable); NaN on overflow."""
    if not (power > 0 and math.isfinite(power)):
        power = 1.0
    try:
        ua, ub = xa**power, xb**power
        return float((ua + (ub - ua) * share) ** (1.0 / power))
    except (OverflowError, ZeroDivisionError):
        return math.nan
