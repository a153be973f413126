"""Availability of uniform tensor-parallel (TP) groups under random GPU failures.

The cluster of ``n_gpus`` GPUs is partitioned into ``n_gpus // tp`` TP groups, each a
block of ``tp`` consecutive GPUs. With uniform tensor parallelism a TP group is
unavailable as soon as any one of its GPUs has failed. *Availability* is the expected
fraction of TP groups with no failed GPU; because all groups have the same size this is
also the expected fraction of GPUs that sit in healthy groups.

Three ways of computing it are provided:

:func:`availability_exact`
    Exactly ``n_failed`` distinct GPUs fail, chosen uniformly at random. By linearity of
    expectation the availability equals the probability that one fixed group is
    untouched, the hypergeometric term ``C(N - tp, f) / C(N, f)``, evaluated as the
    running product ``prod_{i < tp} (N - f - i) / (N - i)`` (``tp`` factors, each in
    ``[0, 1]``, so no overflow or cancellation for any ``N``).
:func:`availability_binomial`
    Every GPU fails independently with probability ``p``: ``(1 - p) ** tp``.
:func:`availability_sampled`
    Monte Carlo estimate of the exact model, vectorised over samples with numpy.

Reproducing the paper
---------------------
"Nonuniform-Tensor-Parallelism" (arXiv:2504.06095) reports, for a 32,768-GPU cluster
with 0.1 % failed GPUs, availabilities of about 99.2 % (TP8), 98.4 % (TP16), 96.9 %
(TP32) and 93.9 % (TP64); see :data:`PUBLISHED_AVAILABILITY`. The paper does not say
which failure model it used. Evaluated numerically (percent):

=====  =========  ==============  ==============  ==========================
TP     published  exact, f = 32   exact, f = 33   binomial, p = 0.001
=====  =========  ==============  ==============  ==========================
8      99.2       99.221          99.197          99.203
16     98.4       98.449          98.400          98.412
32     96.9       96.920          96.826          96.849
64     93.9       93.933          93.749          93.797
=====  =========  ==============  ==============  ==========================

Only the exact model with ``f = 32`` failed GPUs (0.1 % of 32,768 = 32.77, rounded
down; :data:`PAPER_N_FAILED`) matches all four published values within 0.05
percentage points. ``f = 33`` (rounded to nearest) misses TP64 by 0.15 pp and the
binomial model with ``p = 0.001`` misses it by 0.10 pp. The binomial model with
``p = f / N = 32 / 32768`` agrees with the exact ``f = 32`` values to within
0.006 pp, i.e. the discrepancy is caused by rounding the number of failures, not by
sampling with versus without replacement. We therefore use ``N = 32768``, ``f = 32``
(:data:`PAPER_N_GPUS`, :data:`PAPER_N_FAILED`) as the paper's scenario.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import TypedDict

import numpy as np
import numpy.typing as npt

__all__ = [
    "PAPER_N_FAILED",
    "PAPER_N_GPUS",
    "PUBLISHED_AVAILABILITY",
    "AvailabilityRow",
    "availability_binomial",
    "availability_exact",
    "availability_sampled",
    "availability_table",
]

# Availability of uniform TP groups on a 32,768-GPU cluster with 0.1 % of GPUs failed,
# as reported in "Nonuniform-Tensor-Parallelism", arXiv:2504.06095 (values read from the
# paper, rounded to 0.1 percentage point). Keys are the TP degree.
PUBLISHED_AVAILABILITY: dict[int, float] = {8: 0.992, 16: 0.984, 32: 0.969, 64: 0.939}

#: Cluster size of the paper's availability scenario.
PAPER_N_GPUS = 32768
#: Number of failed GPUs in the paper's scenario: 0.1 % of 32,768, rounded down.
PAPER_N_FAILED = 32

# z-value of a two-sided 95 % normal confidence interval.
_Z95 = 1.96
# Use Floyd's algorithm while f**2 <= _FLOYD_FACTOR * N, random keys otherwise (the two
# cost about the same at the switch-over, measured at N = 32768).
_FLOYD_FACTOR = 16
# Upper bound on the number of random keys held in memory at once (random-key sampler).
_MAX_KEYS_PER_CHUNK = 1 << 22


class AvailabilityRow(TypedDict):
    """One row of :func:`availability_table`."""

    tp: int
    published: float | None
    exact: float
    sampled: float
    ci: float


def _as_int(name: str, value: object) -> int:
    """Return ``value`` as a Python ``int`` or raise ``TypeError`` naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def _check_tp(tp: object) -> int:
    tp_i = _as_int("tp", tp)
    if tp_i < 1:
        raise ValueError(f"tp must be >= 1, got {tp_i}")
    return tp_i


