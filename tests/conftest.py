"""Hypothesis profiles for the property tests (docs/testing.md).

``ci`` (the default) is quick and deterministic: few examples, derandomized,
no example database writes that could change later runs. ``thorough`` draws
many more examples for a local run::

    HYPOTHESIS_PROFILE=thorough .venv/bin/pytest tests/test_properties.py
"""

from __future__ import annotations

import os
import signal

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

# pytest-xdist workers start with SIGINT ignored, and a child process started
# with SIGINT ignored never raises KeyboardInterrupt: the Ctrl-C tests
# (test_control.py, test_hostile.py) need Python's default handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
