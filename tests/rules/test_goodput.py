"""The goodput formula against hand computations, and the exact batch split
against brute-force enumeration."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ntp_opt.model.job import Job
from ntp_opt.rules import goodput as gp


def job(**kw):
    base = dict(tp=8, pp=1, dp=4, global_batch=16)
    base.update(kw)
    return Job(**base)


def test_replica_speed_hand():
    j = job(seq_time_s=2.0, power_exponent=0.5)
    # t/T = 6/8, slowest stage: min(1.21**0.5 * 0.9, 1.0 * 0.95) = min(0.99, 0.95)
    v = gp.replica_speed(j, 6, [0.9, 0.95], [1.21, 1.0])
    assert v == pytest.approx(0.75 * 0.95 / 2.0)
    v = gp.replica_speed(j, 6, [0.8, 0.95], [1.21, 1.0])
    assert v == pytest.approx(0.75 * 1.1 * 0.8 / 2.0)


def test_replica_speed_tp_efficiency():
    j = job(tp_efficiency={7: 1.1, 8: 0.9})
    assert gp.replica_speed(j, 7, [1.0], [1.0]) == pytest.approx(7 * 1.1 / (8 * 0.9))


def test_goodput_hand_and_overhead():
    j = job(reshard_overhead=0.05)
    # two full replicas: theta = max(4/1, 4/1) = 4, no overhead
    assert gp.goodput(j, [8, 8], [4, 4], [1.0, 1.0]) == pytest.approx(2.0)
    # one at TP7 (speed 7/8): theta = max(4, 3/(7/8)) * 1.05
    theta = max(4.0, 3 / 0.875) * 1.05
    assert gp.step_time(j, [8, 7], [4, 3], [1.0, 0.875]) == pytest.approx(theta)
    assert gp.goodput(j, [8, 7], [4, 3], [1.0, 0.875]) == pytest.approx(7 / theta)
    assert gp.relative_goodput(j, 4.0) == pytest.approx(1.0)
    assert gp.goodput(j, [], [], []) == 0.0


def brute_force(j: Job, speeds, tps):
    """Best (goodput, batches) over every integer batch vector, by enumeration."""
    best = None
    cap = j.local_batch_max
    for bs in itertools.product(range(1, cap + 1), repeat=len(speeds)):
        total = sum(bs)
        if j.batch_policy == "fixed" and total != j.global_batch:
            continue
        if total > j.global_batch:
            continue
        theta = max(b / v for b, v in zip(bs, speeds, strict=True))
        if any(t < j.tp for t in tps):
            theta *= 1 + j.reshard_overhead
        value = total / theta
        if best is None or value > best[0] + 1e-12:
            best = (value, bs)
    return best


@pytest.mark.parametrize("policy", ["fixed", "elastic"])
@pytest.mark.parametrize("seed", range(40))
def test_split_batch_matches_enumeration(policy, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    cap = int(rng.integers(1, 6))
    big_b = int(rng.integers(n, n * cap + 2))
    j = Job(tp=8, pp=1, dp=n, global_batch=big_b, max_local_batch=cap, batch_policy=policy)
    speeds = list(rng.choice([0.5, 0.75, 0.875, 0.9, 1.0, 1.1], size=n))
    tps = [8 if s >= 1 else 7 for s in speeds]
    split = gp.split_batch(j, speeds, tps)
    expect = brute_force(j, speeds, tps)
    if expect is None:
        assert split is None
        return
    assert split is not None
    assert split.goodput == pytest.approx(expect[0], rel=1e-12)
    assert all(1 <= b <= cap for b in split.batches)
    if policy == "fixed":
        assert sum(split.batches) == big_b
    else:
        assert sum(split.batches) <= big_b
    # the split's own figures agree with the formula
    assert gp.goodput(j, tps, list(split.batches), speeds) == pytest.approx(split.goodput)


def test_a_fixed_batch_every_replica_must_fill_takes_every_cap():
    """``B = n * cap``: no choice is left; the step time is the slowest replica's
    ``cap / v`` with the resharding overhead."""
    j = Job(tp=8, pp=1, dp=3, global_batch=6, max_local_batch=2, batch_policy="fixed")
    split = gp.split_batch(j, [1.0, 0.5, 0.8], [8, 7, 8])
    assert split is not None and split.batches == (2, 2, 2)
    assert split.step_time == pytest.approx(2 / 0.5 * (1 + j.reshard_overhead), rel=1e-15)
    assert split.goodput == pytest.approx(6 / split.step_time, rel=1e-15)


def test_split_prefers_full_batches_on_ties():
    j = job(batch_policy="elastic")
    split = gp.split_batch(j, [1.0] * 4, [8] * 4)
    assert split is not None and split.batches == (4, 4, 4, 4)


def test_split_infeasible_cases():
    j = job(batch_policy="fixed")
    assert gp.split_batch(j, [1.0] * 3, [8] * 3) is None  # 3 x 4 < 16
    assert gp.split_batch(job(global_batch=2, batch_policy="elastic"), [1.0] * 3, [8] * 3) is None
    assert gp.split_batch(j, [1.0, 0.0, 1.0, 1.0], [8] * 4) is None
    paused = gp.split_batch(j, [], [])
    assert paused is not None and paused.goodput == 0.0 and math.isinf(paused.step_time)


def test_split_large_is_fast():
    j = Job(tp=32, pp=8, dp=4096, global_batch=65536, batch_policy="elastic")
    rng = np.random.default_rng(0)
    speeds = rng.choice([0.875, 0.9375, 1.0], size=4096)
    split = gp.split_batch(j, speeds, [32] * 4096)
    assert split is not None and sum(split.batches) <= 65536