def _check_cluster(n_gpus: object, n_failed: object, tp: object) -> tuple[int, int, int]:
    """Validate the arguments shared by the exact and sampled estimators."""
    tp_i = _check_tp(tp)
    n_i = _as_int("n_gpus", n_gpus)
    f_i = _as_int("n_failed", n_failed)
    if n_i < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_i}")
    if n_i % tp_i != 0:
        raise ValueError(f"n_gpus ({n_i}) must be a multiple of tp ({tp_i})")
    if f_i < 0:
        raise ValueError(f"n_failed must be >= 0, got {f_i}")
    if f_i > n_i:
        raise ValueError(f"n_failed ({f_i}) must not exceed n_gpus ({n_i})")
    return n_i, f_i, tp_i


def availability_exact(n_gpus: int, n_failed: int, tp: int) -> float:
    """Expected fraction of TP groups without a failed GPU (exact, hypergeometric).

    Exactly ``n_failed`` distinct GPUs fail, every such set being equally likely.

    Parameters
    ----------
    n_gpus : int
        Number of GPUs ``N`` in the cluster; a positive multiple of ``tp``.
    n_failed : int
        Number of failed GPUs ``f``, ``0 <= f <= N``.
    tp : int
        Tensor-parallel degree, i.e. GPUs per TP group; ``tp >= 1``.

    Returns
    -------
    float
        ``C(N - tp, f) / C(N, f)``, the probability that a given group has no failed
        GPU, which equals the expected fraction of available groups (and GPUs).

    Raises
    ------
    ValueError
        If an argument is out of range or ``n_gpus`` is not a multiple of ``tp``.
    TypeError
        If an argument is not an integer.

    Notes
    -----
    Computed as ``prod_{i=0}^{tp-1} (N - f - i) / (N - i)``: ``tp`` factors in
    ``[0, 1]``, so the cost is ``O(tp)`` and the result is accurate to a few ulp for
    any ``N`` (no large binomial coefficients are formed).

    Examples
    --------
    >>> round(availability_exact(32768, 32, 64), 5)
    0.93933
    >>> round(availability_exact(8, 2, 4), 6)  # C(4, 2) / C(8, 2) = 6 / 28
    0.214286
    """
    n, f, t = _check_cluster(n_gpus, n_failed, tp)
    if f > n - t:
        return 0.0  # too many failures to leave any group intact
    result = 1.0
    for i in range(t):
        result *= (n - f - i) / (n - i)
    return result


def availability_binomial(p_fail: float, tp: int) -> float:
    """Availability when every GPU fails independently with probability ``p_fail``.

    Parameters
    ----------
    p_fail : float
        Per-GPU failure probability, ``0 <= p_fail <= 1``.
    tp : int
        Tensor-parallel degree; ``tp >= 1``.

    Returns
    -------
    float
        ``(1 - p_fail) ** tp``.

    Raises
    ------
    ValueError
        If ``p_fail`` is not a finite number in ``[0, 1]`` or ``tp < 1``.

    Notes
    -----
    This is the ``N -> infinity`` limit of :func:`availability_exact` with
    ``f / N = p_fail`` held fixed. It is never smaller than the exact value at
    ``p_fail = f / N``; their ratio satisfies
    ``log(binomial / exact) <= p * tp * (tp - 1) / (2 * (N - tp + 1 - f))``.

    Examples
    --------
    >>> round(availability_binomial(0.001, 64), 5)
    0.93797
    """
    t = _check_tp(tp)
    p = float(p_fail)
    if not math.isfinite(p) or not 0.0 <= p <= 1.0:
        raise ValueError(f"p_fail must be a probability in [0, 1], got {p_fail!r}")
    return (1.0 - p) ** t


