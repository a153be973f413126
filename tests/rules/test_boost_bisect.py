"""The slow replicas' bisection by predicted stretches equals the plain bisection (issue 30).

:func:`ntp_opt.rules.boost_needs.bisect_predicted` asks for the mids of a
predicted stretch of the path at once and follows the path the rooms decide;
the plain computation, written out here, takes one step at a time: mid, needs
at the mid, fit or not. Both must end at the same speed and record the same
steps bit for bit, with needs that are not monotone in the speed (the
predictions fail often) and with needs that grow with it, as real ones do
(the predictions mostly hold, and the rounding decides the last steps).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt.rules.boost_needs import bisect_predicted


def _need(
    coef: np.ndarray, wave: np.ndarray, mids: list[float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Needs depending on the speed alone, not monotone in it (any path can happen)."""
    m = np.array(mids)[:, None]
    per_rack = coef * m * m + np.sin(wave * m)
    return m, per_rack, per_rack.sum(axis=1) - np.cos(m[:, 0] * 7.0)


def _plain(
    need: partial[tuple[np.ndarray, np.ndarray, np.ndarray]],
    room: np.ndarray,
    site: float,
    lo: float,
    up: float,
    steps: int,
) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """One bisection step at a time (the reference)."""
    rows, extras, oks = [], [], []
    for _ in range(steps):
        mid = 0.5 * (lo + up)
        _, per_rack, extra = need([mid])
        ok = bool(np.all(per_rack[0] <= room)) and bool(extra[0] <= site)
        rows.append(per_rack[0])
        extras.append(extra[0])
        oks.append(ok)
        if ok:
            lo = mid
        else:
            up = mid
    return (
        lo,
        np.array(rows, dtype=float).reshape(-1, len(room)),
        np.array(extras, dtype=float),
        np.array(oks, dtype=bool),
    )


def _assert_same(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    """The same end and the same steps' rows, bit for bit."""
    assert got[0] == want[0]
    for x, y in zip(got[1:], want[1:], strict=True):
        assert x.dtype == y.dtype
        assert x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@given(
    st.integers(1, 5),
    st.integers(0, 2**32 - 1),
    st.integers(0, 60),
    st.floats(0.1, 2.0),
    st.floats(1e-12, 1.0),
)
def test_bisection_by_stretches_equals_one_step_at_a_time(
    width: int, seed: int, steps: int, lo: float, span: float
) -> None:
    rng = np.random.default_rng(seed)
    coef = rng.uniform(0.0, 3.0, width)
    wave = rng.uniform(0.0, 50.0, width)
    need = partial(_need, coef, wave)
    up = lo + span
    _, at_up, total_up = need([lo, up])
    room = rng.uniform(at_up.min(), at_up.max() + 1e-9, width)
    site = float(rng.uniform(total_up.min() - 1.0, total_up.max() + 1.0))
    got = bisect_predicted(need, room, site, lo, up, steps)
    want = _plain(need, room, site, lo, up, steps)
    _assert_same(got, want)


def _growing(
    coef: np.ndarray, power: float, mids: list[float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Needs growing with the speed, as a replica's watts do (``speed ** (1 / alpha)``)."""
    m = np.array(mids)[:, None]
    per_rack = coef * (m**power - 1.0)
    return m, per_rack, np.add.accumulate(per_rack, axis=1)[:, -1]


@given(
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
    st.integers(0, 60),
    st.floats(1.0, 3.0),
    st.floats(1e-9, 0.5),
    st.floats(-0.1, 1.1),
    st.sampled_from([1.0, 1.5, 2.0, 0.0, 400.0]),
)
def test_bisection_by_stretches_on_growing_needs(
    width: int, seed: int, steps: int, power: float, span: float, where: float, hint: float
) -> None:
    rng = np.random.default_rng(seed)
    coef = rng.uniform(100.0, 3000.0, width)
    need = partial(_growing, coef, power)
    lo, up = 1.0, 1.0 + span
    cut = lo + where * span  # the rooms run out about here (or never, or at once)
    _, at_cut, total_cut = need([cut])
    room = at_cut[0] * rng.uniform(1.0, 1.5, width)
    site = float(total_cut[0])
    got = bisect_predicted(need, room, site, lo, up, steps, power=hint)
    want = _plain(need, room, site, lo, up, steps)
    _assert_same(got, want)
