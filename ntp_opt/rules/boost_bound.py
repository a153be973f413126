"""Bounds on what the boosts can bring, without running them.

The re-planner re-boosts each plan it makes
(:func:`ntp_opt.workflows.incremental.reboost_layout`) with the slow replicas'
boost and the common-speed boost of :mod:`ntp_opt.rules.boost`, and computes a
boost only where a bound on its goodput can win. :func:`floor_speed_bound`
bounds the common speed the site's room allows.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ntp_opt.rules.tolerances import BOOST_MARGIN

if TYPE_CHECKING:
    from ntp_opt.model.instance import Instance

__all__ = ["FLOOR_SLACK", "floor_speed_bound"]


FLOOR_SLACK = 1e-9
"""Relative slack :func:`floor_speed_bound` adds to its bound: far above the rounding
of the draws it sums and of the speeds the floor's multipliers give."""


def floor_speed_bound(
    instance: Instance,
    base: np.ndarray,
    caps: np.ndarray,
    sizes: np.ndarray,
    site_room: float,
    *,
    margin: float = BOOST_MARGIN,
) -> float:
    """An upper bound on the common speed :func:`~ntp_opt.rules.boost.boost_floor_stages` reaches.

    The floor boost's speed ``tau`` (in its units: a stage's ``base`` times its
    multiplier to the power ``alpha``) is at most ``top``, the least of the
    stages' speeds at their caps, and its extra draw over power 1 must fit the
    site: ``F(tau) <= site_room * (1 - margin)``, ``F`` the sum over stages of
    their watts at power 1 times their multiplier at ``tau`` minus 1. Below
    ``top`` no stage is capped, so a stage adds
    ``max((tau / base) ** (1 / alpha), 1) - 1`` times its watts. ``F`` is thus
    convex and non-decreasing for ``alpha <= 1``, and so is the lower bound
    used here (each stage's watts taken as its GPUs times the least TDP).
    Newton steps from ``top`` on that lower bound stay above its root, hence
    above ``F``'s (each tangent lies below the function); the last one, plus
    :data:`FLOOR_SLACK`, is returned. The racks are left out (they only lower
    ``tau``).

    Parameters
    ----------
    instance
        The instance.
    base
        Per stage, its degree's factor times its slowest GPU's speed.
    caps
        Per stage, its largest multiplier (at least 1, as
        :attr:`~ntp_opt.model.instance.Instance.max_multiplier`).
    sizes
        GPUs per stage.
    site_room
        Watts left at the site at power 1 (:func:`~ntp_opt.rules.power.headroom`).
    margin
        Share of the room left unspent (as the boost's).

    Returns
    -------
    float
        A speed no lower than the boost's ``tau``; ``inf`` when no bound is
        known (no stage, a cap below 1, or ``alpha`` not in ``(0, 1]``).
    """
    tdp = instance.arrays.tdp
    alpha = instance.job.power_exponent
    some = sizes > 0
    if not some.any() or not 0.0 < alpha <= 1.0:
        return math.inf
    base, caps, sizes = base[some], caps[some], sizes[some]
    if not bool((caps >= 1.0).all()):  # as Instance.max_multiplier: never below 1
        return math.inf
    top = float((base * caps**alpha).min())
    # the watts each stage adds above its base: at least its GPUs times the least
    # TDP, summed per distinct base
    bases, which = np.unique(base, return_inverse=True)
    watts = np.bincount(which, weights=sizes) * float(tdp.min())
    inv = 1.0 / alpha
    room = site_room * (1.0 - margin)
    t = top
    for _ in range(8):
        k = int(np.searchsorted(bases, t))  # the bases below t
        q = (t / bases[:k]) ** inv
        draw = float((watts[:k] * (q - 1.0)).sum())
        if not draw > room:
            break
        slope = float((watts[:k] * q).sum()) * inv / t
        nxt = t - (draw - room) / slope if slope > 0 else t
        if not nxt < t:
            break
        t = nxt
    return t * (1.0 + FLOOR_SLACK)