def _sample_failed_floyd(
    rng: np.random.Generator, n_gpus: int, n_failed: int, samples: int
) -> npt.NDArray[np.int64]:
    """Draw ``samples`` uniform ``n_failed``-subsets of ``range(n_gpus)`` (Floyd).

    Robert Floyd's algorithm, vectorised across samples: for ``j = N-f, ..., N-1`` draw
    ``t`` uniform on ``[0, j]`` and add ``t``, or ``j`` if ``t`` was already chosen. The
    loop runs over the ``f`` draws, not over samples; cost ``O(samples * f**2)``.
    Returns an array of shape ``(samples, n_failed)`` with distinct entries per row.
    """
    chosen = np.empty((samples, n_failed), dtype=np.int64)
    for k, j in enumerate(range(n_gpus - n_failed, n_gpus)):
        t = rng.integers(0, j + 1, size=samples, dtype=np.int64)
        taken = (chosen[:, :k] == t[:, None]).any(axis=1)
        chosen[:, k] = np.where(taken, j, t)
    return chosen


def _sampled_groups_floyd(
    rng: np.random.Generator, n_gpus: int, n_failed: int, tp: int, samples: int
) -> npt.NDArray[np.float64]:
    """Per-sample fraction of available groups using :func:`_sample_failed_floyd`."""
    n_groups = n_gpus // tp
    groups = np.sort(_sample_failed_floyd(rng, n_gpus, n_failed, samples) // tp, axis=1)
    n_hit = 1 + np.count_nonzero(np.diff(groups, axis=1), axis=1)
    return 1.0 - n_hit / n_groups


def _sampled_groups_keys(
    rng: np.random.Generator, n_gpus: int, n_failed: int, tp: int, samples: int
) -> npt.NDArray[np.float64]:
    """Per-sample fraction of available groups using random sort keys.

    The failed GPUs of a sample are the ``n_failed`` smallest of ``n_gpus`` i.i.d.
    uniform keys (found with ``argpartition``), a uniform random subset. Cost
    ``O(samples * n_gpus)``; samples are processed in batches so that at most
    ``_MAX_KEYS_PER_CHUNK`` keys are held in memory at once.
    """
    n_groups = n_gpus // tp
    out = np.empty(samples, dtype=np.float64)
    batch = max(1, _MAX_KEYS_PER_CHUNK // n_gpus)
    for start in range(0, samples, batch):
        m = min(batch, samples - start)
        keys = rng.random((m, n_gpus))
        idx = np.argpartition(keys, n_failed - 1, axis=1)[:, :n_failed]
        failed = np.zeros((m, n_gpus), dtype=bool)
        np.put_along_axis(failed, idx, True, axis=1)
        group_ok = ~failed.reshape(m, n_groups, tp).any(axis=2)
        out[start : start + m] = group_ok.mean(axis=1)
    return out


def _sampled_fractions(
    n_gpus: int, n_failed: int, tp: int, samples: int, seed: int, method: str = "auto"
) -> npt.NDArray[np.float64]:
    """Per-sample available-group fractions (arguments assumed validated)."""
    if n_failed == 0:
        return np.ones(samples, dtype=np.float64)
    rng = np.random.default_rng(seed)
    if method == "auto":
        method = "floyd" if n_failed * n_failed <= _FLOYD_FACTOR * n_gpus else "keys"
    if method == "floyd":
        return _sampled_groups_floyd(rng, n_gpus, n_failed, tp, samples)
    if method == "keys":
        return _sampled_groups_keys(rng, n_gpus, n_failed, tp, samples)
    raise ValueError(f"method must be 'auto', 'floyd' or 'keys', got {method!r}")


def availability_sampled(
    n_gpus: int, n_failed: int, tp: int, *, samples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Monte Carlo estimate of :func:`availability_exact`.

    Each sample draws ``n_failed`` distinct GPUs uniformly at random and records the
    fraction of TP groups without a failed GPU.

    Parameters
    ----------
    n_gpus : int
        Number of GPUs; a positive multiple of ``tp``.
    n_failed : int
        Number of failed GPUs, ``0 <= n_failed <= n_gpus``.
    tp : int
        Tensor-parallel degree; ``tp >= 1``.
    samples : int, default 2000
        Number of independent failure sets; at least 2.
    seed : int, default 0
        Non-negative seed for :func:`numpy.random.default_rng`. The result is a
        deterministic function of all arguments. The failure sets depend only on
        ``(n_gpus, n_failed, samples, seed)``, so calls differing only in ``tp`` see
        the same failures (common random numbers).

    Returns
    -------
    mean : float
        Mean available fraction over the samples.
    ci : float
        Half-width of the normal-approximation 95 % confidence interval,
        ``1.96 * std / sqrt(samples)`` with the sample standard deviation (ddof=1).

    Raises
    ------
    ValueError
        If an argument is out of range (see :func:`availability_exact`), ``samples < 2``
        or ``seed < 0``.

    Notes
    -----
    Sampling is vectorised over samples. For ``f**2 <= 16 N`` a vectorised Floyd
    algorithm is used (cost ``O(samples * f**2)``; 2000 samples at ``N = 32768``,
    ``f = 32`` take ~10 ms); otherwise the failed set is the ``f`` smallest of ``N``
    random keys (cost ``O(samples * N)``, processed in memory-bounded batches).

    Examples
    --------
    >>> mean, ci = availability_sampled(32768, 32, 64, samples=2000, seed=0)
    >>> abs(mean - availability_exact(32768, 32, 64)) < 4 * ci / 1.96
    True
    """
    n, f, t = _check_cluster(n_gpus, n_failed, tp)
    s = _as_int("samples", samples)
    if s < 2:
        raise ValueError(f"samples must be >= 2, got {s}")
    sd = _as_int("seed", seed)
    if sd < 0:
        raise ValueError(f"seed must be >= 0, got {sd}")
    fractions = _sampled_fractions(n, f, t, s, sd)
    mean = float(fractions.mean())
    ci = _Z95 * float(fractions.std(ddof=1)) / math.sqrt(s)
    return mean, ci


def availability_table(
    n_gpus: int,
    n_failed: int,
    tps: Iterable[int],
    *,
    samples: int = 2000,
    seed: int = 0,
) -> list[AvailabilityRow]:
    """Exact and sampled availability for several TP degrees.

    Parameters
    ----------
    n_gpus : int
        Number of GPUs; a multiple of every ``tp`` in ``tps``.
    n_failed : int
        Number of failed GPUs.
    tps : iterable of int
        TP degrees, one row each, in the given order.
    samples : int, default 2000
        Monte Carlo samples per row (see :func:`availability_sampled`).
    seed : int, default 0
        Seed used for every row (so all rows share the same failure sets).

    Returns
    -------
    list of AvailabilityRow
        Dicts with keys ``tp``, ``published`` (the value from
        :data:`PUBLISHED_AVAILABILITY` if ``(n_gpus, n_failed)`` is the paper's scenario
        ``(PAPER_N_GPUS, PAPER_N_FAILED)`` and ``tp`` is listed there, else ``None``),
        ``exact``, ``sampled`` and ``ci`` (95 % half-width of ``sampled``).
        All availabilities are fractions in ``[0, 1]``.
    """
    is_paper = (n_gpus, n_failed) == (PAPER_N_GPUS, PAPER_N_FAILED)
    rows: list[AvailabilityRow] = []
    for tp in tps:
        mean, ci = availability_sampled(n_gpus, n_failed, tp, samples=samples, seed=seed)
        rows.append(
            AvailabilityRow(
                tp=tp,
                published=PUBLISHED_AVAILABILITY.get(tp) if is_paper else None,
                exact=availability_exact(n_gpus, n_failed, tp),
                sampled=mean,
                ci=ci,
            )
        )
    return rows
