"""Batched bisection look-ahead and bit-exact masked sums, shared by the bounds.

A bisection that evaluates one point per step pays numpy's fixed cost per
call at every step; here each round evaluates every midpoint the next few
steps could visit (:func:`~ntp_opt.rules.bisection.midpoints`, which the
slow replicas' boost shares, and :func:`lookahead_depth`) and the caller
follows the path the steps take. :func:`masked_row_sums` sums selected
entries row by row, bit for bit as numpy sums each row alone.
"""

from __future__ import annotations

import numpy as np

from ntp_opt.rules.bisection import midpoints

__all__ = ["lookahead_depth", "masked_row_sums", "midpoints"]

_BATCH = 8192
"""About how many numbers one batched evaluation handles: look-ahead grows
while the work per call stays near numpy's fixed cost per call (speed only)."""


def lookahead_depth(per_point: int, searches: int, most: int = 8) -> int:
    """Look-ahead depth: the most bisection steps whose every midpoint fits one batch.

    Parameters
    ----------
    per_point
        About how many numbers one point's evaluation handles.
    searches
        How many searches run at once.
    most
        The deepest look-ahead.

    Returns
    -------
    int
        Between 1 and ``most``.
    """
    d = 1
    while d < most and (2 ** (d + 1) - 1) * per_point * searches <= _BATCH:
        d += 1
    return d


def masked_row_sums(on: np.ndarray, *xs: np.ndarray) -> list[np.ndarray]:
    """Per ``x`` in ``xs`` and per row, ``x[row][on[row]].sum()``: bit for bit, numpy's own sum.

    Rows with the same number of selected entries are summed together as a
    contiguous matrix, which numpy reduces row by row exactly as a 1-D array
    (the same pairwise order).

    Parameters
    ----------
    on
        Boolean matrix: the entries taken.
    *xs
        Matrices of the same shape as ``on``.

    Returns
    -------
    list of numpy.ndarray
        One vector of row sums per ``x``.
    """
    outs = [np.zeros(on.shape[0]) for _ in xs]
    counts = on.sum(axis=1)
    present = np.flatnonzero(np.bincount(counts, minlength=1)).tolist()
    for c in present:
        if c == 0:
            continue
        if len(present) == 1:  # every row selects c entries
            for out, x in zip(outs, xs, strict=True):
                out[:] = x[on].reshape(on.shape[0], c).sum(axis=1)
            break
        rows = np.flatnonzero(counts == c)
        sel = on[rows]
        for out, x in zip(outs, xs, strict=True):
            out[rows] = x[rows][sel].reshape(len(rows), c).sum(axis=1)
    return outs
