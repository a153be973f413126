"""Hypothesis profiles for the property tests (docs/testing.md).

``ci`` (the default) is quick and deterministic: few examples, derandomized,
no example database writes that could change later runs. ``thorough`` draws
many more examples for a local run::

    HYPOTHESIS_PROFILE=thorough .venv/bin/pytest tests/test_properties.py
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=150,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
