"""Job defaults and validation (docs/model.md, spec section 2)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ntp_opt.model.job import Job


def test_defaults():
    j = Job(tp=32, pp=8, dp=128, global_batch=2048)
    assert j.tp_min == 28  # ceil(7 * 32 / 8)
    assert j.allowed == (28, 29, 30, 31, 32)
    assert j.dp_max == 128 and j.max_local_batch == 16
    assert j.batch_policy == "fixed" and j.power_exponent == 0.65
    assert j.max_boost == 0.3 and j.idle_power_fraction == 0.1 and j.reshard_overhead == 0.01
    assert Job(tp=8, pp=1, dp=3, global_batch=10).max_local_batch == 4  # ceil(10 / 3)
    assert Job(tp=72, pp=1, dp=1, global_batch=1).tp_min == 63


def test_tp_helpers():
    j = Job(tp=32, tp_allowed=(28, 30, 32), pp=1, dp=1, global_batch=1, tp_efficiency={30: 1.02})
    assert j.largest_allowed(31) == 30 and j.largest_allowed(27) is None
    assert j.tp_factor(30) == pytest.approx(30 * 1.02 / 32)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"tp": 0}, "tp"),
        ({"tp_min": 40}, "tp_min"),
        ({"tp_allowed": (16, 32)}, "outside"),
        ({"tp_allowed": (28, 30)}, "must contain the nominal degree"),
        ({"tp_efficiency": {30: -1.0}}, "tp_efficiency"),
        ({"global_batch": -5}, "global_batch"),
        ({"batch_policy": "sometimes"}, "batch_policy"),
        ({"max_boost": float("nan")}, "max_boost"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_invalid(kw, msg):
    spec = dict(tp=32, pp=8, dp=128, global_batch=2048)
    spec.update(kw)
    with pytest.raises(ValidationError, match=msg):
        Job(**spec)


def test_frozen():
    j = Job(tp=8, pp=1, dp=1, global_batch=1)
    with pytest.raises(ValidationError):
        j.tp = 4
