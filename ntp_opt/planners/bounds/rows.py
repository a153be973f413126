"""Each domain's *row* (healthy GPU count, speeds, TDPs, largest cap) and the
classes of equal rows that :func:`~ntp_opt.planners.bounds.stage.stage_bound` works on.

Re-planning keeps the rows and recomputes only those of the domains an
event touches (:func:`domain_rows_after`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.rules.tolerances import POWER_TOL

__all__ = ["ClassTable", "DomainRows", "distinct_rows", "domain_rows", "domain_rows_after"]


@dataclass(frozen=True, eq=False)
class DomainRows:
    """Per domain, what :func:`~ntp_opt.planners.bounds.stage.stage_bound` classifies
    it by (its *row*).

    ``key[d]``: the healthy GPU count, the healthy speeds descending and TDPs
    ascending (zero-padded to ``width`` columns each), and the largest
    multiplier cap (with the validator's tolerance). Domains with equal rows
    form one class. Kept by re-planning, which recomputes only the rows of
    the domains an event touches (:func:`domain_rows_after`), and with
    them the classes (:meth:`classes`).
    """

    key: np.ndarray
    width: int
    known: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    """The classes (:meth:`classes`) and each domain's class, once computed."""

    def classes(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct rows (lexicographic order) and how many domains have each.

        ``np.unique(key, axis=0, return_counts=True)`` (``-0.0`` read as
        ``0.0``), computed once and kept; :func:`domain_rows_after` updates
        them for the domains it recomputes.
        """
        if self.known is None:
            object.__setattr__(self, "known", _row_classes(self.key))
        assert self.known is not None
        return self.known[0], self.known[1]

    def domain_class(self) -> np.ndarray:
        """Each domain's class (an index into :meth:`classes`)."""
        self.classes()
        assert self.known is not None
        return self.known[2]


def domain_rows(instance: Instance) -> DomainRows:
    """Every domain's row (:class:`DomainRows`)."""
    job = instance.job
    a = instance.arrays
    ok = a.healthy
    # per domain: the largest cap of its healthy GPUs bounds every stage's multiplier
    dom_cap = np.ones(a.n_domains)
    if job.power_exponent > 0:
        np.maximum.at(dom_cap, a.gpu_domain[ok], instance.max_multiplier[ok])
    dom_hi = dom_cap * (1 + POWER_TOL)
    # per domain: healthy speeds descending and TDPs ascending, zero-padded
    dom = a.gpu_domain[ok]
    spd = a.speed[ok]
    tdp = a.tdp[ok]
    h = np.bincount(dom, minlength=a.n_domains)
    width = max(int(h.max(initial=0)), job.tp)  # every degree indexes a column
    starts = np.concatenate(([0], np.cumsum(h)[:-1]))
    by_speed = np.lexsort((-spd, dom))
    pos = np.arange(len(dom)) - starts[dom[by_speed]]
    speeds = np.zeros((a.n_domains, width))
    speeds[dom[by_speed], pos] = spd[by_speed]
    by_tdp = np.lexsort((tdp, dom))
    tdps = np.zeros((a.n_domains, width))
    tdps[dom[by_tdp], np.arange(len(dom)) - starts[dom[by_tdp]]] = tdp[by_tdp]
    key = np.hstack([h[:, None].astype(float), speeds, tdps, dom_hi[:, None]])
    return DomainRows(key, width)


def domain_rows_after(instance: Instance, rows: DomainRows, domains: list[int]) -> DomainRows:
    """``rows`` with the rows of ``domains`` recomputed from ``instance`` (copy-on-write).

    Equal to ``domain_rows(instance)`` when only those domains changed
    (their health, speeds, caps or TDPs); recomputed in full when a domain
    outgrows the width.
    """
    job = instance.job
    a = instance.arrays
    width = rows.width
    key = rows.key.copy()
    domains = sorted(set(domains))
    for d in domains:
        members = a.domain_gpus[d]
        live = members[a.healthy[members]]
        n = len(live)
        if n > width:
            return domain_rows(instance)
        cap = 1.0
        if job.power_exponent > 0 and n:
            cap = max(1.0, float(instance.max_multiplier[live].max()))
        row = np.zeros(2 * width + 2)
        row[0] = n
        row[1 : 1 + n] = np.sort(a.speed[live])[::-1]
        row[1 + width : 1 + width + n] = np.sort(a.tdp[live])
        row[-1] = cap * (1 + POWER_TOL)
        key[d] = row
    if width > job.tp and not (key[:, 0] == width).any():
        return domain_rows(instance)  # the widest domain shrank: the width with it
    if not domains:
        return DomainRows(key, width, rows.known)
    if rows.known is None:
        return DomainRows(key, width)
    # the classes: the old ones less the recomputed domains, plus their new rows
    old_class = rows.domain_class()
    reps, counts = rows.classes()
    counts = counts.copy()
    np.subtract.at(counts, old_class[domains], 1)
    idx: list[int] = []
    extra: list[np.ndarray] = []
    for row in key[domains] + 0.0:
        hit = np.flatnonzero((reps == row).all(axis=1))
        if hit.size:
            idx.append(int(hit[0]))
            continue
        j = next((j for j, r in enumerate(extra) if np.array_equal(r, row)), len(extra))
        if j == len(extra):
            extra.append(row)
        idx.append(len(reps) + j)
    cand = np.vstack([reps, *extra]) if extra else reps
    total = np.concatenate([counts, np.zeros(len(extra), dtype=counts.dtype)])
    np.add.at(total, idx, 1)
    alive = np.flatnonzero(total > 0)
    order = np.lexsort(cand[alive].T[::-1])  # first column most significant
    renumber = np.full(len(cand), -1, dtype=np.int64)
    renumber[alive[order]] = np.arange(len(order))
    of = renumber[old_class]
    of[domains] = renumber[idx]
    return DomainRows(key, width, (cand[alive[order]], total[alive[order]], of))


_FEW_ROWS = 256
"""Rows up to which :func:`distinct_rows` sorts them in Python."""


def distinct_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(x, axis=0, return_index=True, return_inverse=True)[1:]`` of a
    2-D float matrix: each distinct row's first index (rows in lexicographic
    order) and each row's distinct row.

    A few rows with no NaN are sorted as tuples in Python (the same order and
    the same equalities, ``-0.0`` equal to ``0.0``, the first of equal rows
    kept): the same indices without ``numpy.unique``'s fixed cost; else
    ``numpy.unique`` answers.
    """
    n = len(x)
    if n > _FEW_ROWS or bool(np.isnan(x).any()):
        _, first, inverse = np.unique(x, axis=0, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    rows = [tuple(r) for r in x.tolist()]
    seen: dict[tuple[float, ...], int] = {}
    for i, r in enumerate(rows):
        seen.setdefault(r, i)
    keys = sorted(seen)
    rank = {k: j for j, k in enumerate(keys)}
    first = np.array([seen[k] for k in keys], dtype=np.int64)
    return first, np.array([rank[r] for r in rows], dtype=np.int64)


def _unique_rows(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(key, axis=0, return_counts=True)`` for a float matrix, faster
    (:func:`_row_classes` without the inverse)."""
    rows, counts, _ = _row_classes(key)
    return rows, counts


def _row_classes(key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(key, axis=0, return_counts=True, return_inverse=True)``, faster.

    The same rows in the same (lexicographic) order with the same counts,
    and each row's class: rows are grouped by a hash of their bits
    (checked; on a collision the plain ``np.unique`` answers), and only the
    distinct rows are sorted. ``-0.0`` is read as ``0.0``.
    """
    key = np.ascontiguousarray(key + 0.0)  # -0.0 -> 0.0: equal rows, equal bits
    n, m = key.shape
    if n == 0 or m == 0:
        rows, inv, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
        return rows, counts, inv.reshape(-1)
    bits = key.view(np.uint64)
    mult = np.arange(1, 2 * m, 2, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    mult |= np.uint64(1)
    hashed = (bits * mult).sum(axis=1, dtype=np.uint64)  # wraps: a hash, checked below
    _, first, inverse = np.unique(hashed, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    reps = key[first]
    if not np.array_equal(reps[inverse], key):
        rows, inv, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
        return rows, counts, inv.reshape(-1)
    order = np.lexsort(reps.T[::-1])  # first column most significant
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return reps[order], np.bincount(inverse, minlength=len(reps))[order], rank[inverse]


@dataclass(frozen=True, eq=False)
class ClassTable:
    """The domain classes as the case bounds read them, and the site's power room.

    Attributes
    ----------
    h
        Healthy GPU count per class.
    speeds, tdps
        Per class, healthy speeds descending and TDPs ascending (zero-padded).
    cum_w
        Per class, the sum of its ``k`` smallest TDPs in column ``k``.
    counts
        How many domains each class has.
    hi
        Per class, the largest multiplier cap of its GPUs (with the validator's tolerance).
    room
        The site's power room above idle (watts).
    """

    h: np.ndarray
    speeds: np.ndarray
    tdps: np.ndarray
    cum_w: np.ndarray
    counts: np.ndarray
    hi: np.ndarray
    room: float
