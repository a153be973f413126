"""Failure scenarios over the planning horizon (docs/model.md, spec section 4).

Within the horizon every healthy GPU fails with its ``p_fail`` and every tray
with its tray ``p_fail`` (taking all its GPUs), independently. These are the
*failure units*. ``blast_radius`` widens what one unit failure takes down:

* ``"gpu"``: a GPU unit takes that GPU, a tray unit its tray (the spec);
* ``"tray"``: every unit failure takes its whole tray;
* ``"domain"``: every unit failure takes its whole NVLink domain.

``scale`` multiplies every probability (clipped to 1) for sensitivity studies.
GPUs that are already failed in the instance stay failed and are never
reported as new failures. See ``docs/failures.md``.

Sampling is vectorised and sparse: for small probabilities it draws only the
positions of failures in the (scenario x unit) grid (a Bernoulli process with
the largest probability via geometric gaps, then thinning to each unit's own
probability), so its cost grows with the number of failures, not with
``n x units``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Literal

import numpy as np

from ntp_opt.model.instance import Instance

BlastRadius = Literal["gpu", "tray", "domain"]
BLAST_RADII: tuple[str, ...] = ("gpu", "tray", "domain")

#: Largest number of independent failure units :func:`enumerate_scenarios` accepts.
MAX_EXACT_UNITS = 20
#: Above this largest probability, sampling draws a dense uniform matrix (in chunks).
_SPARSE_MAX_P = 0.05
#: Cells per chunk of the dense sampler.
_DENSE_CHUNK = 1 << 23


def _groups(key: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of GPU indices by group: ``(members, offsets)``, graph order inside a group."""
    order = np.argsort(key, kind="stable")
    offsets = np.searchsorted(key[order], np.arange(n_groups + 1))
    return order.astype(np.int64), offsets.astype(np.int64)


