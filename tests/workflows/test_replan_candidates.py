"""The swap search's candidates with what the last round computed kept equal the
candidates computed in full (issue 30).

:func:`ntp_opt.planners.swaps._candidates` keeps each focus replica's swap
gains and every replica's tables and minima times f(t); after a move it
recomputes only the moved replicas' rows and gain columns. Here random slot
tables (few distinct values: ties and equal rows) go through a chain of
moves (two replicas' slots swapped, or one replica's slot with a spare's)
and each round's candidates, gains, tables and minima are compared with
the plain call's (no kept numbers) and with one slot pair at a time.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt.planners.swaps import _candidates, _exclusive_min


def _plain_gain(big: np.ndarray, speeds: list[float], f: np.ndarray, a_i: int) -> np.ndarray:
    """Replica ``a_i``'s swap gains, one slot pair at a time (the reference)."""
    n_rep, pp, _ = big.shape
    gain = np.full((pp, n_rep, pp), -np.inf)
    for b in range(n_rep):
        if b == a_i:
            continue
        for i in range(pp):
            for j in range(pp):
                ta, tb = big[a_i].copy(), big[b].copy()
                ta[i], tb[j] = big[b, j], big[a_i, i]
                va = float(np.max(np.min(ta, axis=0) * f))
                vb = float(np.max(np.min(tb, axis=0) * f))
                gain[i, b, j] = va + vb - speeds[a_i] - speeds[b]
    return gain


@given(
    st.integers(2, 6),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(0, 2**32 - 1),
    st.integers(1, 4),
)
def test_kept_gains_give_the_same_candidates(
    n_rep: int, pp: int, n_deg: int, n_spare: int, seed: int, rounds: int
) -> None:
    rng = np.random.default_rng(seed)
    big = rng.choice([0.0, 0.5, 0.8, 1.0], (n_rep, pp, n_deg))
    spare = [rng.choice([0.0, 0.5, 0.8, 1.0], n_deg) for _ in range(n_spare)]
    f = rng.choice([0.9, 1.0], n_deg)
    s: Any = SimpleNamespace(factor=f)
    speeds = [float(np.max(np.min(t, axis=0) * f)) for t in big]
    focus = {int(x) for x in rng.integers(0, n_rep, 2)}
    kept: dict[int | str, np.ndarray] = {}
    moved: set[int] | None = None
    for _ in range(rounds):
        plain = _candidates(s, big, speeds, spare, focus, 3)
        got = _candidates(s, big, speeds, spare, focus, 3, kept, moved)
        assert got == plain
        assert np.array_equal(kept["fbig"], big * f)
        assert np.array_equal(kept["fex"], _exclusive_min(big) * f)
        for a_i in focus:  # the gains themselves, against one slot pair at a time
            ref = _plain_gain(big, speeds, f, a_i)
            np.testing.assert_allclose(kept[a_i], ref, rtol=0, atol=1e-12)
        a_i = int(rng.choice(sorted(focus)))
        i = int(rng.integers(pp))
        if spare and rng.random() < 0.3:
            j = int(rng.integers(len(spare)))
            big[a_i, i], spare[j] = spare[j].copy(), big[a_i, i].copy()
            moved = {a_i}
        else:
            b_i = int(rng.choice([b for b in range(n_rep) if b != a_i]))
            j = int(rng.integers(pp))
            big[a_i, i], big[b_i, j] = big[b_i, j].copy(), big[a_i, i].copy()
            moved = {a_i, b_i}
            focus.add(b_i)
        for r in moved:
            speeds[r] = float(np.max(np.min(big[r], axis=0) * f))
