"""The batch split's candidates sorted by a stable sort of their times' bits equal the
sort by (time, replica) it replaced (issue 30).

``split_batch`` sorts every candidate ``b / v_r`` by time, ties by replica;
the plain computation, written out here, is :func:`numpy.lexsort` on (time,
replica). Speeds drawn from a few values make many ties (``16 / 1.0 == 15 /
0.9375``), extreme ones make huge and subnormal times.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ntp_opt.model.job import Job
from ntp_opt.rules import goodput as gp

_SPEEDS = st.one_of(
    st.sampled_from([0.5, 0.75, 0.9375, 1.0, 1.5, 2.0, 1e-300, 1e308]),
    st.floats(1e-3, 1e3),
)


def _plain(job: Job, v: np.ndarray, per: int) -> tuple[np.ndarray, ...]:
    """The candidates by (time, replica) with :func:`numpy.lexsort` (the reference)."""
    n = len(v)
    counts = gp._candidate_counts(v, per, job.global_batch, n)
    owner = np.repeat(np.arange(n), counts)
    starts = np.cumsum(counts) - counts
    b = (np.arange(len(owner)) - starts[owner] + 1).astype(float)
    times = b / v[owner]
    order = np.lexsort((owner, times))
    return times[order], owner[order], (b == 1.0)[order]


@given(st.lists(_SPEEDS, min_size=1, max_size=40), st.integers(1, 24), st.integers(0, 300))
def test_sorted_candidates_equal_the_lexsort(speeds: list[float], per: int, extra: int) -> None:
    v = np.array(speeds, dtype=float)
    job = Job(tp=8, pp=1, dp=len(v), global_batch=len(v) + extra)
    got = gp._sorted_candidates(job, v, per)
    want = _plain(job, v, per)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype
        assert x.tobytes() == y.tobytes()
