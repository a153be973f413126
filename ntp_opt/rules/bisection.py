"""Every midpoint the next steps of a bisection can visit (batched bisections).

A bisection that evaluates one point per step pays numpy's fixed cost per
call at every step; batched bisections evaluate at once every midpoint the
next few steps could visit and follow the path the steps take: the bounds
(:mod:`ntp_opt.planners.bounds.batched`) and the slow replicas' boost
(:func:`ntp_opt.rules.boost_needs.bisect_predicted`, its first batch).
"""

from __future__ import annotations

import numpy as np

__all__ = ["midpoints"]

_PY_MIDPOINTS = 256
"""Up to this many midpoints per call are computed as Python floats (speed only)."""


def midpoints(los: list[float], ups: list[float], depth: int) -> list[list[float]]:
    """Every midpoint the next ``depth`` bisection steps can visit, per interval.

    A few midpoints as Python floats (``0.5 * (lo + up)`` is the same IEEE
    double numpy gives, without numpy's fixed cost per call); many with numpy.

    Parameters
    ----------
    los, ups
        The intervals ``[los[i], ups[i]]``.
    depth
        How many bisection steps to look ahead.

    Returns
    -------
    list of list of float
        One row per interval, level by level (heap order).
    """
    if len(los) * (2**depth - 1) > _PY_MIDPOINTS:
        return _numpy_midpoints(los, ups, depth)
    out = []
    for lo, up in zip(los, ups, strict=True):
        row: list[float] = []
        level = [(lo, up)]
        for _ in range(depth):
            nxt = []
            for a, b in level:
                m = 0.5 * (a + b)
                row.append(m)
                nxt += [(a, m), (m, b)]
            level = nxt
        out.append(row)
    return out


def _numpy_midpoints(los: list[float], ups: list[float], depth: int) -> list[list[float]]:
    """:func:`midpoints` computed with numpy (many intervals or a deep look-ahead)."""
    lo_l = np.array(los)[:, None]
    up_l = np.array(ups)[:, None]
    levels = []
    for _ in range(depth):
        mid = 0.5 * (lo_l + up_l)
        levels.append(mid)
        lo_l = np.stack([lo_l, mid], axis=2).reshape(len(los), -1)
        up_l = np.stack([mid, up_l], axis=2).reshape(len(los), -1)
    rows: list[list[float]] = np.concatenate(levels, axis=1).tolist()
    return rows