def _expand(
    rows: np.ndarray, groups: np.ndarray, members: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every (row, GPU) pair of the groups hit in each (row, group) event."""
    counts = offsets[groups + 1] - offsets[groups]
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    starts = offsets[groups]
    first = np.cumsum(counts) - counts
    pos = np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)
    return np.repeat(rows.astype(np.int64), counts), members[pos]


class _Units:
    """The independent failure units of an instance and what each one takes down."""

    def __init__(self, instance: Instance, blast_radius: str, scale: float) -> None:
        if blast_radius not in BLAST_RADII:
            raise ValueError(f"blast_radius must be one of {BLAST_RADII}, got {blast_radius!r}")
        if not (np.isfinite(scale) and scale >= 0):
            raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
        a = instance.arrays
        self.n_gpus = a.n_gpus
        self.healthy = a.healthy
        gpu_p = np.minimum(a.p_fail * scale, 1.0)
        tray_p = np.minimum(a.tray_p_fail * scale, 1.0)
        # A unit with no healthy GPU in its blast radius changes nothing: skip it.
        tray_alive = np.bincount(a.gpu_tray[a.healthy], minlength=len(a.tray_ids)) > 0
        dom_alive = np.bincount(a.gpu_domain[a.healthy], minlength=a.n_domains) > 0
        self.gpu_units = np.flatnonzero(a.healthy & (gpu_p > 0))
        self.gpu_p = gpu_p[self.gpu_units]
        tray_domain = np.zeros(len(a.tray_ids), dtype=np.int64)
        tray_domain[a.gpu_tray] = a.gpu_domain
        if blast_radius == "domain":
            tray_ok = dom_alive[tray_domain]
        else:
            tray_ok = tray_alive
        self.tray_units = np.flatnonzero((tray_p > 0) & tray_ok)
        self.tray_p = tray_p[self.tray_units]
        self.blast_radius = blast_radius
        # Each unit hits one group: a GPU (radius gpu), a tray or a domain.
        if blast_radius == "gpu":
            self.gpu_unit_group = self.gpu_units
            self.tray_group_kind = "tray"
        elif blast_radius == "tray":
            self.gpu_unit_group = a.gpu_tray[self.gpu_units]
            self.tray_group_kind = "tray"
        else:
            self.gpu_unit_group = a.gpu_domain[self.gpu_units]
            self.tray_group_kind = "domain"
        self.tray_unit_group = (
            self.tray_units if self.tray_group_kind == "tray" else tray_domain[self.tray_units]
        )
        self._tray_csr = _groups(a.gpu_tray, len(a.tray_ids))
        self._dom_csr = _groups(a.gpu_domain, a.n_domains)
        self._gpu_csr = (np.arange(a.n_gpus, dtype=np.int64), np.arange(a.n_gpus + 1))

    def _csr(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        return {"gpu": self._gpu_csr, "tray": self._tray_csr, "domain": self._dom_csr}[kind]

    def gpu_kind(self) -> str:
        return {"gpu": "gpu", "tray": "tray", "domain": "domain"}[self.blast_radius]

    def expand(
        self, rows_g: np.ndarray, units_g: np.ndarray, rows_t: np.ndarray, units_t: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(row, GPU) pairs of newly failed healthy GPUs, deduplicated, sorted by row."""
        kind_g, kind_t = self.gpu_kind(), self.tray_group_kind
        grp_g, grp_t = self.gpu_unit_group[units_g], self.tray_unit_group[units_t]
        if kind_g == kind_t:
            # Same kind of group: deduplicate the (row, group) hits before expanding.
            n_groups = len(self._csr(kind_g)[1]) - 1
            key = np.unique(np.concatenate([rows_g * n_groups + grp_g, rows_t * n_groups + grp_t]))
            rows, gpus = _expand(key // n_groups, key % n_groups, *self._csr(kind_g))
            keep = self.healthy[gpus]
            return rows[keep], gpus[keep]
        r1, g1 = _expand(rows_g, grp_g, *self._csr(kind_g))
        r2, g2 = _expand(rows_t, grp_t, *self._csr(kind_t))
        rows = np.concatenate([r1, r2])
        gpus = np.concatenate([g1, g2])
        keep = self.healthy[gpus]
        key = np.unique(rows[keep] * self.n_gpus + gpus[keep])
        return key // self.n_gpus, key % self.n_gpus

    def unit_masks(self) -> list[tuple[float, np.ndarray]]:
        """``(probability, GPU indices taken down)`` of every unit (for enumeration)."""
        out = []
        for p, grp in zip(self.gpu_p, self.gpu_unit_group, strict=True):
            members, offsets = self._csr(self.gpu_kind())
            g = members[offsets[grp] : offsets[grp + 1]]
            out.append((float(p), g[self.healthy[g]]))
        for p, grp in zip(self.tray_p, self.tray_unit_group, strict=True):
            members, offsets = self._csr(self.tray_group_kind)
            g = members[offsets[grp] : offsets[grp + 1]]
            out.append((float(p), g[self.healthy[g]]))
        return out


def _bernoulli_positions(
    rng: np.random.Generator, n: int, p: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(row, unit) of the successes of independent Bernoulli(p[unit]) in an n x len(p) grid."""
    m = len(p)
    if n == 0 or m == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    p_max = float(p.max())
    if p_max <= 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    total = n * m
    if p_max <= _SPARSE_MAX_P:
        # Bernoulli(p_max) process over the flattened grid: geometric gaps ...
        parts = []
        last = -1
        while True:
            left = total - last - 1
            expect = left * p_max
            k = int(expect + 6.0 * np.sqrt(expect) + 64)
            pos = last + np.cumsum(rng.geometric(p_max, size=k))
            parts.append(pos[pos < total])
            if pos[-1] >= total:
                break
            last = int(pos[-1])
        flat = np.concatenate(parts)
        # ... then thinning to each unit's own probability.
        unit = flat % m
        if np.any(p < p_max):
            keep = rng.random(len(flat)) * p_max < p[unit]
            flat, unit = flat[keep], unit[keep]
        return flat // m, unit
    rows_out, units_out = [], []
    chunk = max(1, _DENSE_CHUNK // m)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        hit = rng.random((stop - start, m)) < p[None, :]
        r, u = np.nonzero(hit)
        rows_out.append(r + start)
        units_out.append(u)
    return np.concatenate(rows_out).astype(np.int64), np.concatenate(units_out).astype(np.int64)


def sample_failure_events(
    instance: Instance,
    n: int,
    *,
    seed: int | np.random.Generator = 0,
    blast_radius: str = "gpu",
    scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Sparse form of :func:`sample_failures`: ``(scenario, gpu)`` index pairs.

    The pairs are sorted by scenario, without duplicates; only GPUs
    healthy in ``instance`` appear. Same random stream as :func:`sample_failures`.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    units = _Units(instance, blast_radius, scale)
    rng = np.random.default_rng(seed)
    rows_g, units_g = _bernoulli_positions(rng, n, units.gpu_p)
    rows_t, units_t = _bernoulli_positions(rng, n, units.tray_p)
    return units.expand(rows_g, units_g, rows_t, units_t)


def sample_failures(
    instance: Instance,
    n: int,
    *,
    seed: int | np.random.Generator = 0,
    blast_radius: str = "gpu",
    scale: float = 1.0,
) -> np.ndarray:
    """Sample ``n`` failure scenarios.

    Parameters
    ----------
    instance
        The instance; GPU ``p_fail`` and tray ``p_fail`` give the probabilities.
    n
        Number of scenarios.
    seed
        Seed (or generator) of ``numpy.random.default_rng``; equal seeds give
        equal scenarios.
    blast_radius
        ``"gpu"``, ``"tray"`` or ``"domain"`` (module docstring).
    scale
        Multiplies every probability (clipped to 1).

    Returns
    -------
    numpy.ndarray
        Bool, shape ``(n, n_gpus)`` in the order of ``instance.arrays.gpu_ids``:
        True where a healthy GPU fails within the horizon. GPUs already failed
        in the instance are always False (they are not new failures).
    """
    rows, gpus = sample_failure_events(
        instance, n, seed=seed, blast_radius=blast_radius, scale=scale
    )
    mask = np.zeros((n, instance.arrays.n_gpus), dtype=bool)
    mask[rows, gpus] = True
    return mask


def failure_units(instance: Instance, blast_radius: str = "gpu", scale: float = 1.0) -> int:
    """Number of independent failure units that can change the cluster."""
    u = _Units(instance, blast_radius, scale)
    return len(u.gpu_p) + len(u.tray_p)


def enumerate_scenarios(
    instance: Instance, blast_radius: str = "gpu", scale: float = 1.0
) -> Iterator[tuple[np.ndarray, float]]:
    """Every distinct failure scenario with its probability (small instances only).

    Enumerates all ``2**u`` outcomes of the ``u`` independent failure units
    (healthy GPUs and trays with ``p_fail > 0`` that can take a healthy GPU
    down), merges outcomes that fail the same GPUs and yields
    ``(mask, probability)`` for each distinct mask with positive probability;
    the probabilities sum to 1. Masks are as in :func:`sample_failures`.

    Raises
    ------
    ValueError
        If there are more than :data:`MAX_EXACT_UNITS` units.
    """
    units = _Units(instance, blast_radius, scale)
    unit_list = units.unit_masks()
    if len(unit_list) > MAX_EXACT_UNITS:
        raise ValueError(
            f"{len(unit_list)} independent failure units (GPUs and trays with p_fail > 0): "
            f"exact enumeration is limited to {MAX_EXACT_UNITS}; use Monte Carlo"
        )
    n_gpus = units.n_gpus
    merged: dict[bytes, float] = {}
    masks: dict[bytes, np.ndarray] = {}
    for outcome in itertools.product((False, True), repeat=len(unit_list)):
        prob = 1.0
        mask = np.zeros(n_gpus, dtype=bool)
        for hit, (p, gpus) in zip(outcome, unit_list, strict=True):
            if hit:
                prob *= p
                mask[gpus] = True
            else:
                prob *= 1.0 - p
        if prob <= 0.0:
            continue
        key = np.packbits(mask).tobytes()
        if key not in merged:
            merged[key] = 0.0
            masks[key] = mask
        merged[key] += prob
    for key, prob in merged.items():
        yield masks[key], prob


def failed_instance(instance: Instance, failed_mask: np.ndarray) -> Instance:
    """The instance after the failures of ``failed_mask``.

    Same name, job and meta; the graph with those GPUs ``state="failed"``
    (:meth:`Instance.with_health`: only their nodes are copied).

    Parameters
    ----------
    instance
        The instance.
    failed_mask
        Per GPU (``instance.arrays`` order), whether it fails.

    Returns
    -------
    Instance
    """
    a = instance.arrays
    mask = np.asarray(failed_mask, dtype=bool)
    if mask.shape != (a.n_gpus,):
        raise ValueError(f"failed_mask must have shape ({a.n_gpus},), got {mask.shape}")
    return instance.with_health(healthy=a.healthy & ~mask)
