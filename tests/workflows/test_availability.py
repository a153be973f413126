"""Tests for ntp_opt.workflows.availability."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest

from ntp_opt.workflows.availability import (
    PAPER_N_FAILED,
    PAPER_N_GPUS,
    PUBLISHED_AVAILABILITY,
    _sample_failed_floyd,
    _sampled_fractions,
    availability_binomial,
    availability_exact,
    availability_sampled,
    availability_table,
)

PP = 0.01  # one percentage point, as a fraction


def _available_fraction(failed: tuple[int, ...], n_gpus: int, tp: int) -> Fraction:
    """Fraction of TP groups (blocks of tp consecutive GPUs) without a failed GPU."""
    hit = {gpu // tp for gpu in failed}
    n_groups = n_gpus // tp
    return Fraction(n_groups - len(hit), n_groups)


def _brute_force_distribution(n_gpus: int, n_failed: int, tp: int) -> Counter[Fraction]:
    """Exact distribution of the available fraction over all failure sets."""
    return Counter(
        _available_fraction(failed, n_gpus, tp)
        for failed in itertools.combinations(range(n_gpus), n_failed)
    )


def _brute_force_mean(n_gpus: int, n_failed: int, tp: int) -> Fraction:
    dist = _brute_force_distribution(n_gpus, n_failed, tp)
    return sum((value * count for value, count in dist.items()), Fraction(0)) / dist.total()


# --------------------------------------------------------------------------- exact


@pytest.mark.parametrize(
    ("n_gpus", "tp", "n_failed"),
    [
        (8, 1, 3),
        (8, 2, 0),
        (8, 2, 3),
        (8, 4, 2),
        (8, 4, 5),  # more failures than fit outside one group -> 0
        (8, 8, 1),
        (9, 3, 4),
        (10, 5, 5),
        (10, 2, 7),
        (12, 3, 2),
        (12, 4, 6),
        (12, 6, 7),
        (12, 2, 12),
        (12, 12, 0),
    ],
)
def test_exact_matches_brute_force(n_gpus: int, tp: int, n_failed: int) -> None:
    expected = _brute_force_mean(n_gpus, n_failed, tp)
    assert availability_exact(n_gpus, n_failed, tp) == pytest.approx(float(expected), abs=1e-14)


@pytest.mark.parametrize("tp", [8, 64])
def test_exact_converges_to_binomial(tp: int) -> None:
    # With p = f/N, the exact value is prod_i (1 - x_i) with x_i = f / (N - i), i < tp,
    # and the binomial value is (1 - p)^tp with p = x_0 <= x_i. Since -log(1 - x) is
    # convex with slope in [1/(1-p), 1/(1-x_i)] on [p, x_i], and x_i - p = f i / (N (N-i)):
    #   p tp (tp-1) / (2 N)  <=  log(binomial / exact)  <=  p tp (tp-1) / (2 (N-tp+1-f)).
    # The two bounds differ by a factor N / (N - tp + 1 - f) ~ 1 + p, so this pins the
    # exact value down to a relative 1e-3 of its (O(1/N)) distance from the binomial.
    p = 0.001
    gaps = []
    for n_gpus in (64_000, 640_000, 1_024_000):
        n_failed = round(p * n_gpus)
        exact = availability_exact(n_gpus, n_failed, tp)
        binom = availability_binomial(p, tp)
        log_ratio = math.log(binom / exact)
        lower = p * tp * (tp - 1) / (2 * n_gpus)
        upper = p * tp * (tp - 1) / (2 * (n_gpus - tp + 1 - n_failed))
        # 1e-12 absorbs float rounding in the tp-factor product (~tp ulp).
        assert lower - 1e-12 <= log_ratio <= upper + 1e-12
        gaps.append(binom - exact)
    assert gaps[0] > gaps[1] > gaps[2] > 0
    # The gap shrinks like 1/N (N grows 16x from the first to the last cluster) and at
    # N ~ 1e6 is below 0.001 percentage point even for TP64.
    assert gaps[0] / gaps[2] == pytest.approx(16, rel=0.01)
    assert gaps[2] < 0.001 * PP


def test_exact_edge_cases() -> None:
    assert availability_exact(64, 0, 8) == 1.0
    assert availability_exact(64, 57, 8) == 0.0  # 57 > 64 - 8 failures hit every group
    assert availability_exact(64, 56, 8) > 0.0  # exactly one group can survive
    assert availability_exact(64, 64, 1) == 0.0
    assert availability_exact(1, 0, 1) == 1.0


def test_exact_is_decreasing_in_failures_and_tp() -> None:
    values = [availability_exact(1024, f, 16) for f in range(0, 200, 10)]
    assert all(a > b for a, b in itertools.pairwise(values))
    by_tp = [availability_exact(1024, 20, tp) for tp in (1, 2, 4, 8, 16, 32, 64)]
    assert all(a > b for a, b in itertools.pairwise(by_tp))


# ------------------------------------------------------------------------- sampled


def _chi_square(observed: Counter[object], expected_prob: dict[object, float], n: int) -> float:
    assert set(observed) <= set(expected_prob)
    return sum((observed[k] - n * q) ** 2 / (n * q) for k, q in expected_prob.items())


def test_floyd_sampler_draws_uniform_subsets() -> None:
    n_gpus, n_failed, samples = 7, 3, 35_000
    draws = _sample_failed_floyd(np.random.default_rng(1), n_gpus, n_failed, samples)
    assert draws.shape == (samples, n_failed)
    subsets = Counter(tuple(sorted(row)) for row in draws.tolist())
    assert all(len(set(s)) == n_failed for s in subsets)
    all_subsets = list(itertools.combinations(range(n_gpus), n_failed))
    chi2 = _chi_square(Counter(subsets), dict.fromkeys(all_subsets, 1 / len(all_subsets)), samples)
    # 34 degrees of freedom: mean 34, sd 8.2; 80 is > 5 sd above the mean.
    assert chi2 < 80


@pytest.mark.parametrize("method", ["floyd", "keys"])
@pytest.mark.parametrize(("n_gpus", "tp", "n_failed"), [(12, 4, 5), (12, 3, 3), (10, 2, 6)])
def test_sampler_distribution_matches_brute_force(
    method: str, n_gpus: int, tp: int, n_failed: int
) -> None:
    # Not just the mean: the whole distribution of the per-sample available fraction.
    # Categories are the number of available groups (integers, no float keys).
    n_groups = n_gpus // tp
    dist = _brute_force_distribution(n_gpus, n_failed, tp)
    total = dist.total()
    expected: dict[object, float] = {int(v * n_groups): c / total for v, c in dist.items()}
    samples = 20_000
    fractions = _sampled_fractions(n_gpus, n_failed, tp, samples, seed=3, method=method)
    observed: Counter[object] = Counter(np.rint(fractions * n_groups).astype(int).tolist())
    chi2 = _chi_square(observed, expected, samples)
    # <= 3 degrees of freedom here; P(chi2_3 > 25) ~ 2e-5.
    assert chi2 < 25


@pytest.mark.parametrize(
    ("n_gpus", "n_failed", "tp"),
    [
        (32768, 32, 8),
        (32768, 32, 64),
        (1024, 20, 8),
        (96, 10, 3),
        (1024, 200, 4),  # f^2 > 16 N: random-key sampler
        (2048, 200, 16),  # f^2 > 16 N: random-key sampler
    ],
)
def test_sampled_mean_close_to_exact(n_gpus: int, n_failed: int, tp: int) -> None:
    mean, ci = availability_sampled(n_gpus, n_failed, tp, samples=2000, seed=0)
    exact = availability_exact(n_gpus, n_failed, tp)
    sigma = ci / 1.96
    assert ci > 0
    assert abs(mean - exact) <= 4 * sigma


@pytest.mark.parametrize("tp", sorted(PUBLISHED_AVAILABILITY))
def test_sampled_mean_within_ci_paper_scenario(tp: int) -> None:
    mean, ci = availability_sampled(PAPER_N_GPUS, PAPER_N_FAILED, tp, samples=2000, seed=0)
    assert abs(mean - availability_exact(PAPER_N_GPUS, PAPER_N_FAILED, tp)) <= ci


def test_confidence_interval_coverage() -> None:
    # The 95 % interval should contain the exact value in ~95 % of independent runs.
    # With 60 runs, Binomial(60, 0.95) has mean 57 and P(X < 50) ~ 1e-3.
    n_gpus, n_failed, tp = 1024, 20, 16
    exact = availability_exact(n_gpus, n_failed, tp)
    covered = 0
    for seed in range(60):
        mean, ci = availability_sampled(n_gpus, n_failed, tp, samples=300, seed=seed)
        covered += abs(mean - exact) <= ci
    assert 50 <= covered <= 60


@pytest.mark.parametrize(
    ("n_gpus", "n_failed", "tp"),
    # the last two use the random-key sampler (f^2 > 16 N)
    [(32768, 32, 8), (32768, 32, 64), (1024, 200, 4), (2048, 200, 16)],
)
def test_ci_half_width_matches_exact_variance(n_gpus: int, n_failed: int, tp: int) -> None:
    # The number of intact groups X is a sum of G indicators with
    # P(one group intact) = q1 = C(N-tp, f)/C(N, f) and
    # P(two given groups intact) = q2 = C(N-2tp, f)/C(N, f), so
    # Var(X) = G q1 + G (G-1) q2 - (G q1)^2 exactly; the per-sample available fraction
    # is X / G. The reported half-width must be 1.96 sd / sqrt(samples); with 2000
    # samples the sample sd is within a few percent of the true sd.
    samples = 2000
    g = n_gpus // tp
    q1 = Fraction(math.comb(n_gpus - tp, n_failed), math.comb(n_gpus, n_failed))
    q2 = Fraction(math.comb(n_gpus - 2 * tp, n_failed), math.comb(n_gpus, n_failed))
    var_fraction = (g * q1 + g * (g - 1) * q2 - (g * q1) ** 2) / g**2
    expected_ci = 1.96 * math.sqrt(var_fraction) / math.sqrt(samples)
    _, ci = availability_sampled(n_gpus, n_failed, tp, samples=samples, seed=5)
    assert ci == pytest.approx(expected_ci, rel=0.1)


def test_sampled_is_deterministic_for_seed() -> None:
    a = availability_sampled(4096, 50, 32, samples=500, seed=7)
    b = availability_sampled(4096, 50, 32, samples=500, seed=7)
    c = availability_sampled(4096, 50, 32, samples=500, seed=8)
    assert a == b
    assert a != c
    d = availability_sampled(64, 40, 8, samples=500, seed=7)  # random-key sampler
    assert d == availability_sampled(64, 40, 8, samples=500, seed=7)


def test_sampled_degenerate_cases() -> None:
    assert availability_sampled(64, 0, 8, samples=10) == (1.0, 0.0)
    assert availability_sampled(64, 60, 8, samples=10) == (0.0, 0.0)
    assert availability_sampled(64, 64, 8, samples=10) == (0.0, 0.0)


# --------------------------------------------------------------------------- paper


@pytest.mark.parametrize("tp", sorted(PUBLISHED_AVAILABILITY))
def test_published_values_match_exact(tp: int) -> None:
    exact = availability_exact(PAPER_N_GPUS, PAPER_N_FAILED, tp)
    assert abs(exact - PUBLISHED_AVAILABILITY[tp]) <= 0.1 * PP


@pytest.mark.parametrize("tp", sorted(PUBLISHED_AVAILABILITY))
def test_published_values_match_sampled(tp: int) -> None:
    mean, _ = availability_sampled(PAPER_N_GPUS, PAPER_N_FAILED, tp, samples=2000, seed=0)
    assert abs(mean - PUBLISHED_AVAILABILITY[tp]) <= 0.2 * PP


def test_paper_scenario_constants() -> None:
    # 0.1 % of the paper's cluster, rounded down; the alternatives documented in the
    # module docstring (33 failures, or i.i.d. p = 0.001) do not match TP64 to 0.1 pp.
    assert PAPER_N_FAILED == math.floor(0.001 * PAPER_N_GPUS)
    assert abs(availability_exact(PAPER_N_GPUS, 33, 64) - PUBLISHED_AVAILABILITY[64]) > 0.1 * PP
    assert abs(availability_binomial(0.001, 64) - PUBLISHED_AVAILABILITY[64]) >= 0.1 * PP


def test_availability_table() -> None:
    rows = availability_table(PAPER_N_GPUS, PAPER_N_FAILED, [8, 64, 128], samples=200, seed=1)
    assert [r["tp"] for r in rows] == [8, 64, 128]
    assert rows[0]["published"] == PUBLISHED_AVAILABILITY[8]
    assert rows[2]["published"] is None  # TP128 not reported in the paper
    for row in rows:
        assert set(row) == {"tp", "published", "exact", "sampled", "ci"}
        tp = row["tp"]
        assert row["exact"] == availability_exact(PAPER_N_GPUS, PAPER_N_FAILED, tp)
        expected = availability_sampled(PAPER_N_GPUS, PAPER_N_FAILED, tp, samples=200, seed=1)
        assert (row["sampled"], row["ci"]) == expected
    # Published values belong to the paper's scenario only.
    other = availability_table(1024, 8, [8], samples=50, seed=0)
    assert other[0]["published"] is None


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: availability_exact(100, 1, 8), "n_gpus"),
        (lambda: availability_exact(-8, 1, 8), "n_gpus"),
        (lambda: availability_exact(0, 0, 8), "n_gpus"),
        (lambda: availability_exact(64, -1, 8), "n_failed"),
        (lambda: availability_exact(64, 65, 8), "n_failed"),
        (lambda: availability_exact(64, 1, 0), "tp"),
        (lambda: availability_exact(64, 1, -8), "tp"),
        (lambda: availability_sampled(100, 1, 8), "n_gpus"),
        (lambda: availability_sampled(64, 65, 8), "n_failed"),
        (lambda: availability_sampled(64, -1, 8), "n_failed"),
        (lambda: availability_sampled(64, 1, 0), "tp"),
        (lambda: availability_sampled(64, 1, 8, samples=1), "samples"),
        (lambda: availability_sampled(64, 1, 8, seed=-1), "seed"),
        (lambda: availability_binomial(-0.1, 8), "p_fail"),
        (lambda: availability_binomial(1.5, 8), "p_fail"),
        (lambda: availability_binomial(float("nan"), 8), "p_fail"),
        (lambda: availability_binomial(0.1, 0), "tp"),
        (lambda: availability_table(100, 1, [8], samples=10), "n_gpus"),
    ],
)
def test_invalid_input_raises_value_error(call: Callable[[], object], argument: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        call()


def test_non_integer_input_raises_type_error() -> None:
    with pytest.raises(TypeError, match="n_failed"):
        availability_exact(64, 1.5, 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tp"):
        availability_exact(64, 1, True)
